"""fp32 inputs on the GPU: the triton backend's tiles of session 8 against the earlier ones.

Exact fp32 dots (``input_precision="ieee"``) compile to FMAs. Up to session 7, 4-byte
inputs took the bf16 tiles (128 x 256) with K steps of 32, which ptxas compiles to 32
registers and a ~12 KB stack frame per thread; ``triton_linear.FP32_TILES`` (64 x 128, K
steps of 16) compiles without spills. This times forward + backward of one fp32 problem
under both, against the floor of 4 cuBLAS fp32 GEMMs (TF32 off), and checks both against
an fp64 reference. GPU only.

    python benchmarks/fp32_tiles.py [--n 4096 --h 2048 --v 32768] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from protocol import make_inputs, time_cuda

import lp_kernels.backends.triton_linear as tri
from lp_kernels import linear_logprob
from lp_testing import reference_all

OLD_TILES = {"block_h": 32, "mm_block_k": 32}  # on top of the bf16 GPU_CONFIG, as before


def _step(hidden, weight, targets, grad):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    out = linear_logprob(h, w, targets, backend="triton", validate=False)
    out.logprob.backward(grad)
    return out.logprob.detach(), h.grad, w.grad


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=2048)
    ap.add_argument("--v", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, targets, grad = make_inputs(args.n, args.h, args.v, dtype=torch.float32)
    truth = reference_all(hidden, weight, targets, grad_logprob=grad)
    ref = (truth["logprob"], truth["grad_hidden"], truth["grad_weight"])
    floor = 4 * statistics.median(time_cuda(lambda: hidden @ weight.T, warmup=2, reps=args.reps))
    rows = {}
    new_tiles = dict(tri.FP32_TILES)
    for name, tiles in (("session 8 tiles", new_tiles), ("earlier tiles", OLD_TILES)):
        tri.FP32_TILES = tiles
        try:
            got = _step(hidden, weight, targets, grad)
            ms = statistics.median(
                time_cuda(lambda: _step(hidden, weight, targets, grad), warmup=1, reps=args.reps)
            )
        finally:
            tri.FP32_TILES = new_tiles
        rows[name] = {
            "tiles": tiles,
            "ms": ms,
            "x_floor": ms / floor,
            "err_logprob": _rel(got[0], ref[0]),
            "err_grad_hidden": _rel(got[1], ref[1]),
            "err_grad_weight": _rel(got[2], ref[2]),
        }
    record = {"shape": [args.n, args.h, args.v], "floor_ms": floor, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"fp32 N={args.n} H={args.h} V={args.v}: floor (4 cuBLAS fp32 GEMMs) {floor:.2f} ms")
    for name, r in rows.items():
        print(
            f"  {name:16s} {r['ms']:9.2f} ms  {r['x_floor']:6.2f} x floor  err logprob "
            f"{r['err_logprob']:.2e}  grad_h {r['err_grad_hidden']:.2e}  "
            f"grad_w {r['err_grad_weight']:.2e}"
        )


if __name__ == "__main__":
    main()
