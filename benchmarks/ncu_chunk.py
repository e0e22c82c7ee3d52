"""One backward chunk's kernels, each launched once, for Nsight Compute (GPU only).

Runs, after a warm-up that compiles everything, cuBLAS and lp's kernel for the same work
on one chunk (``token_chunk`` x ``vocab_chunk``) of a shape: the logits GEMM against lp's
d_logits kernel, the fp32-accumulating GEMM against lp's grad_hidden GEMM, and the whole
forward (cuBLAS ``h @ W^T`` against lp's forward statistics). Under ``ncu`` their
hardware counters say where lp's kernels lose time against cuBLAS's::

    ncu --clock-control none --nvtx --nvtx-include "measured/" --section SpeedOfLight \\
        --section WarpStateStats --section LaunchStats -o prof \\
        python3 benchmarks/ncu_chunk.py --shape S2 --forward

(``--clock-control none``: leave the GPU's clocks alone, see the device notes.) Without
ncu it just runs. ``ncu_summary.py`` turns the report's raw CSV into one line per call;
``gpu_suite.sh ncu`` runs both.
"""

from __future__ import annotations

import argparse

import torch
from anatomy import chunk_problem

import lp_kernels.backends.triton_linear as tri


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="S2")
    ap.add_argument("--forward", action="store_true", help="also the whole forward")
    ap.add_argument(
        "--gluon", action="store_true",
        help="also the non-accumulating GEMM: cuBLAS, lp's Triton kernel and the Gluon "
        "experiment's persistent and warp-specialized kernels (gluon_kernels.py)",
    )  # fmt: skip
    ap.add_argument(
        "--fixed", action="store_true",
        help="also deterministic=True's fixed-point grad_hidden GEMM (fixed_gemm.py)",
    )  # fmt: skip
    args = ap.parse_args()
    c = chunk_problem(args.shape)
    hidden, weight, targets, cfg, p = c.hidden, c.weight, c.targets, c.cfg, c.p
    rows, cols, h_c, w_c, t_col, lse, c0, g_lp = (
        c.rows, c.cols, c.h_c, c.w_c, c.t_col, c.lse, c.c0, c.g_lp
    )  # fmt: skip
    h_dim = c.h_dim
    out = torch.empty(rows, cols, dtype=hidden.dtype, device="cuda")
    acc = torch.zeros(rows, h_dim, dtype=torch.float32, device="cuda")
    calls = {
        "cublas_logits": lambda: torch.mm(h_c, w_c.T, out=out),
        "lp_dlogits": lambda: tri._dlogits(
            h_c, w_c, t_col, lse, None, g_lp, None, c0, out, 0, cols, p, cfg
        ),
        "cublas_addmm": lambda: torch.addmm(acc, out, w_c, out_dtype=torch.float32, out=acc),
        "lp_grad_hidden_gemm": lambda: tri._matmul_acc_(acc, out, w_c, cfg, k_a=cols),
    }
    if args.gluon:
        from gluon_anatomy import gluon_mm, gluon_ws_mm

        calls["cublas_mm0"] = lambda: torch.addmm(
            acc, out, w_c, beta=0, out_dtype=torch.float32, out=acc
        )
        calls["lp_mm0"] = lambda: tri._matmul_acc_(acc, out, w_c, cfg, k_a=cols, accumulate=False)
        calls["gluon_mm0"] = lambda: gluon_mm(acc, out, w_c, cols, accumulate=False)
        calls["gluon_ws_mm0"] = lambda: gluon_ws_mm(acc, out, w_c, cols, accumulate=False)
    if args.fixed:  # deterministic=True's fixed-point GEMM, 1024-column leaves
        from fixed_gemm import chunk_operands, fixed_call

        a, acc_h, scale = chunk_operands(c)
        calls["lp_fixed_leaf1024"] = fixed_call(c, a, acc_h, scale, 1024, "pinned")
        calls["lp_fixed_leaf1024_nested"] = fixed_call(c, a, acc_h, scale, 1024, "nested")
    if args.forward:
        calls["cublas_full"] = lambda: hidden @ weight.T
        calls["lp_forward"] = lambda: tri.forward_stats(hidden, weight, targets, p, cfg)
    for fn in calls.values():  # compile and warm up, outside the "measured" NVTX range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measured")
    for name, fn in calls.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()
    print("ran", ", ".join(calls))


if __name__ == "__main__":
    main()
