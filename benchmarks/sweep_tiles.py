"""Time Triton tile configurations of the lp triton backend (forward and backward apart).

Tile configs are pinned in lp_kernels.backends.triton_linear (a different tile is a
different summation order); this script is how the pinned one was chosen. GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from protocol import SHAPES, make_inputs, time_cuda

import lp_kernels.backends.triton_linear as tlin
from lp_kernels import linear_logprob

VARIANTS = {
    "base": {},
    "bv256": {"block_v": 256},
    "bn64-bv256-w4": {"block_n": 64, "block_v": 256, "num_warps": 4},
    "w4-s4": {"num_warps": 4, "num_stages": 4},
    "bh128-s2": {"block_h": 128, "num_stages": 2},
    "mm128x256": {"mm_block_n": 256},
    "chunk16k": {"vocab_chunk": 16384},
    "bv256-mm256": {"block_v": 256, "mm_block_n": 256},
    "bv256-mm256-s4": {"block_v": 256, "mm_block_n": 256, "num_stages": 4},
    "bv256-mm256-w4": {"block_v": 256, "mm_block_n": 256, "num_warps": 4},
    "bn256-bv128-mm256": {"block_n": 256, "mm_block_n": 256},
    "bv256-mm256x128": {"block_v": 256, "mm_block_m": 256},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S3,S4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = tlin.GPU_CONFIG
    rows = []
    for s in args.shapes.split(","):
        n, h, v = SHAPES[s]
        hidden, weight, targets, grad_out = make_inputs(n, h, v)
        floor = 4 * statistics.median(
            time_cuda(lambda h=hidden, w=weight: h @ w.T, warmup=2, reps=5)
        )
        hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        for name in args.variants.split(","):
            tlin.GPU_CONFIG = dataclasses.replace(base, **VARIANTS[name])

            def fwd(hl=hl, wl=wl, targets=targets):
                return linear_logprob(hl, wl, targets, backend="triton", validate=False).logprob

            def step(hl=hl, wl=wl, grad_out=grad_out, fwd=fwd):
                hl.grad = wl.grad = None
                fwd().backward(grad_out)

            try:
                t_f = statistics.median(time_cuda(fwd, warmup=2, reps=5))
                t_all = statistics.median(time_cuda(step, warmup=1, reps=5))
                row = {
                    "shape": s,
                    "variant": name,
                    "fwd_ms": t_f,
                    "total_ms": t_all,
                    "bwd_ms": t_all - t_f,
                    "floor_ms": floor,
                    "x_floor": t_all / floor,
                }
            except Exception as exc:  # report and go on: a variant may not compile
                row = {"shape": s, "variant": name, "error": repr(exc)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    tlin.GPU_CONFIG = base
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'shape':5} {'variant':16} {'fwd':>8} {'bwd':>8} {'total':>8} {'x floor':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:5} {r['variant']:16} {r['error']}")
        else:
            print(
                f"{r['shape']:5} {r['variant']:16} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                f"{r['total_ms']:8.2f} {r['x_floor']:7.3f}"
            )


if __name__ == "__main__":
    main()
