"""Where the triton backend's kernels lose time against cuBLAS, one chunk at a time.

For each shape, on one backward chunk (``token_chunk`` rows x ``vocab_chunk`` columns of
the pinned config) and on the whole forward, times at steady clocks (as ``lp bench``):

- ``cublas_logits``: ``h @ W^T`` of the chunk, bf16 out (cuBLAS);
- ``triton_logits``: the same product through lp's logit-tile code (``_logits_tile``:
  tiles, grouped order, descriptor loads and pipeline of the pinned config), storing the
  plain bf16 logits: the d_logits kernel without its softmax epilogue;
- ``dlogits``: lp's d_logits kernel on the chunk (logprob upstream gradient only, as in
  ``lp bench``);
- ``cublas_addmm`` / ``triton_acc``: the grad_hidden GEMM of the chunk accumulated into
  fp32 (cuBLAS ``addmm`` with fp32 output, and lp's ``_matmul_acc_``);
- ``cublas_full`` / ``forward``: the whole ``[N, H] x [H, V]`` GEMM against lp's forward
  statistics kernel.

So ``triton_logits / cublas_logits`` is what the Triton GEMM structure costs, and
``dlogits / triton_logits`` what the epilogue adds. GPU only.

    python benchmarks/anatomy.py --shapes S1,S2,S4 [--out anatomy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch
import triton
import triton.language as tl
from protocol import SHAPES, make_inputs, time_cuda

import lp_kernels.backends.triton_linear as tri
from lp_kernels.backends.triton_linear import _grouped, _logits_tile
from lp_kernels.bench import steady_warmup


@triton.jit
def _plain_logits_kernel(
    h_src, w_src, out_ptr, N, H, V, group,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """bf16 ``h W^T`` through the d_logits kernel's tile code, with a plain store."""
    i_n, i_v = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), group)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_n = o_n < N
    m_v = o_v < V
    b_z = _logits_tile(
        h_src, w_src, i_n * BLOCK_N, i_v * BLOCK_V, m_n, m_v, H, stride_hn, stride_hh,
        stride_wv, stride_wh, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, INTERPRET, PRECISION, TMA,
    )  # fmt: skip
    p_o = out_ptr + o_n[:, None].to(tl.int64) * stride_on + o_v[None, :]
    tl.store(p_o, b_z.to(out_ptr.dtype.element_ty), mask=m_n[:, None] & m_v[None, :])


def plain_logits(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg) -> None:
    n, h_dim = h.shape
    v = w.shape[0]
    blocks_n = triton.cdiv(n, cfg.block_n)
    h_src, w_src, tma = tri._logits_sources(h, w, cfg)
    _plain_logits_kernel[(blocks_n * triton.cdiv(v, cfg.block_v),)](
        h_src, w_src, out, n, h_dim, v, tri._group(cfg, blocks_n),
        h.stride(0), h.stride(1), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, TMA=tma,
        **tri._flags(h, cfg), **tri._launch_opts(cfg, h.device, logits=True),
    )  # fmt: skip


def chunk_problem(shape: str, device: str = "cuda") -> types.SimpleNamespace:
    """The inputs of one backward chunk of ``shape`` (``token_chunk`` x ``vocab_chunk`` of the
    pinned config; the first rows and columns), as lp's d_logits and GEMM kernels take
    them, with a logprob-only upstream gradient (as ``lp bench``). Shared by this script,
    ``gluon_anatomy.py`` and ``ncu_chunk.py``."""
    n, h_dim, v = SHAPES[shape]
    hidden, weight, targets, _ = make_inputs(n, h_dim, v, device=device)
    cfg = tri.config_for(hidden.device, hidden.dtype)
    rows, cols = min(cfg.token_chunk, n), min(cfg.vocab_chunk, v)
    h_c, w_c = hidden[:rows], weight[:cols]
    with torch.no_grad():
        lse = torch.logsumexp((h_c @ weight.T).float(), dim=1)
    c0 = -torch.rand(rows, device=device)  # d logprob / d lse = -g_lp
    return types.SimpleNamespace(
        hidden=hidden, weight=weight, targets=targets, cfg=cfg, rows=rows, cols=cols,
        h_dim=h_dim, h_c=h_c, w_c=w_c, lse=lse, c0=c0, g_lp=-c0,
        t_col=torch.where(targets[:rows] < cols, targets[:rows], -1),
        p=types.SimpleNamespace(inv_temperature=1.0, max_v_local=v, return_entropy=False),
    )  # fmt: skip


def anatomy(shape: str, reps: int, warm_s: float, device: str = "cuda") -> dict:
    c = chunk_problem(shape, device)
    hidden, weight, targets, cfg, p = c.hidden, c.weight, c.targets, c.cfg, c.p
    rows, cols, h_c, w_c, t_col, lse, c0, g_lp = (
        c.rows, c.cols, c.h_c, c.w_c, c.t_col, c.lse, c.c0, c.g_lp
    )  # fmt: skip
    out = torch.empty(rows, cols, dtype=hidden.dtype, device=device)
    acc = torch.zeros(rows, c.h_dim, dtype=torch.float32, device=device)
    calls = {
        "cublas_logits": lambda: torch.mm(h_c, w_c.T, out=out),
        "triton_logits": lambda: plain_logits(h_c, w_c, out, cfg),
        "dlogits": lambda: tri._dlogits(
            h_c, w_c, t_col, lse, None, g_lp, None, c0, out, 0, cols, p, cfg
        ),
        "cublas_addmm": lambda: torch.addmm(acc, out, w_c, out_dtype=torch.float32, out=acc),
        "triton_acc": lambda: tri._matmul_acc_(acc, out, w_c, cfg, k_a=cols),
        "cublas_full": lambda: hidden @ weight.T,
        "forward": lambda: tri.forward_stats(hidden, weight, targets, p, cfg),
    }
    ms = {}
    for name, fn in calls.items():
        warm = steady_warmup(fn, 1, warm_s, device=device)
        ms[name] = statistics.median(time_cuda(fn, warmup=warm, reps=reps))
    ratios = {
        "triton_logits / cublas_logits": ms["triton_logits"] / ms["cublas_logits"],
        "dlogits / triton_logits": ms["dlogits"] / ms["triton_logits"],
        "dlogits / cublas_logits": ms["dlogits"] / ms["cublas_logits"],
        "triton_acc / cublas_addmm": ms["triton_acc"] / ms["cublas_addmm"],
        "forward / cublas_full": ms["forward"] / ms["cublas_full"],
    }
    return {"shape": shape, "rows": rows, "cols": cols, "ms": ms, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S2,S4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [anatomy(s, args.reps, args.warm_s) for s in args.shapes.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        times = ", ".join(f"{k} {v:.3f}" for k, v in r["ms"].items())
        print(f"{r['shape']} chunk {r['rows']} x {r['cols']} (ms): {times}")
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))


if __name__ == "__main__":
    main()
