"""The bias gradient's per-block column-sum launch (``backward.colsum_kernel``): its GPU
time per launch under other program widths, rows in flight and warps, with its bits.

After each ``token_chunk x vocab_chunk`` d_logits block the triton backend adds the
block's row-block column sums (fp32 ``[blocks, columns]``, 64 x 8192 at the pinned config)
to grad_bias in row order (``backward.add_column_sums``): a latency-bound read of 2 MiB.
A profiled S2 step on an H100 gave it 10.5 us per launch, 62 launches. Every variant
below sums each column's rows from +0.0 in the same order and adds the sum once, so its
bits must equal the pinned launch's (checked with ``torch.equal``).

    python benchmarks/colsum_launch.py [--rows 16,64,128] [--cols 8192] [--out f.json]

GPU time per launch: 50 launches captured in a CUDA graph, the graph replayed 20 times
after a warm-up (launch overhead of the host out of the figure), median of 5 rounds.
On CPU it checks the bits under Triton's interpreter at a small size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lp_kernels.backends.triton.backward import add_column_sums

VARIANTS = [  # (columns per program, rows in flight, warps)
    (32, 16, 1),  # add_column_sums' defaults
    (128, 16, 1),  # the one before it
    (32, 64, 1),
    (64, 32, 1),
    (64, 64, 1),
    (128, 64, 1),
    (128, 32, 2),
    (256, 16, 2),
    (256, 32, 4),
]


def gpu_us(fn, calls=50, replays=20, rounds=5):
    """GPU microseconds per call of ``fn``: ``calls`` calls in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (replays * calls))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,128")
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cols = args.cols if cuda else 1000
    results = []
    for b in (int(x) for x in args.rows.split(",")):
        if not cuda:
            b = min(b, 16)
        g = torch.Generator(device="cpu").manual_seed(b)
        part = torch.randn(b, cols + 24, generator=g).to(device)  # a padded row stride
        base = torch.randn(cols, generator=g).to(device)
        ref = base.clone()
        add_column_sums(ref, part)  # the defaults
        for block, rows, warps in VARIANTS if cuda else VARIANTS[:3]:
            out = base.clone()
            add_column_sums(out, part, block, rows, warps)
            same = torch.equal(out, ref)
            us = None
            if cuda:
                scratch_out = base.clone()
                us = gpu_us(
                    lambda o=scratch_out, p=part, bl=block, r=rows, w=warps: add_column_sums(
                        o, p, bl, r, w
                    )
                )
            results.append(
                {"rows": b, "cols": cols, "block": block, "rows_in_flight": rows,
                 "warps": warps, "bitwise": same, "us": us}
            )  # fmt: skip
            t = f"{us:7.2f} us" if us is not None else "   (cpu)"
            what = f"{b:4d} x {cols}  block {block:3d} rows {rows:2d} warps {warps}"
            print(f"{what}  {t}  bitwise {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if not all(r["bitwise"] for r in results):
        raise SystemExit("a variant's sums differ from the pinned launch's")


if __name__ == "__main__":
    main()
