"""deterministic=True's fixed-point grad_hidden GEMM against the fp32 GEMM it stands in
for, on one backward chunk (GPU only).

    python benchmarks/fixed_gemm.py --shapes S2,S4 [--out f.json]

Times, on one ``token_chunk`` x ``vocab_chunk`` chunk of a shape (``anatomy.chunk_problem``):
cuBLAS's fp32-accumulating ``addmm``, lp's fp32 GEMM (the default path's grad_hidden) and
``triton_deterministic._matmul_fixed_`` (int64 += per-leaf rounded fp32 products) under
variants of its tiles, warps, pipeline depth, loop form and leaf width. Every fixed-point
variant must produce the same int64 sums as the pinned one (checked with ``torch.equal``
at each leaf width before timing; tile shapes and warps do not change a leaf's product).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
from anatomy import chunk_problem

import lp_kernels.backends.triton_deterministic as tdet
import lp_kernels.backends.triton_linear as tri
from lp_kernels.bench import steady_warmup, time_cuda

# name -> (FIXED_GPU tiles, FIXED_WARPS, num_stages or None (the pinned: the config's at
# 128-column leaves, FIXED_WIDE_STAGES at wider ones), FIXED_LOOP)
VARIANTS = {
    "pinned": (tdet.FIXED_GPU, None, None, "flat"),
    "nested": (tdet.FIXED_GPU, None, None, "nested"),
    "s2": (tdet.FIXED_GPU, None, 2, "flat"),
    "s3": (tdet.FIXED_GPU, None, 3, "flat"),
    "s4": (tdet.FIXED_GPU, None, 4, "flat"),
    "s5": (tdet.FIXED_GPU, None, 5, "flat"),
    "s6": (tdet.FIXED_GPU, None, 6, "flat"),
    "k128": ((128, 128, 128), None, None, "flat"),
    "k128-s2": ((128, 128, 128), None, 2, "flat"),
    "w4": (tdet.FIXED_GPU, 4, None, "flat"),
    "64x256": ((64, 256, 64), None, None, "flat"),
    "64x256-s5": ((64, 256, 64), None, 5, "flat"),
    "128x64": ((128, 64, 64), None, None, "flat"),
    "128x64-w4": ((128, 64, 64), 4, None, "flat"),
    "64x128-w4": ((64, 128, 64), 4, None, "flat"),
    "64x128-w4-s6": ((64, 128, 64), 4, 6, "flat"),
}


def fixed_call(c, a, acc_h, scale, leaf: int, variant: str):
    """A closure running the fixed-point GEMM of chunk ``c`` under ``variant``."""
    tiles, warps, stages, loop = VARIANTS[variant]
    cfg = c.cfg if stages is None else dataclasses.replace(c.cfg, num_stages=stages)

    def run():
        wide = tdet.FIXED_WIDE_STAGES
        tdet.FIXED_WARPS, tdet.FIXED_LOOP = warps, loop
        tdet.FIXED_WIDE_STAGES = wide if stages is None else stages  # leaves over 128
        try:
            tdet._matmul_fixed_(acc_h, a, c.w_c, scale, c.cols, tiles, cfg, leaf=leaf)
        finally:
            tdet.FIXED_WARPS, tdet.FIXED_LOOP, tdet.FIXED_WIDE_STAGES = None, "flat", wide

    return run


def chunk_operands(c):
    """A d_logits-like bf16 operand, an int64 sum and per-row power-of-two scales."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = (torch.randn(c.rows, c.cols, device="cuda", generator=gen) * 1e-3).to(c.hidden.dtype)
    acc_h = torch.zeros(c.rows, c.h_dim, dtype=torch.int64, device="cuda")
    scale = torch.full((c.rows,), 2.0**40, device="cuda")
    return a, acc_h, scale


def measure(shape: str, leaves: list[int], variants: list[str], reps: int, warm_s: float):
    c = chunk_problem(shape)
    a, acc_h, scale = chunk_operands(c)
    acc = torch.zeros(c.rows, c.h_dim, dtype=torch.float32, device="cuda")
    calls = {
        "cublas_addmm": lambda: torch.addmm(acc, a, c.w_c, out_dtype=torch.float32, out=acc),
        "lp_fp32_gemm": lambda: tri._matmul_acc_(acc, a, c.w_c, c.cfg, k_a=c.cols),
    }
    checks = {}
    for leaf in leaves:
        ref = None
        for v in variants:
            acc_h.zero_()
            try:
                fixed_call(c, a, acc_h, scale, leaf, v)()
            except Exception as exc:  # a variant may not compile or fit: report and go on
                checks[f"{v}/leaf{leaf}"] = repr(exc)[:200]
                continue
            if ref is None:
                ref = acc_h.clone()
            else:
                checks[f"{v}/leaf{leaf}"] = torch.equal(ref, acc_h)
            calls[f"{v}/leaf{leaf}"] = fixed_call(c, a, acc_h, scale, leaf, v)
    ms = {}
    for name, fn in calls.items():
        try:
            warm = steady_warmup(fn, 1, warm_s)
            ms[name] = statistics.median(time_cuda(fn, warmup=warm, reps=reps))
        except Exception as exc:  # a variant may not compile or fit: report and go on
            ms[name] = repr(exc)[:200]
    return {"shape": shape, "rows": c.rows, "cols": c.cols, "h": c.h_dim, "ms": ms,
            "equal_to_pinned": checks}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S2,S4")
    ap.add_argument("--leaves", default="128,1024,4096")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    leaves = [int(x) for x in args.leaves.split(",")]
    rows = [
        measure(s, leaves, args.variants.split(","), args.reps, args.warm_s)
        for s in args.shapes.split(",")
    ]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['shape']}: chunk {r['rows']} x {r['cols']}, H {r['h']}")
        base = r["ms"]["lp_fp32_gemm"]
        for name, t in r["ms"].items():
            if isinstance(t, str):
                print(f"   {name:22} {t}")
            else:
                print(f"   {name:22} {t:8.3f} ms  x lp fp32 {t / base:5.2f}")
        bad = [k for k, ok in r["equal_to_pinned"].items() if ok is not True]
        print(f"   sums equal to pinned: {'all' if not bad else 'NOT ' + ','.join(bad)}")


if __name__ == "__main__":
    main()
