#!/usr/bin/env bash
# The full GPU figures of issue 36 (targets in docs/benchmarks.md and benchmarks/RESULTS.md), on
# one CUDA device; each run within about 4 minutes on an H100/H200. Record the printed lines in
# benchmarks/RESULTS.md with the date and the card.
#
#   scripts/gpu_bench.sh                  # all six; logs under ${OUT:-gpu_out}/bench_full_*.log
#   scripts/gpu_bench.sh step b2b         # some of: step b2b llama host replay loop (a command
#                                         # limited to 10 minutes takes two or three each)
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
cd ..
exit "$failed"
