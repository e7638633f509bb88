"""Batched Newton-Schulz against torch's per-matrix one: the difference and the time.

For each matrix shape of the Llama-like 1B set (16 layers: 32 of 2048x2048, 32 of 512x2048,
32 of 5632x2048, 16 of 2048x5632), random bfloat16 matrices go through torch's own
``torch.optim._muon._zeropower_via_newtonschulz`` one at a time and through this package's
``batched_newton_schulz`` (``OptimizerConfig(batched_newton_schulz=True)``) in one stack. Prints,
per shape: whether the results are bit-identical, the max abs difference and how many elements
differ (results and normalised inputs), and the median ms of each way. This decides whether the
batched path may ever become the default (only if bit-identical on the GPU).

    PYTHONPATH=src python benchmarks/check_batched_ns.py [--device cuda] [--iters 5] [--scale 1]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_muon import _timed  # the same synchronised timer
from torch.optim._muon import _zeropower_via_newtonschulz

from mfsdp_optim.optim.seam import batched_newton_schulz

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS, EPS = 5, 1e-7
SET = [((2048, 2048), 32), ((512, 2048), 32), ((5632, 2048), 32), ((2048, 5632), 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="divide every matrix dim")
    args = ap.parse_args()
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {STEPS} steps, bfloat16")
    print(
        f"{'shape':>12} {'n':>3} {'identical':>9} {'max|diff|':>10} {'elems off':>10} "
        f"{'input off':>9} {'per-matrix ms':>13} {'batched ms':>10} {'speedup':>7}"
    )
    gen = torch.Generator().manual_seed(0)
    total_one, total_batch = 0.0, 0.0
    for (m, n), count in SET:
        shape = (m // args.scale, n // args.scale)
        stack = torch.randn(count, *shape, generator=gen).to(dev, torch.bfloat16)
        one_in = [stack[i].clone() for i in range(count)]
        ref = [_zeropower_via_newtonschulz(x, COEFFICIENTS, STEPS, EPS) for x in one_in]
        got_in = stack.clone()
        got, normalised = batched_newton_schulz(got_in, COEFFICIENTS, STEPS, EPS)
        diff = max(float((got[i].float() - ref[i].float()).abs().max()) for i in range(count))
        off = sum(int((got[i] != ref[i]).sum()) for i in range(count))
        in_off = sum(int((normalised[i] != one_in[i]).sum()) for i in range(count))
        t_one, t_batch = [], []
        for _ in range(args.iters):
            copies = [stack[i].clone() for i in range(count)]
            t_one.append(
                _timed(
                    dev,
                    lambda c=copies: [
                        _zeropower_via_newtonschulz(x, COEFFICIENTS, STEPS, EPS) for x in c
                    ],
                )
            )
            batch = stack.clone()
            t_batch.append(
                _timed(dev, lambda b=batch: batched_newton_schulz(b, COEFFICIENTS, STEPS, EPS))
            )
        one, bat = statistics.median(t_one), statistics.median(t_batch)
        total_one, total_batch = total_one + one, total_batch + bat
        print(
            f"{'x'.join(map(str, shape)):>12} {count:3d} {str(off == 0):>9} {diff:10.3e} "
            f"{off:10d} {in_off:9d} {one:13.2f} {bat:10.2f} {one / bat:7.2f}"
        )
    print(
        f"{'all':>12} {'':3} {'':>9} {'':>10} {'':>10} {'':>9} {total_one:13.2f} "
        f"{total_batch:10.2f} {total_one / total_batch:7.2f}"
    )


if __name__ == "__main__":
    main()
