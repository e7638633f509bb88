#!/usr/bin/env bash
# The GPU check: the whole test suite (every test marked cuda, and everything else) and a short
# smoke run of each GPU benchmark, on one CUDA device. Run it before calling an issue that
# touches a CUDA path resolved, and record its summary (date, card, result) in
# benchmarks/RESULTS.md.
#
#   scripts/gpu_check.sh                 # from the repository root; or: nox -s gpu
#   scripts/gpu_check.sh tests           # the whole suite only
#   scripts/gpu_check.sh tests-optim     # the suite in two halves: tests/optim ...
#   scripts/gpu_check.sh tests-other     # ... and every other folder of tests/
#   scripts/gpu_check.sh tests-1of4      # the suite's test files, sorted, in 4 slices: the 1st
#   scripts/gpu_check.sh tests-cuda      # the tests marked cuda only
#   scripts/gpu_check.sh bench           # the benchmarks' smoke runs only (about 4 minutes)
#   scripts/gpu_check.sh recipes         # the trainers' GPU recipes (scripts/accelerate_gpu.py)
#
# A machine that limits one command to 10 minutes takes the parts as separate commands: on
# 2026-12-07 the whole suite in one process did not fit 540 s on an H200 (473 of 1176 tests),
# nor did `tests-other` on an H100 (462 tests). So the suite runs in worker processes where
# pytest-xdist is importable (below): in 6 workers the whole suite took 162 s on an H100 (same
# day, 16 cores); `tests-1of4` ... `tests-4of4` take it in slices where that is not enough. A
# step cut by its time limit is stopped with SIGINT: pytest still lists the failures so far and
# the slowest 30 tests (in one process, MFSDP_GPU_WORKERS=0, the log also names each test as it
# starts, so it says where the run was).
# Needs python3 with torch (CUDA), triton, pytest, hypothesis and pytest-timeout; the package
# comes from src/ (PYTHONPATH), nothing is installed into python3's environment. Wheels in .whl/
# at the repository root (pytest, hypothesis, pytest-timeout, ... for an image without them;
# git ignores the folder: copy it to the GPU machine with the working tree)
# are installed first into ${MFSDP_WHEEL_SITE:-/tmp/site}, which goes on PYTHONPATH. Logs and
# summary.txt go under ${OUT:-gpu_out}. Exit status 1 when any step failed. The time limits of a
# suite step (540 s) and of the recipes (300 s) can be lowered with MFSDP_GPU_SUITE_LIMIT and
# MFSDP_GPU_RECIPE_LIMIT, to fit several parts into one 10-minute command.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the benchmarks run from benchmarks/
py=${PYTHON:-python3}
summary="$out/summary.txt"
failed=0
wanted=" ${*:-tests recipes bench} "
for part in $wanted; do
    case "$part" in
    tests | tests-optim | tests-other | tests-cuda | tests-[1-9]of[1-9] | bench | recipes) ;;
    *)
        echo "gpu_check.sh: unknown part '$part' (expected: tests, tests-optim, tests-other," \
            "tests-cuda, tests-KofN, bench, recipes)" >&2
        exit 2
        ;;
    esac
done

# wheels carried in .whl/ (an image without pytest and friends): installed beside, not into, the
# image's python (no index, no dependencies: the folder holds every wheel needed)
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${MFSDP_WHEEL_SITE:-/tmp/site}
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    "$py" - <<'PY'
import torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "missing"
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"device {name}, torch {torch.__version__}, cuda {torch.version.cuda}, triton {tv}")
PY
} | tee "$summary"

# step NAME SECONDS TAIL_LINES CMD...: run CMD with a time limit, its output in $out/NAME.log;
# prints the log's last lines and one summary line
step() {
    local name=$1 limit=$2 lines=$3
    shift 3
    local t0=$SECONDS rc=0
    echo "=== $name: $*"
    # SIGINT at the limit: pytest then still prints its failures, skips and slowest tests
    timeout --signal=INT --kill-after=20 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    tail -n "$lines" "$out/$name.log"
    local verdict="ok"
    if [ "$rc" -ne 0 ]; then
        verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
        failed=1
    fi
    echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$summary"
}

# the whole suite: the tests marked cuda (collection fails when a test that touches CUDA is
# not: tests/_cuda_rule.py) and every other test, which runs here too (gloo ranks whose params
# land on CUDA where a test does not name a device). -rs lists the skips.
# suite NAME PATH...: pytest over PATHs as step NAME (-v: each test's name in the log; -rs lists
# the skips, -rf the failures; --timeout: one hung test cannot eat the step's whole limit)
# With pytest-xdist importable (its wheel and execnet's in .whl/), the tests run in
# ${MFSDP_GPU_WORKERS:-6} worker processes (each with its own pools of gloo ranks; 0: one
# process, the log then naming each test as it starts): the suite is about 1,200 tests, which
# one process did not run within a 10-minute command.
workers=()
n_workers=${MFSDP_GPU_WORKERS:-6}
if [ "$n_workers" != 0 ] && "$py" -c "import xdist" 2>/dev/null; then
    workers=(-n "$n_workers")
