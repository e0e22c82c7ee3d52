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
import types

import torch

from lp_bench.protocol import make_inputs, parse_shapes
from lp_kernels.backends.triton.backward import dlogits
from lp_kernels.backends.triton.config import config_for
from lp_kernels.backends.triton.forward import forward_stats
from lp_kernels.backends.triton.gemm import matmul_acc


def chunk_problem(shape: str, device: str = "cuda") -> types.SimpleNamespace:
    """The inputs of one backward chunk of ``shape`` (``token_chunk`` x ``vocab_chunk`` of the
    pinned config; the first rows and columns), as lp's d_logits and GEMM kernels take
    them, with a logprob-only upstream gradient (as ``lp bench``)."""
    ((_, n, h_dim, v),) = parse_shapes(shape)
    hidden, weight, targets, _ = make_inputs(n, h_dim, v, device=device)
    cfg = config_for(hidden.device, hidden.dtype)
    rows, cols = min(cfg.token_chunk, n), min(cfg.vocab_chunk, v)
    h_c, w_c = hidden[:rows], weight[:cols]
    with torch.no_grad():
        lse = torch.logsumexp((h_c @ weight.T).float(), dim=1)
    g_lp = torch.rand(rows, device=device)
    return types.SimpleNamespace(
        hidden=hidden, weight=weight, targets=targets, cfg=cfg, rows=rows, cols=cols,
        h_dim=h_dim, h_c=h_c, w_c=w_c, lse=lse, g_lp=g_lp, t_c=targets[:rows],
        p=types.SimpleNamespace(
            inv_temperature=1.0, max_v_local=v, return_entropy=False, ignore_index=-100,
            softcap=None, deterministic=False,
        ),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="S2")
    ap.add_argument("--forward", action="store_true", help="also the whole forward")
    args = ap.parse_args()
    c = chunk_problem(args.shape)
    hidden, weight, targets, cfg, p = c.hidden, c.weight, c.targets, c.cfg, c.p
    rows, cols, h_c, w_c, t_c, lse, g_lp = (
        c.rows, c.cols, c.h_c, c.w_c, c.t_c, c.lse, c.g_lp
    )  # fmt: skip
    h_dim = c.h_dim
    out = torch.empty(rows, cols, dtype=hidden.dtype, device="cuda")
    acc = torch.zeros(rows, h_dim, dtype=torch.float32, device="cuda")
    calls = {
        "cublas_logits": lambda: torch.mm(h_c, w_c.T, out=out),
        "lp_dlogits": lambda: dlogits(
            h_c, w_c, t_c, 0, lse, None, (g_lp, None, None), out, 0, cols, p, cfg
        ),
        "cublas_addmm": lambda: torch.addmm(acc, out, w_c, out_dtype=torch.float32, out=acc),
        "lp_grad_hidden_gemm": lambda: matmul_acc(acc, out, w_c, cfg, k_a=cols),
    }
    if args.forward:
        calls["cublas_full"] = lambda: hidden @ weight.T
        calls["lp_forward"] = lambda: forward_stats(hidden, weight, targets, 0, p, cfg)
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
