#!/usr/bin/env bash
# The full GPU figures of issue 36 (targets in docs/benchmarks.md and benchmarks/RESULTS.md), on
# one CUDA device; each run within about 4 minutes on an H100/H200. Record the printed lines in
# benchmarks/RESULTS.md with the date and the card.
#
#   scripts/gpu_bench.sh                  # all six; logs under ${OUT:-gpu_out}/bench_full_*.log
#   scripts/gpu_bench.sh step b2b         # some of: step b2b llama host replay loop (a command
#                                         # limited to 10 minutes takes two or three each)
#   scripts/gpu_bench.sh async            # the first and later asynchronous saves (not in "all")
#   scripts/gpu_bench.sh compare          # the step beside another commit's (not in "all"):
#                                         # its package renamed mfsdp_prev under ${MFSDP_PREV:-.prev}
#       (made here: mkdir -p /tmp/p .prev && git archive <commit> src/mfsdp_optim | tar -x -C /tmp/p
#        && mv /tmp/p/src/mfsdp_optim .prev/mfsdp_prev; the device tool carries .prev)
#
# Same needs as scripts/gpu_check.sh (python3 with torch for CUDA and triton; package from src/).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the benchmarks run from benchmarks/
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
failed=0

wanted=" ${*:-step b2b llama host replay loop} "

run() {
    local name=$1 key=$2
    shift 2
    case "$wanted" in *" $key "*) ;; *) return 0 ;; esac
    echo "=== $name: $*"
    if ! timeout --kill-after=10 270 "$@" >"$out/$name.log" 2>&1; then
        echo "$name: FAILED (see $out/$name.log)"
        failed=1
    fi
    grep -v "^warm-up\\|^round" "$out/$name.log" | tail -n 12
}

cd benchmarks
# one synchronised step (target: captured <= 1.5x the floor) and back to back (<= 1.2x)
run bench_full_3000 step "$py" bench_step.py --sets 3000x512x256 --modes fused --iters 30
run bench_full_3000_b2b b2b "$py" bench_step.py --sets 3000x512x256 --modes fused --iters 30 \
    --back-to-back 4
# the Llama-like 1B set (target: <= 1.2x the 28 B/element floor)
run bench_full_llama llama "$py" bench_step.py --model llama1b --modes fused --iters 20
# host time of one step() at 300, 3,000 and 30,000 tensors (target: <= 0.1 ms, flat)
run bench_full_host host "$py" bench_step.py --host-time --iters 50 --warmup 5
# a replay's host time per tensor: the check alone, the launch alone, the previous check beside
run bench_full_replay replay "$py" bench_replay.py --device cuda --iters 30
# the training loop (target: graph >= 1.35x stock)
run bench_full_loop loop "$py" bench_loop.py
# the first asynchronous save, prepared and not, and the later ones, against the copy floor
run bench_full_async async "$py" bench_async_save.py --saves 3
# the step against another commit's, in both build orders (the wrapper built first in a run
# times a few percent slower: take the geometric mean of the two orders' ratios)
prev=$(cd .. && cd "${MFSDP_PREV:-.prev}" 2>/dev/null && pwd)
if [[ "$wanted" == *" compare "* ]] && [ ! -d "$prev/mfsdp_prev" ]; then
    echo "compare: no ${MFSDP_PREV:-.prev}/mfsdp_prev (see this script's header)"
    failed=1
else
    for first in "" --compare-first; do
        run "bench_full_compare_3000${first:+_first}" compare "$py" bench_step.py \
            --sets 3000x512x256 --modes fused --iters 10 --compare "mfsdp_prev=$prev" $first
        run "bench_full_compare_llama${first:+_first}" compare "$py" bench_step.py \
            --model llama1b --modes fused --iters 10 --compare "mfsdp_prev=$prev" $first
    done
fi
cd ..
exit "$failed"
