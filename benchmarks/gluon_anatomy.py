"""Session 8: the backward's two lp kernels on one chunk, Triton against Gluon and cuBLAS.

For each shape, on one backward chunk (``token_chunk`` x ``vocab_chunk`` of the pinned
config), at steady clocks (as ``lp bench``), in ms:

- ``cublas_logits``: ``h @ W^T`` of the chunk, bf16 out (cuBLAS);
- ``triton_dlogits``: lp's d_logits kernel (Triton);
- ``gluon_dlogits`` / ``gluon_dlogits_np``: the same tiles and epilogue as a persistent,
  pipelined Gluon kernel (``gluon_kernels.py`` beside this script), and the same kernel on
  one program per tile (not persistent);
- ``cublas_addmm``: the grad_hidden GEMM of the chunk accumulated into fp32 (cuBLAS);
- ``triton_acc`` / ``triton_acc_cptr``: lp's GEMM with C through a tensor descriptor
  (session 8) and through pointers;
- ``gluon_acc`` / ``gluon_mm0``: the Gluon GEMM, accumulating and overwriting.

Checks printed with the table: Gluon's d_logits against Triton's (bitwise, max |diff|);
both GEMM epilogues against each other (bitwise) and every GEMM's relative error against
an fp32 product. GPU (Hopper) only.

    python benchmarks/gluon_anatomy.py --shapes S1,S2,S3,S4 [--out gluon.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import gluon_kernels as gm
import torch
import triton
from anatomy import chunk_problem
from protocol import time_cuda
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDesc

import lp_kernels.backends.triton_linear as tri
from lp_kernels.bench import steady_warmup


def _gdesc(t: torch.Tensor, rows: int, cols: int, block: list[int]) -> GluonDesc:
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dt)
    return GluonDesc(t, [rows, cols], [t.stride(0), 1], block, layout)


def _programs(tiles: int, persistent: bool) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return min(sms, tiles) if persistent else tiles


def gluon_dlogits(h, w, t_col, lse, c0, g_lp, out, v_count, *, persistent=True, stages=3):
    n, h_dim = h.shape
    v_store = out.shape[1]
    tiles = triton.cdiv(n, 128) * triton.cdiv(v_store, 256)
    gm._dlogits_kernel[(_programs(tiles, persistent),)](
        _gdesc(h, n, h_dim, [128, 64]), _gdesc(w, w.shape[0], h_dim, [256, 64]),
        _gdesc(out, n, v_store, [128, 256]), t_col, lse, lse, g_lp, g_lp, c0,
        n, h_dim, 0, v_count, v_store, 1.0, 8,
        ENTROPY=False, HAS_LP=True, IGNORED=tri.IGNORED, STAGES=stages, num_warps=8,
    )  # fmt: skip


def gluon_mm(c, a, b, k_a, *, accumulate, persistent=True, stages=4, ws=False):
    """The Gluon GEMM: persistent and pipelined, or (``ws``) warp-specialized."""
    m = a.shape[0]
    n = b.shape[1]
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 256)
    kernel, opts = (gm._matmul_ws_kernel, {"maxnreg": 168}) if ws else (gm._matmul_acc_kernel, {})
    kernel[(_programs(tiles, persistent or ws),)](
        _gdesc(a, m, k_a, [128, 64]), _gdesc(b, b.shape[0], n, [64, 256]), c,
        m, n, max(a.shape[1], k_a), c.stride(0), 8,
        ACC=accumulate, STAGES=stages, num_warps=8, **opts,
    )  # fmt: skip


def gluon_ws_mm(c, a, b, k_a, *, accumulate, stages=4):
    return gluon_mm(c, a, b, k_a, accumulate=accumulate, stages=stages, ws=True)


def _triton_acc(acc, out, w_c, cfg, cols, c_tma: bool, accumulate: bool = True):
    old = tri.C_TMA
    tri.C_TMA = c_tma
    try:
        tri._matmul_acc_(acc, out, w_c, cfg, k_a=cols, accumulate=accumulate)
    finally:
        tri.C_TMA = old


def run(shape: str, reps: int, warm_s: float) -> dict:
    c = chunk_problem(shape)
    cfg, p = c.cfg, c.p
    rows, cols, h_dim, h_c, w_c, t_col, lse, c0, g_lp = (
        c.rows, c.cols, c.h_dim, c.h_c, c.w_c, c.t_col, c.lse, c.c0, c.g_lp
    )  # fmt: skip
    hidden = c.hidden
    out_t = torch.empty(rows, cols, dtype=hidden.dtype, device="cuda")
    out_g = torch.empty_like(out_t)
    logits = torch.empty_like(out_t)

    # checks, once
    tri._dlogits(h_c, w_c, t_col, lse, None, g_lp, None, c0, out_t, 0, cols, p, cfg)
    gluon_dlogits(h_c, w_c, t_col, lse, c0, g_lp, out_g, cols)
    torch.cuda.synchronize()
    checks = {
        "dlogits_bitwise": bool(torch.equal(out_t, out_g)),
        "dlogits_max_abs_diff": float((out_t.float() - out_g.float()).abs().max()),
    }
    base = torch.randn(rows, h_dim, device="cuda")
    ref = base.double() + out_t.double() @ w_c.double()
    results = {}
    for name, fn in {
        "triton_acc": lambda c: _triton_acc(c, out_t, w_c, cfg, cols, True),
        "triton_acc_cptr": lambda c: _triton_acc(c, out_t, w_c, cfg, cols, False),
        "gluon_acc": lambda c: gluon_mm(c, out_t, w_c, cols, accumulate=True),
    }.items():
        c = base.clone()
        fn(c)
        results[name] = c
        checks[f"{name}_rel_err"] = float((c.double() - ref).norm() / ref.norm())
    checks["acc_cdesc_vs_cptr_bitwise"] = bool(
        torch.equal(results["triton_acc"], results["triton_acc_cptr"])
    )
    checks["acc_gluon_vs_triton_bitwise"] = bool(
        torch.equal(results["gluon_acc"], results["triton_acc"])
    )
    c1 = torch.empty(rows, h_dim, device="cuda")
    c2 = torch.empty(rows, h_dim, device="cuda")
    _triton_acc(c1, out_t, w_c, cfg, cols, True, accumulate=False)
    gluon_mm(c2, out_t, w_c, cols, accumulate=False)
    checks["mm0_gluon_vs_triton_bitwise"] = bool(torch.equal(c1, c2))
    c3 = torch.empty(rows, h_dim, device="cuda")
    gluon_ws_mm(c3, out_t, w_c, cols, accumulate=False)
    checks["mm0_ws_vs_triton_bitwise"] = bool(torch.equal(c1, c3))

    acc = torch.zeros(rows, h_dim, dtype=torch.float32, device="cuda")
    calls = {
        "cublas_logits": lambda: torch.mm(h_c, w_c.T, out=logits),
        "triton_dlogits": lambda: tri._dlogits(
            h_c, w_c, t_col, lse, None, g_lp, None, c0, out_t, 0, cols, p, cfg
        ),
        "gluon_dlogits": lambda: gluon_dlogits(h_c, w_c, t_col, lse, c0, g_lp, out_g, cols),
        "gluon_dlogits_np": lambda: gluon_dlogits(
            h_c, w_c, t_col, lse, c0, g_lp, out_g, cols, persistent=False
        ),
        "cublas_addmm": lambda: torch.addmm(acc, out_t, w_c, out_dtype=torch.float32, out=acc),
        "triton_acc": lambda: _triton_acc(acc, out_t, w_c, cfg, cols, True),
        "triton_acc_cptr": lambda: _triton_acc(acc, out_t, w_c, cfg, cols, False),
        "gluon_acc": lambda: gluon_mm(acc, out_t, w_c, cols, accumulate=True),
        "triton_mm0": lambda: _triton_acc(acc, out_t, w_c, cfg, cols, True, False),
        "gluon_mm0": lambda: gluon_mm(acc, out_t, w_c, cols, accumulate=False),
        "cublas_mm0": lambda: torch.addmm(
            acc, out_t, w_c, beta=0, out_dtype=torch.float32, out=acc
        ),
        "gluon_ws_mm0": lambda: gluon_ws_mm(acc, out_t, w_c, cols, accumulate=False),
        "gluon_ws_mm0_s3": lambda: gluon_ws_mm(acc, out_t, w_c, cols, accumulate=False, stages=3),
    }
    ms = {}
    for name, fn in calls.items():
        try:
            warm = steady_warmup(fn, 1, warm_s)
            ms[name] = statistics.median(time_cuda(fn, warmup=warm, reps=reps))
        except Exception as exc:  # a variant that fails to compile or launch is reported
            ms[name] = None
            checks[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return {"shape": shape, "rows": rows, "cols": cols, "ms": ms, "checks": checks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S2,S3,S4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for s in args.shapes.split(","):
        rows.append(run(s, args.reps, args.warm_s))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    names = list(rows[0]["ms"])
    print("| shape | " + " | ".join(names) + " |")
    for r in rows:
        cells = ["-" if r["ms"][k] is None else f"{r['ms'][k]:.3f}" for k in names]
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    for r in rows:
        ms = r["ms"]

        def ratio(a, b, ms=ms):
            return "-" if ms[a] is None or ms[b] is None else f"{ms[a] / ms[b]:.3f}"

        print(
            f"{r['shape']}: triton_dlogits/cublas {ratio('triton_dlogits', 'cublas_logits')}, "
            f"gluon_dlogits/cublas {ratio('gluon_dlogits', 'cublas_logits')}, "
            f"triton_acc/cublas {ratio('triton_acc', 'cublas_addmm')}, "
            f"cptr/cublas {ratio('triton_acc_cptr', 'cublas_addmm')}, "
            f"gluon_acc/cublas {ratio('gluon_acc', 'cublas_addmm')}, "
            f"triton_mm0/cublas {ratio('triton_mm0', 'cublas_mm0')}, "
            f"gluon_mm0/cublas {ratio('gluon_mm0', 'cublas_mm0')}, "
            f"ws_mm0/cublas {ratio('gluon_ws_mm0', 'cublas_mm0')}"
        )


if __name__ == "__main__":
    main()
