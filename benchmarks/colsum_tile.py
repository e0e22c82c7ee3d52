"""The bias gradient's column sums inside the d_logits kernel: ``tl.sum`` over the rows of
the tile (what ``backward.dlogits_kernel`` does) against a reduce-scatter over the lanes
(``column_sums`` below), checked and timed on one d_logits block.

On the Hopper MMA accumulator of a 128 x 256 tile (a warp holds 16 rows; a row's low three
bits lie across lanes, its fourth in each thread's registers), ``tl.sum(b_dz, axis=0)``
shuffles each thread's column values through the three lane rounds, then again across the
warps after a trip through shared memory. ``column_sums`` adds each thread's two rows,
then runs three reduce-scatter rounds, each passing half the remaining columns to the lane
that keeps them (a swap by integer ``xor``: one shuffle), and lets the warps' partial sums
meet last. Compiled into the biased d_logits tile for ``sm_90`` (``python -m
lp_testing.aot --options --sass --only dlogits_kernel``, the kernel patched), per thread:

| Triton | shuffles | instructions, bias | instructions, bias + softcap |
|---|---|---|---|
| 3.6, ``tl.sum`` | 220 | 3552 | 4192 |
| 3.6, ``column_sums`` | 84 | 3248 | 3880 |
| 3.9, ``tl.sum`` | 384 | 3712 | 4360 |
| 3.9, ``column_sums`` | 80 | 3200 | 3848 |

(the plain tile: 2632 with 3.6, 2616 with 3.9; no stack frame in any). Both are fixed
trees of fp32 additions (bits run to run, alike on every column and shard); they are
different trees, so their sums differ in the last places.

    python benchmarks/colsum_tile.py [--shapes S1,S2] [--softcap 30] [--reps 20] [--out f.json]

On the GPU, per shape (one ``token_chunk x vocab_chunk`` block of the pinned config, H of
the shape, with a bias): exactness on MMA tiles of integer logits (each column's sum once,
at its own index; 128 x 256, 128 x 128 and 64 x 128 tiles); the block through lp's
``backward.dlogits`` without the bias gradient and with it (``tl.sum``), and through this
script's copy of its kernel with ``column_sums`` (the same d l bits; the sums within fp32
rounding of ``tl.sum``'s); the times of the three against one matmul of the
block (medians of three rounds of queued calls). On CPU the checks run under Triton's
interpreter at a small size (``TRITON_INTERPRET=1`` is set when there is no GPU).

Timed on an H200 inside ``dlogits_kernel`` (``493b95b``, reverted; docs/history.md): the
same sums as ``tl.sum`` there, no change in the train step, and with Triton 3.9 an 80 B
spill in the capped, biased tile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from lp_kernels.backends.triton import backward
from lp_kernels.backends.triton.config import (
    cap_args,
    config_for,
    group_size,
    launch_opts,
    logit_flags,
    pad128,
)
from lp_kernels.backends.triton.forward import logits_sources
from lp_kernels.backends.triton.tl_utils import (
    IGNORED,
    grouped,
    logits_tile,
    target_codes,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pingpong_fwd import timed  # medians of rounds of queued calls

# ----------------------------------------------------------------------------- column sums


@triton.jit
def partner(x, AXIS: tl.constexpr):
    """``x`` with its two entries along the size-2 axis ``AXIS`` swapped, bit for bit (an
    integer ``xor`` with the pair's ``xor``: one shuffle where the axis lies across lanes)."""
    xi = x.to(tl.int32, bitcast=True)
    return (xi ^ tl.xor_sum(xi, AXIS, keep_dims=True)).to(tl.float32, bitcast=True)


@triton.jit
def halve_columns(x, m, AXIS: tl.constexpr):
    """One round of :func:`column_sums`: ``x [W, 2, 2, 2, J, 8]`` has row pairs along the
    size-2 axis ``AXIS``; the row where ``m`` holds keeps the upper half of the ``J`` axis,
    the other the lower half, each plus the pair's other row. Returns ``[W, 2, 2, 2, J / 2,
    8]``."""
    t = tl.reshape(x, [x.shape[0], 2, 2, 2, 2, x.shape[4] // 2, 8])
    a0, a1 = tl.split(tl.permute(t, [0, 1, 2, 3, 5, 6, 4]))  # J's top bit last
    return tl.where(m, a1, a0) + partner(tl.where(m, a0, a1), AXIS)


@triton.jit
def column_sums(b, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """``(sums, cols)``: the fp32 column sums of a ``[BLOCK_N, BLOCK_V]`` tile as a ``[2, 2,
    2, BLOCK_V / 64, 8]`` block whose entries are the sums of columns ``cols`` (each column
    once). Rows ``16 w + 8 h + g``: the ``h`` pair first, then ``g``'s three bits, one
    reduce-scatter round each, then the ``w`` blocks (``tl.sum``)."""
    tl.static_assert(BLOCK_N % 16 == 0 and BLOCK_V % 64 == 0)
    x = tl.sum(tl.reshape(b, [BLOCK_N // 16, 2, 2, 2, 2, BLOCK_V // 8, 8]), axis=1)
    o2 = tl.arange(0, 2)
    x = halve_columns(x, (o2 == 1)[None, :, None, None, None, None], 1)
    x = halve_columns(x, (o2 == 1)[None, None, :, None, None, None], 2)
    x = halve_columns(x, (o2 == 1)[None, None, None, :, None, None], 3)
    g = 4 * o2[:, None, None, None, None] + 2 * o2[None, :, None, None, None]
    g += o2[None, None, :, None, None]
    j = tl.arange(0, BLOCK_V // 64)[None, None, None, :, None] + (BLOCK_V // 64) * g
    return tl.sum(x, axis=0), 8 * j + tl.arange(0, 8)[None, None, None, None, :]


@triton.jit
def exact_kernel(a_ptr, b_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """:func:`column_sums` of the MMA tile ``a @ b^T`` (``a [BLOCK_N, 16]``, ``b [BLOCK_V,
    16]``), stored at their columns."""
    o_k = tl.arange(0, 16)
    b_a = tl.load(a_ptr + tl.arange(0, BLOCK_N)[:, None] * 16 + o_k[None, :])
    b_b = tl.load(b_ptr + tl.arange(0, BLOCK_V)[:, None] * 16 + o_k[None, :])
    b_z = tl.dot(b_a, tl.trans(b_b), tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32))
    b_s, o_j = column_sums(b_z, BLOCK_N, BLOCK_V)
    tl.store(out_ptr + o_j, b_s)


# ----------------------------------------------------------------------------- d_logits


@triton.jit(do_not_specialize=["N", "v_begin", "v_count", "ignore_index", "first_id", "group"])
def dlogits_colsum_kernel(
    h_src, w_src, t_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, glse_ptr, dl_ptr, b_ptr, db_ptr,
    N, H, v_begin, v_count, v_store, ignore_index, first_id, inv_t, cap, inv_cap, group,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_dn,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr, HAS_LP: tl.constexpr, HAS_LSE: tl.constexpr, EVEN_H: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, IGNORED: tl.constexpr, TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """``backward.dlogits_kernel`` with a bias and its gradient, the column sums by
    :func:`column_sums` instead of ``tl.sum`` (the rest as there)."""
    i_n, i_v = grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_store, BLOCK_V), group)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_n = o_n < N
    m_v = o_c < v_count
    b_t = target_codes(t_ptr, o_n, m_n, ignore_index, first_id, v_begin + v_count, IGNORED)
    b_lse, b_glp, b_glse, b_mean, b_gent = backward.dlogits_rows(
        lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
    )
    b_z = logits_tile(
        h_src, w_src, b_ptr, i_n * BLOCK_N, v_begin + i_v * BLOCK_V, m_n, m_v, H, stride_hn,
        stride_hh, stride_wv, stride_wh, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, INTERPRET,
        PRECISION, TMA, HAS_BIAS,
    )  # fmt: skip
    b_dz = backward.dlogits_tile(
        b_z, b_t, b_lse, b_glp, b_glse, b_mean, b_gent, v_begin + i_v * BLOCK_V, inv_t, cap,
        inv_cap, BLOCK_V, ENTROPY, HAS_LP, SOFTCAP, INTERPRET,
    )  # fmt: skip
    m_live = m_n & (b_t != IGNORED)
    if (tl.min(m_live.to(tl.int32), axis=0) == 0) | ((i_v + 1) * BLOCK_V > v_count):
        b_dz = tl.where(m_live[:, None] & m_v[None, :], b_dz, 0.0)
    p_d = dl_ptr + o_n[:, None].to(tl.int64) * stride_dn + o_c[None, :]
    tl.store(p_d, b_dz.to(dl_ptr.dtype.element_ty), mask=m_n[:, None] & (o_c < v_store)[None, :])
    b_db, o_j = column_sums(b_dz, BLOCK_N, BLOCK_V)
    o_j += i_v * BLOCK_V
    tl.store(db_ptr + i_n.to(tl.int64) * v_store + o_j, b_db, mask=o_j < v_store)


def dlogits_colsum(hidden, weight, targets, lse, grads, out, p, cfg, bias, db):
    """``backward.dlogits`` of the whole block (first id 0, no entropy) through
    :func:`dlogits_colsum_kernel`."""
    n, h_dim = hidden.shape
    v_store = out.shape[1]
    blocks_n = triton.cdiv(n, cfg.block_n)
    h_src, w_src, tma = logits_sources(hidden, weight, cfg)
    g_lp = grads[0]
    dlogits_colsum_kernel[(blocks_n * triton.cdiv(v_store, cfg.block_v),)](
        h_src, w_src, targets, lse, lse, g_lp, lse, lse, out, bias, db,
        n, h_dim, 0, weight.shape[0], v_store, p.ignore_index, 0, p.inv_temperature,
        *cap_args(p), group_size(cfg, blocks_n),
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, ENTROPY=False,
        HAS_LP=True, HAS_LSE=False, IGNORED=IGNORED, TMA=tma, HAS_BIAS=True,
        SOFTCAP=p.softcap is not None,
        **logit_flags(hidden, cfg), **launch_opts(cfg, hidden.device),
    )  # fmt: skip


# ----------------------------------------------------------------------------- runs


def exact(device: str) -> dict:
    """Each tile's column sums of integer logits (exact in fp32) against fp64."""
    found = {}
    for block_n, block_v in ((128, 256), (128, 128), (64, 128)):
        rows, cols = torch.arange(block_n), torch.arange(block_v)
        a = torch.zeros(block_n, 16)
        a[:, 0], a[:, 1], a[:, 2] = rows, (rows * 37) % 11 - 5, 1.0
        b = torch.zeros(block_v, 16)
        b[:, 0], b[:, 1], b[:, 2] = 1.0, cols, (cols * 13) % 7
        want = (a.double() @ b.double().T).sum(0)
        out = torch.full((block_v,), float("nan"), device=device)
        a16, b16 = (x.to(torch.float16).to(device) for x in (a, b))  # integers < 256: exact
        warps = {"num_warps": 8} if device == "cuda" else {}  # as dlogits_kernel's tiles
        exact_kernel[(1,)](a16, b16, out, block_n, block_v, **warps)
        found[f"{block_n}x{block_v}"] = torch.equal(out.cpu().double(), want)
    return found


def block(n: int, h: int, cols: int, softcap: float | None, reps: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    cfg = config_for(torch.device(device), dtype)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype)
    weight = (torch.randn(cols, h, device=device, generator=gen) * 0.02).to(dtype)
    targets = torch.randint(0, cols, (n,), device=device, generator=gen)
    targets[::7] = -100
    bias = torch.randn(cols, device=device, generator=gen)
    lse = torch.rand(n, device=device, generator=gen) + 12.0
    grads = (torch.randn(n, device=device, generator=gen), None, None)
    p = types.SimpleNamespace(  # dlogits's parameters of a default-mode call
        inv_temperature=1 / 0.7, return_entropy=False, ignore_index=-100, softcap=softcap,
        deterministic=False,
    )  # fmt: skip
    width = pad128(cols)
    outs = [torch.empty((n, width), device=device, dtype=dtype) for _ in range(3)]
    dbs = [torch.zeros((triton.cdiv(n, cfg.block_n), width), device=device) for _ in range(2)]
    args = (hidden, weight, targets, 0, lse, None, grads)
    runs = {  # no sums and tl.sum: lp's own kernel, without and with the bias gradient
        "none": lambda: backward.dlogits(*args, outs[0], 0, cols, p, cfg, bias),
        "tl_sum": lambda: backward.dlogits(*args, outs[1], 0, cols, p, cfg, bias, dbs[0]),
        "column_sums": lambda: dlogits_colsum(
            hidden, weight, targets, lse, grads, outs[2], p, cfg, bias, dbs[1]
        ),
    }
    for run in runs.values():
        run()
    ref = dbs[0].double()
    scale = ref.abs().amax().clamp_min(1e-30)
    row = {
        "n": n, "h": h, "cols": cols, "softcap": softcap,
        "dl_equal": torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]),
        "column_sums_max_diff": ((dbs[1].double() - ref).abs().amax() / scale).item(),
    }  # fmt: skip
    if device == "cuda":
        row["mm_ms"] = timed(lambda: torch.mm(hidden, weight.T), reps)
        for name, run in runs.items():
            row[f"{name}_ms"] = timed(run, reps)
    return row


def main(argv: list[str] | None = None) -> int:
    from lp_bench.protocol import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="S1,S2")
    parser.add_argument("--softcap", type=float, default=None)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"exact": exact(device), "blocks": []}
    print("exact column sums of MMA tiles:", result["exact"])
    if device == "cpu":
        shapes = [("cpu", 70, 64, 300)]
    else:
        cfg = config_for(torch.device("cuda"))
        shapes = [(s, cfg.token_chunk, SHAPES[s][1], min(cfg.vocab_chunk, SHAPES[s][2]))
                  for s in args.shapes.split(",")]  # fmt: skip
    for name, n, h, cols in shapes:
        row = {"shape": name, **block(n, h, cols, args.softcap, args.reps, device)}
        result["blocks"].append(row)
        line = (f"{name} {n}x{h}x{cols} cap={args.softcap}: d l bits equal {row['dl_equal']}, "
                f"column_sums within {row['column_sums_max_diff']:.1e} of tl.sum's")  # fmt: skip
        if device == "cuda":
            mm = row["mm_ms"]
            line += "\n   x one matmul ({:.3f} ms): no sums {:.3f}  tl.sum {:.3f}  " \
                "column_sums {:.3f}".format(mm, *(row[k] / mm for k in (
                    "none_ms", "tl_sum_ms", "column_sums_ms")))  # fmt: skip
        print(line)
    ok = all(result["exact"].values()) and all(
        r["dl_equal"] and r["column_sums_max_diff"] < 1e-5 for r in result["blocks"]
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