fi
suite() {
    local name=$1
    shift
    step "$name" "${MFSDP_GPU_SUITE_LIMIT:-540}" 60 "$py" -m pytest "$@" \
        ${workers[@]+"${workers[@]}"} -v -rfs --timeout=120 --durations=30 -p no:cacheprovider
    {
        grep -E "[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s" "$out/$name.log" | tail -n 1
        grep -E "^tests marked cuda:" "$out/$name.log" | tail -n 1  # tests/conftest.py's line
    } | sed 's/^/  /' | tee -a "$summary"
}
[[ "$wanted" == *" tests "* ]] && suite tests tests
[[ "$wanted" == *" tests-optim "* ]] && suite tests-optim tests/optim
if [[ "$wanted" == *" tests-other "* ]]; then
    # every folder of tests/ but optim/ (the collection rule of tests/conftest.py runs on each)
    others=()
    for d in tests/*/; do
        case "$d" in tests/optim/ | tests/data/) ;; *) others+=("${d%/}") ;; esac
    done
    suite tests-other "${others[@]}"
fi
[[ "$wanted" == *" tests-cuda "* ]] && suite tests-cuda tests -m cuda
for part in $wanted; do
    if [[ "$part" =~ ^tests-([1-9])of([1-9])$ ]]; then
        k=${BASH_REMATCH[1]} n=${BASH_REMATCH[2]}
        # the K-th of N contiguous slices of the sorted test files (every folder's conftest
        # and collection rule still apply: pytest is given the files)
        mapfile -t files < <(find tests -name 'test_*.py' -not -path 'tests/data/*' | sort)
        per=$(((${#files[@]} + n - 1) / n))
        slice=("${files[@]:$(((k - 1) * per)):$per}")
        [ "${#slice[@]}" -gt 0 ] && suite "$part" "${slice[@]}"
    fi
done

# accelerate's FSDP2 path engages only on a GPU: the recipe of mfsdp_optim.integrations.accelerate
# against stock AdamW, with save_state / load_state (needs accelerate installed)
[[ "$wanted" == *" recipes "* ]] && step recipes "${MFSDP_GPU_RECIPE_LIMIT:-300}" 14 "$py" scripts/accelerate_gpu.py

if [[ "$wanted" != *" bench "* ]]; then
    echo "--- summary ($summary)"
    cat "$summary"
    exit "$failed"
fi

# each GPU benchmark, tiny sizes and few iterations (numbers are smoke, not results)
cd benchmarks
step bench_step 90 12 "$py" bench_step.py --sets 3000x512x256 --count-scale 0.1 \
    --modes fused,foreach --iters 5 --warmup 2
step bench_step_host 150 6 "$py" bench_step.py --host-time --host-counts 300,3000,30000 \
    --iters 10 --warmup 2
step bench_replay 90 10 "$py" bench_replay.py --device cuda --counts 300,3000 --iters 5
step bench_step_llama 90 8 "$py" bench_step.py --model llama1b --scale 0.05 \
    --count-scale 0.125 --modes fused --iters 3 --warmup 2
step bench_loop 120 14 "$py" bench_loop.py --layers 2 --iters 5 --warmup 3 --rounds 2
step bench_stats 90 8 "$py" bench_stats.py --scale 0.05 --warmup 2 --repeats 5
step bench_triton_adam 60 8 "$py" bench_triton_adam.py --iters 3
step bench_muon 60 6 "$py" bench_muon.py --device cuda --layers 1 --steps 2 --scale 4 --cpu-scale 16
step bench_agreement 60 8 "$py" bench_agreement.py --backend nccl --world 1 --warmup 5 \
    --repeats 20
cd ..

# the ratios of the smoke runs (smoke sizes: indicative only; scripts/gpu_bench.sh for figures)
{
    echo "--- ratios (smoke sizes)"
    grep -h "fused: floor" "$out/bench_step.log" 2>/dev/null
    grep -h "host time of one step" "$out/bench_step_host.log" 2>/dev/null
    grep -h "median of .* rounds\|capture(s)" "$out/bench_loop.log" 2>/dev/null
} | tee -a "$summary"

echo "--- summary ($summary)"
cat "$summary"
exit "$failed"
