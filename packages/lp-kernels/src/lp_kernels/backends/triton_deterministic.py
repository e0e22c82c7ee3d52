"""``deterministic=True`` for the triton backend: bitwise tensor-parallel invariance.

Outputs and both gradients are bitwise identical for any TP degree and any shard
layout whose bounds are multiples of 128, for a given tile width ``w =
deterministic_tile`` (default ``default_deterministic_tile(V)``, about V / 8; any
multiple of 128), and stay batch-invariant and reproducible run to run. A rank owns the
global w-column tiles that start in its shard; the rows of the next shards that its last
tile needs (the halo) arrive by point-to-point sends (``_dist.tile_ownership``,
``_dist.exchange_halo``). Data flow for one rank::

    forward   halo rows; W_all = the shard's real rows, then the halo (never joined
              whole: the tiles within the shard read it in place, the crossing tile a copy
              of its own rows joined to the halo, in a launch of its own)
              per token chunk (rows fixed by the global tile count, never by N):
                _fwd_stats_kernel with V_SPLIT = w over the owned tiles of W_all: one
                    partial (m, s, a, t) per row and owned tile    [T_max, rows, 4]
                all-gather -> [P, T_max, rows, 4]; _merge_kernel visits the partials in
                    (rank, tile) order = the global tile order, with empty partials
                    (m = -inf, s = a = t = 0) after each rank's owned tiles; adding an
                    exact zero leaves an fp32 sum unchanged, so every layout merges alike
    backward  per vocabulary span of W_all (_spans; from the first span that runs into the
              halo on, over a copy of those rows joined to it: _span_blocks), per token chunk:
                _dlogits_kernel (as in the default path)
                head fragment (the shard's columns in an earlier rank's tile): grad_W only,
                    here with several tiles per piece, else by the tile's owner (below)
                w <= half a vocabulary chunk: a piece holds several owned tiles from the
                first one's start, so its width follows the layout
                  grad_W[piece] += d l^T @ h   lp's fixed-tile GEMM (_matmul_acc_kernel):
                                              a row's result never depends on the width,
                                              unlike cuBLAS' shape-picked kernels
                  grad_h (int64) += round(2^e_n * (d l[:, tile] @ W[tile])) per tile
                                              (_matmul_fixed_kernel, which rounds each
                                              tile's fp32 dot in registers)
                wider tiles (the default's plan): a piece lies within one tile, cut from
                the tile's start by the tile's width alone, so every layout makes the same
                calls (a piece that runs into the halo is computed whole; the halo's
                grad_W rows go back to their shards: _dist.return_halo_grad)
                  grad_W[piece] = d l^T @ h   cuBLAS, as the default path (the same
                                              shapes, strides and alignment everywhere)
                  F_t (fp32) += d l @ W[piece]  the default path's GEMM, one buffer per
                                              tile of a group of ROUND_GROUP tiles; at the
                                              group's end, one pass (_round_into_kernel):
                  grad_h (int64) += round(2^e_n * F_t) + round(2^e_n * F_t+1) + ...
              the int64 sums are exact, so neither the tile order nor the TP all-reduce
              (int64) can change the bits; grad_h = acc * 2^-e_n, one rounding
              (_from_fixed_kernel; the scale from lp_kernels._fixed_point)

Cost: each tile's partial statistics and each tile's rounding of an [N, H] product are
the price of invariance, so wider tiles cost less: with the default tile the mode runs
within a few percent of the default path (docs/benchmarks.md); halos and head fragments
add work per shard bound crossed (docs/design.md).

Every owned tile is computed whole, from its first column, in launches that start on the
global column grid, and every element of a tile is computed by the same instruction
sequence whatever its position, so each tile's numbers are the same on every layout.
That also needs every layout to run the same compiled variant of each kernel: see
"Determinism" in ``triton_linear`` on Triton's integer specialization.
``benchmarks/profile_deterministic.py`` times each phase against the default mode (at
w = 128); ``benchmarks/profile_step.py --det --det-tile`` a whole step at any w.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lp_kernels._compile import backend_backward
from lp_kernels._dist import DETERMINISTIC_TILE as TILE
from lp_kernels._dist import RowSums, gather_stats, owned_halo, return_halo_grad, with_halo
from lp_kernels._fixed_point import row_exponents
from lp_kernels._matmul import addmm_f32_, scratch
from lp_kernels._stats import N_STATS, masked_outputs, masked_upstream
from lp_kernels._types import LogprobParams
from lp_kernels.backends import triton_linear as tri
from lp_kernels.backends.triton_linear import TileConfig, _gemm_step, _grouped, _operand_ptrs

# Every column tile is one global vocabulary tile. The fixed-point GEMM keeps an int64
# and an fp32 accumulator per output element (chosen by benchmarks/sweep_tiles.py).
FIXED_GPU = (128, 128, 64)  # BLOCK_M, BLOCK_N, BLOCK_K of _matmul_fixed_kernel (2-byte)
FIXED_GPU_4BYTE = (64, 128, 16)  # fp32 inputs (FMA dots; see triton_linear.FP32_TILES)
FIXED_SMALL, FIXED_SMALL_4BYTE = (64, 128, 64), (32, 64, 32)  # less shared memory
FIXED_WARPS: int | None = None  # num_warps of _matmul_fixed_kernel (None: the config's)
FIXED_PIPELINE = False  # experimental: round a leaf while the next one's MMAs run
# experimental: "split" rounds each scaled leaf into three int32 parts with fp32 adds of a
# magic constant (no 64-bit conversion per element; see _split_rint); "cvt" converts
# each element with one cvt.rni.s64.f32. The same integers, so the same bits.
FIXED_CONVERT = "cvt"
# "flat": one software-pipelined loop over K steps that rounds at each leaf's end;
# "nested": a loop over leaves around a loop over a leaf's K steps (drains the pipeline at
# every leaf). The same leaf products, so the same bits.
FIXED_LOOP = "flat"
FIXED_INTERPRET = (64, 64, TILE)
# Pipeline stages of the fixed-point GEMM for leaves wider than 128 columns (2-byte inputs,
# Hopper-class shared memory: 4 x 32 KiB). Its 128 x 128 tiles (the int64 sum needs the
# registers of a wider one) give each stage half the MMAs of the fp32 GEMM's 128 x 256,
# so more stages cover the same load latency: 1.13-1.39 x the fp32 GEMM's time against
# 1.32-1.52 x with three on one H200 chunk (benchmarks/fixed_gemm.py, session 9). At
# 128-column leaves the rounding dominates and four stages measured no better.
FIXED_WIDE_STAGES = 4
# Tiles wider than half a vocabulary chunk (the default tile's plan): up to how many
# tiles' fp32 products wait, each in its own [N, H] buffer, to be rounded into the int64
# sum in one pass, and the memory those buffers may take beyond the first. A pass reads
# and writes that sum (16 bytes per element) once for the group instead of once per
# tile. Every tile is still rounded on its own, so the grouping never changes a bit.
# Groups of 2 took 0.5-1.3 % off a step at S1, S3 and S4, groups of 4 another 1.6-1.8 % at S4
# (H200, docs/benchmarks.md, session 10); the budget keeps S3's [N, H] at groups of 2.
ROUND_GROUP = 4
ROUND_EXTRA_BYTES = 512 << 20
_STATS_BYTES = 128 << 20  # all-gathered forward partials per token chunk


def config_for(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, tile: int = TILE
) -> tuple[TileConfig, tuple[int, int, int]]:
    """The default path's pinned config (read at call time) with one ``tile``-column tile
    per forward partial (128-column logit tiles for 128, else the default path's), and the
    fixed-point GEMM's tiles."""
    base = tri.config_for(device, dtype)
    block_v = TILE if tile < base.block_v else base.block_v
    cfg = dataclasses.replace(base, block_v=block_v, v_split=tile)
    if device.type == "cpu":
        return cfg, FIXED_INTERPRET
    # A pipeline stage holds a whole 128-column leaf of A and B: (BLOCK_M + BLOCK_N) x 128
    # elements. 4-byte inputs: smaller tiles and two stages (see _matmul_fixed_); GPUs with
    # less shared memory than Hopper: half the tile (a quarter for fp32), two stages
    # (untested).
    if tri.gpu_tier(device) != "large":
        return cfg, FIXED_SMALL if dtype.itemsize <= 2 else FIXED_SMALL_4BYTE
    return cfg, FIXED_GPU if dtype.itemsize <= 2 else FIXED_GPU_4BYTE


@triton.jit
def _round_to_int64(x, INTERPRET: tl.constexpr):
    """Round to the nearest integer, ties to even (as ``torch.round``), as int64.

    One conversion instruction on the GPU (``cvt.rni.s64.f32``); the interpreter has no
    libdevice, so there the same rounding is built from fp32 operations (exact: below
    2^23 ``x + 0.5`` is exact, from 2^23 on ``x`` is an integer already)."""
    if INTERPRET:
        r = tl.floor(x + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where(((r - x) == 0.5) & odd, r - 1.0, r)
        return tl.where(tl.abs(x) >= 8388608.0, x, r).to(tl.int64)
    else:
        return libdevice.llrint(x)


STATIC_LEAF = tl.constexpr(TILE)  # leaves up to this width run unrolled K steps
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + _MAGIC rounds x to an integer (|x| < 2^22)
_MAGIC_BITS = tl.constexpr(0x4B400000)  # its fp32 bit pattern


@triton.jit
def _magic_rint(x):
    """``(q, q as fp32)`` with q = round(x), ties to even, for |x| <= 2^22: one fp32 add of
    _MAGIC rounds (the sum lies in [2^23, 2^24], where fp32 steps by 1), its bits give q."""
    s = x + _MAGIC
    return s.to(tl.int32, bitcast=True) - _MAGIC_BITS, s - _MAGIC


@triton.jit
def _split_rint(y):
    """round(y) (ties to even) for fp32 |y| < 2^63 as three int32 parts
    ``q1 * 2^42 + q2 * 2^21 + q3`` with |q1| <= 2^21 (<= 2^18 below the fixed-point
    bound 2^60) and |q2|, |q3| <= 2^20.

    Each level scales by a power of two (exact), rounds with a magic-constant add and
    subtracts the rounded part back (exact: both are multiples of y's ulp and the
    remainder fits 24 bits), so the parts sum exactly to round(y); the shifts are by even
    amounts, so ties stay ties to even. Only fp32 adds, multiplies and integer subtracts,
    instead of a 64-bit conversion per element."""
    q1, r1 = _magic_rint(y * 2.2737367544323206e-13)  # 2^-42
    y = y - r1 * 4398046511104.0  # 2^42
    q2, r2 = _magic_rint(y * 4.76837158203125e-07)  # 2^-21
    y = y - r2 * 2097152.0  # 2^21
    q3, _ = _magic_rint(y)
    return q1, q2, q3


@triton.jit
def _leaf_product(
    b_leaf, a_src, b_src, p_a, p_b, l0, l1, i_m, i_n, m_m, m_n, o_k, K_A, K_B, stride_ak,
    stride_bk, LEAF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """fp32 ``b_leaf + A[:, l0 : l1] @ B[l0 : l1]`` in BLOCK_K steps.

    Leaves up to STATIC_LEAF columns are unrolled (``l1 = l0 + LEAF``); wider ones run a
    loop to ``l1`` (their last leaf may be cut by the call's end). The same steps in the
    same order either way."""
    if LEAF <= STATIC_LEAF:
        for kk in tl.static_range(0, LEAF, BLOCK_K):
            b_leaf = _gemm_step(
                b_leaf, a_src, b_src, p_a, p_b, l0 + kk, i_m, i_n, m_m, m_n, o_k, K_A, K_B,
                stride_ak, stride_bk, BLOCK_M, BLOCK_N, INTERPRET, PRECISION, TMA, False,
            )  # fmt: skip
    else:
        for k0 in range(l0, l1, BLOCK_K):
            b_leaf = _gemm_step(
                b_leaf, a_src, b_src, p_a, p_b, k0, i_m, i_n, m_m, m_n, o_k, K_A, K_B,
                stride_ak, stride_bk, BLOCK_M, BLOCK_N, INTERPRET, PRECISION, TMA, False,
            )  # fmt: skip
    return b_leaf


@triton.jit(do_not_specialize=["M", "K", "K_B", "group"])
def _matmul_fixed_kernel(
    a_src, b_src, c_ptr, s_ptr, M, N, K, K_A, K_B, group,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    LEAF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, PIPE: tl.constexpr,
    SPLIT: tl.constexpr, ACC: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    """C (int64) += sum over LEAF-wide K tiles of round(s_m * (A[:, tile] @ B[tile])).

    Each tile's product is an fp32 dot from zero (fixed BLOCK_K order); ``s_m`` is a
    power of two per row, so the scaling is exact; rounding is to nearest, ties to even.
    The last leaf may be cut by K (the end of a shard's real columns).
    ``ACC=False``: C = the sum (C is not read: as into a zeroed C).
    A (d_logits) is read up to K_A columns (padded to 128 with zeros, so its loads
    vectorize alike on every shard), B up to its K_B real rows; with TMA ``a_src`` /
    ``b_src`` are tensor descriptors with those bounds. ``PIPE`` (experimental) computes
    the next leaf's product before rounding the previous one, so that the conversion may
    overlap the tensor-core work; the integers, hence the result, are the same.
    ``SPLIT`` (experimental, not with PIPE) rounds through :func:`_split_rint` into three
    int32 sums, joined into C once (with |values| < 2^60, up to 2^10 leaves per call keep
    the sums within int32; the launcher checks the count).
    K > 0 (a multiple of LEAF).
    """
    i_m, i_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), group)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    m_c = m_m[:, None] & m_n[None, :]
    p_c = c_ptr + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :] * stride_cn
    # [BLOCK_M, BLOCK_N] int64
    if ACC:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
        b_acc = tl.load(p_c, mask=m_c, other=0)
    else:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int64)
    b_scale = tl.load(s_ptr + o_m, mask=m_m, other=1.0)
    p_a, p_b = _operand_ptrs(
        a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA
    )
    b_zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PIPE:
        b_prev = _leaf_product(
            b_zero, a_src, b_src, p_a, p_b, 0, LEAF, i_m, i_n, m_m, m_n, o_k, K_A, K_B,
            stride_ak, stride_bk, LEAF, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, PRECISION, TMA,
        )  # fmt: skip
        for l0 in range(LEAF, K, LEAF):
            b_cur = _leaf_product(
                b_zero, a_src, b_src, p_a, p_b, l0, tl.minimum(l0 + LEAF, K), i_m, i_n, m_m,
                m_n, o_k, K_A, K_B, stride_ak, stride_bk, LEAF, BLOCK_M, BLOCK_N, BLOCK_K,
                INTERPRET, PRECISION, TMA,
            )  # fmt: skip
            b_acc += _round_to_int64(b_prev * b_scale[:, None], INTERPRET)
            b_prev = b_cur
        b_acc += _round_to_int64(b_prev * b_scale[:, None], INTERPRET)
    elif SPLIT:
        b_q1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        b_q2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        b_q3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for l0 in range(0, K, LEAF):
            b_leaf = _leaf_product(
                b_zero, a_src, b_src, p_a, p_b, l0, tl.minimum(l0 + LEAF, K), i_m, i_n, m_m,
                m_n, o_k, K_A, K_B, stride_ak, stride_bk, LEAF, BLOCK_M, BLOCK_N, BLOCK_K,
                INTERPRET, PRECISION, TMA,
            )  # fmt: skip
            q1, q2, q3 = _split_rint(b_leaf * b_scale[:, None])
            b_q1 += q1
            b_q2 += q2
            b_q3 += q3
        b_acc += (b_q1.to(tl.int64) << 42) + (b_q2.to(tl.int64) << 21) + b_q3.to(tl.int64)
    elif FLAT:
        # One loop over K steps (software-pipelined across leaf ends: the loads of the
        # next leaf are in flight while a leaf is rounded); the same steps in the same
        # order as the nested loop below, so the same leaf products.
        b_leaf = b_zero
        for k0 in range(0, K, BLOCK_K):
            b_leaf = _gemm_step(
                b_leaf, a_src, b_src, p_a, p_b, k0, i_m, i_n, m_m, m_n, o_k, K_A, K_B,
                stride_ak, stride_bk, BLOCK_M, BLOCK_N, INTERPRET, PRECISION, TMA, False,
            )  # fmt: skip
            if ((k0 + BLOCK_K) % LEAF == 0) | (k0 + BLOCK_K >= K):
                b_acc += _round_to_int64(b_leaf * b_scale[:, None], INTERPRET)
                b_leaf = b_zero
    else:
        for l0 in range(0, K, LEAF):
            b_leaf = _leaf_product(
                b_zero, a_src, b_src, p_a, p_b, l0, tl.minimum(l0 + LEAF, K), i_m, i_n, m_m,
                m_n, o_k, K_A, K_B, stride_ak, stride_bk, LEAF, BLOCK_M, BLOCK_N, BLOCK_K,
                INTERPRET, PRECISION, TMA,
            )  # fmt: skip
            b_acc += _round_to_int64(b_leaf * b_scale[:, None], INTERPRET)
    tl.store(p_c, b_acc, mask=m_c)


@triton.jit(do_not_specialize=["numel", "stride_f"])
def _round_into_kernel(
    f_ptr, c_ptr, s_ptr, numel, H, stride_f,
    BLOCK: tl.constexpr, INTERPRET: tl.constexpr, ACC: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    """C (int64) += round(s_row * F_0) + ... + round(s_row * F_{COUNT-1}) for the fp32
    products F_i of COUNT tiles, ``stride_f`` elements apart (``ACC=False``: C = ...);
    C and every F_i contiguous [rows, H], flattened. Each F_i is rounded on its own and
    the int64 sum is exact, so the grouping never changes C."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    b_s = tl.load(s_ptr + offs // H, mask=m, other=1.0)
    if ACC:  # noqa: SIM108  (a constexpr branch)
        b_q = tl.load(c_ptr + offs, mask=m, other=0)
    else:
        b_q = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(COUNT):
        b_f = tl.load(f_ptr + stride_f.to(tl.int64) * i + offs, mask=m, other=0.0)
        b_q += _round_to_int64(b_f * b_s, INTERPRET)
    tl.store(c_ptr + offs, b_q, mask=m)


_ELEMENTWISE_BLOCK = 1024  # elements per program of the two elementwise kernels (4 warps)


def _round_into_(c, f, scale, *, accumulate: bool) -> None:
    """``c (int64) += round(scale_n * f[0]) + ... + round(scale_n * f[k-1])`` (fp32 ``f``
    of shape ``[k, *c.shape]``, each ``f[i]`` contiguous; ``accumulate=False``: ``c =
    ...``): the products of ``k`` wide tiles, summed by lp's fp32 GEMM, join the sum."""
    if not (c.is_contiguous() and f.dim() == 3 and f.shape[1:] == c.shape and f[0].is_contiguous()):
        raise ValueError("_round_into_: contiguous c [rows, H] and f [k, rows, H]")
    if c.numel() == 0:
        return
    _round_into_kernel[(triton.cdiv(c.numel(), _ELEMENTWISE_BLOCK),)](
        f, c, scale, c.numel(), c.shape[1], f.stride(0), BLOCK=_ELEMENTWISE_BLOCK,
        INTERPRET=c.device.type == "cpu", ACC=accumulate, COUNT=f.shape[0],
        **tri._compile_opts(c.device),
    )  # fmt: skip


@triton.jit(do_not_specialize=["numel"])
def _from_fixed_kernel(acc_ptr, s_ptr, bad_ptr, out_ptr, numel, H, BLOCK: tl.constexpr):
    """out (float32) = acc * s_row (s = 2^-e, float64; NaN on bad rows): int64 -> float64
    (as torch's ``.double()``), the exact power-of-two scaling, one rounding. Contiguous
    [N, H], flattened."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    row = offs // H
    b_x = tl.load(acc_ptr + offs, mask=m, other=0)
    b_s = tl.load(s_ptr + row, mask=m, other=1.0)
    b_bad = tl.load(bad_ptr + row, mask=m, other=0) != 0
    b_y = tl.where(b_bad, float("nan"), b_x.to(tl.float64) * b_s)
    tl.store(out_ptr + offs, b_y.to(tl.float32), mask=m)


def _from_fixed_point(acc, e, bad, dtype):
    """``acc [N, H]`` int64 in units of ``2^-e_n`` -> ``dtype`` (the triton backend's
    :func:`lp_kernels._fixed_point.from_fixed_point`, without float64 temporaries).

    The kernel stops at float32 and torch rounds to the input dtype: Triton may fold the
    two conversions into one from float64 (another rounding than torch's), and its
    interpreter rounds float32 to bfloat16 toward zero."""
    acc = acc.contiguous()
    out = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    if out.numel() == 0:
        return out.to(dtype)
    _from_fixed_kernel[(triton.cdiv(acc.numel(), _ELEMENTWISE_BLOCK),)](
        acc, torch.exp2(-e.to(torch.float64)), bad.to(torch.int8), out, acc.numel(),
        acc.shape[1], BLOCK=_ELEMENTWISE_BLOCK, **tri._compile_opts(acc.device),
    )  # fmt: skip
    return out.to(dtype)


def _full_stages(a: torch.Tensor) -> bool:
    """Whether the fixed-point GEMM keeps the config's pipeline depth: 2-byte inputs on a
    GPU with Hopper-class shared memory (elsewhere two stages, see config_for)."""
    return a.device.type == "cuda" and a.element_size() <= 2 and tri.gpu_tier(a.device) == "large"


def _matmul_fixed_(
    c, a, b, scale, k_a: int, fixed: tuple[int, int, int], cfg: TileConfig, *,
    leaf: int = TILE, accumulate: bool = True,
):  # fmt: skip
    """``c (int64) += fixed-point(a @ b)`` per ``leaf``-column tile; ``a`` has zeros up to
    k_a. ``accumulate=False``: ``c = ...`` (``c`` is not read)."""
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, block_k = fixed
    blocks_m = triton.cdiv(m, block_m)
    mm_cfg = dataclasses.replace(
        cfg,
        mm_block_k=block_k,
        num_warps=FIXED_WARPS or cfg.num_warps,
        num_stages=(
            (FIXED_WIDE_STAGES if leaf > TILE else cfg.num_stages)
            if _full_stages(a)
            else min(cfg.num_stages, 2)
        ),
    )
    a_src, b_src, tma = tri.gemm_sources(a, b, m, k_a, False, mm_cfg, block_m, block_n)
    # the experimental switches apply to 128-column leaves
    pipe = FIXED_PIPELINE and leaf == TILE
    split = FIXED_CONVERT == "split" and not pipe and leaf == TILE
    if split and k_a > TILE << 10:
        raise ValueError(f"FIXED_CONVERT='split' takes at most 1024 leaves per call, got {k_a}")
    _matmul_fixed_kernel[(blocks_m * triton.cdiv(n, block_n),)](
        a_src, b_src, c, scale, m, n, k_a, k_a, k, tri._group(cfg, blocks_m),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        LEAF=leaf, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRET=a.device.type == "cpu", PRECISION="ieee", TMA=tma, PIPE=pipe,
        SPLIT=split, ACC=accumulate, FLAT=FIXED_LOOP == "flat" and not (pipe or split),
        **tri._launch_opts(mm_cfg, a.device),
    )  # fmt: skip


def vocab_pieces(v_real: int, tile: int, chunk: int) -> tuple[list[tuple[int, int]], int]:
    """The backward's vocabulary pieces ``(v_begin, v_count)`` of a shard and the widest.

    Tiles up to ``chunk`` columns: pieces of as many whole tiles as fit in ``chunk``,
    from the shard's start (a tile edge). Wider tiles: each tile cut into the same number
    of near-equal pieces (multiples of 128) from its start. With one tile per piece
    (tiles wider than half a chunk) the cuts and the width (a multiple of 128) depend only
    on ``tile`` and ``chunk``, never on the shard, so every layout cuts a global tile
    alike."""
    if tile <= chunk:
        step = chunk // tile * tile
        spans = [(b, min(step, v_real - b)) for b in range(0, v_real, step)]
        # one tile per piece: the width must not follow the shard (see the backward)
        return spans, step if 2 * tile > chunk else min(step, tri.pad128(v_real))
    width = tri.pad128(triton.cdiv(tile, triton.cdiv(tile, chunk)))
    pieces = []
    for l0 in range(0, v_real, tile):
        end = min(l0 + tile, v_real)
        pieces += [(b, min(width, end - b)) for b in range(l0, end, width)]
    return pieces, width


def round_slots(tiles: int, n: int, h_dim: int) -> int:
    """Tiles rounded into grad_hidden's int64 sum per pass (one fp32 [n, h_dim] buffer
    each): at most ``ROUND_GROUP`` and the owned ``tiles``, and the buffers past the first
    within ``ROUND_EXTRA_BYTES``. Any value gives the same bits."""
    extra = ROUND_EXTRA_BYTES // max(1, 4 * n * h_dim)
    return max(1, min(ROUND_GROUP, tiles, 1 + extra))


def _stats_rows(p: LogprobParams, cfg: TileConfig, max_tiles: int) -> int:
    """Token rows per forward chunk: the gathered partials stay within _STATS_BYTES."""
    tiles = max(max_tiles, 1) * max(p.tp_size, 1)
    rows = _STATS_BYTES // (tiles * N_STATS * 4)
    return max(cfg.block_n, rows // cfg.block_n * cfg.block_n)


def _spans(own, p: LogprobParams, chunk: int, need_w: bool):
    """The backward's vocabulary spans ``(v_begin, v_count)`` over this shard's
    real rows followed by its halo, the number of leading head-fragment spans (grad_W
    only), and the d_logits buffer's width.

    Owned tiles are cut by :func:`vocab_pieces` from the first one's start (column
    ``own.skip``). The head fragment (the shard's first ``skip`` columns, in a tile that
    starts on an earlier rank) is one span when tiles share a piece. With one tile per
    piece it has none: the tile's owner computes the fragment's grad_W rows with the rest
    of its piece, in the call it makes on a layout where the tile is whole, and sends them
    here (:func:`_dist.return_halo_grad`)."""
    tile = p.deterministic_tile
    pieces, width = vocab_pieces(own.ext, tile, chunk)
    spans = []
    if need_w and own.skip and 2 * tile <= chunk:
        spans.append((0, own.skip))
        width = max(width, tri.pad128(own.skip))
    n_frag = len(spans)
    spans += [(own.skip + b, c) for b, c in pieces]
    return spans, n_frag, width


def _weight_parts(w_real, halo, start: int, cross: int):
    """``[(c0, w), (cross, w_x)]``: the shard's columns ``[start, cross)`` as a view of its
    real rows, then, with a halo, the columns from ``cross`` on as a copy of those real rows
    joined to the halo (:func:`_dist.with_halo`), so that only the columns that run into
    the halo are copied, never the whole shard. Either may be empty."""
    parts = [(start, w_real[start:cross])]
    if halo.shape[0]:
        parts.append((cross, with_halo(w_real, halo, cross)))
    return parts


def _codes_in(t_all, c0: int, count: int):
    """Target codes relative to columns ``[c0, c0 + count)``; other columns -> -1 (ignored
    rows keep their code)."""
    hit = (t_all >= c0) & (t_all < c0 + count)
    return torch.where(hit, t_all - c0, t_all.clamp(max=-1))


def _span_blocks(hidden, w_real, halo, t_all, lse, mean_z, grads, p, cfg, spans, width):
    """:func:`triton_linear.dlogits_blocks` over the backward's spans (columns of the
    shard's real rows, then the halo), with each span's weight rows: ``(v_begin, v_count,
    blocks, w_span)``. Spans within the real rows read them in place; the spans from the
    first one that runs past them (into the halo) read a copy of the rows from its start
    joined to the halo (:func:`_weight_parts`): at most a tile or a vocabulary chunk. The
    d_logits buffer keeps its width, so every GEMM call is the one it would be on one
    joined operand."""
    v_real = w_real.shape[0]
    k = next((j for j, (b, c, *_) in enumerate(spans) if b + c > v_real), len(spans))
    cross = spans[k][0] if k < len(spans) else v_real
    parts = _weight_parts(w_real, halo, 0, cross)  # one part without a halo (k = all)
    for (c0, w), sub in zip(parts, (spans[:k], spans[k:]), strict=False):
        if not sub:
            continue
        local = [(b - c0, c) for b, c in sub]
        t = t_all if c0 == 0 else _codes_in(t_all, c0, w.shape[0])
        for v_begin, v_count, blocks in tri.dlogits_blocks(
            hidden, w, t, lse, mean_z, grads, p, cfg, pieces=(local, width)
        ):
            yield c0 + v_begin, v_count, blocks, w[v_begin : v_begin + v_count]


class LinearLogprobTritonDeterministic(torch.autograd.Function):
    """TP-invariant fused implementation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        cfg, _ = config_for(hidden.device, hidden.dtype, p.deterministic_tile)
        # target codes over the shard's real rows and the halo (the backward's columns)
        halo_rows = p.tile_ownership().halo
        hidden, w_real, t_all, ignored = tri.kernel_inputs(hidden, weight, targets, p, halo_rows)
        own, halo = owned_halo(w_real, p)
        # The owned tiles in one launch over the shard's rows, or, with a halo, two: the
        # tiles within the shard (a view), then the last one over its rows joined to the
        # halo (a copy of one tile); each launch's splits are whole tiles. Every rank
        # sends max_tiles partials: its owned tiles, then empty ones (the last launch's).
        tile = p.deterministic_tile
        cross = own.skip + (own.tiles - 1) * tile if halo.shape[0] else own.skip + own.ext
        parts = _weight_parts(w_real, halo, own.skip, cross)
        launches = [(c0, w) for c0, w in parts if w.shape[0]] or parts[:1]
        fwd = []
        for i, (c0, w) in enumerate(launches):
            tiles = triton.cdiv(w.shape[0], tile)
            if i == len(launches) - 1:
                tiles = own.max_tiles - (c0 - own.skip) // tile
            t_w = _codes_in(t_all, c0, w.shape[0])  # target codes in the launch's columns
            fwd.append((w, t_w, dataclasses.replace(p, max_v_local=tiles * tile)))
        n = hidden.shape[0]
        parts = []
        step = _stats_rows(p, cfg, own.max_tiles)
        for r0 in range(0, max(n, 1), step):
            r1 = min(n, r0 + step)
            stats = [tri.forward_stats(hidden[r0:r1], w, t[r0:r1], pf, cfg) for w, t, pf in fwd]
            stats = stats[0] if len(stats) == 1 else torch.cat(stats)  # [T_max, rows, 4]
            gathered = gather_stats(stats, p.tp_group, p.tp_size)  # [P, T_max, rows, 4]
            parts.append(tri.merge(gathered.flatten(0, 1), entropy=p.return_entropy))
        lse, mean_z, zt, ent = (
            None if part[0] is None else torch.cat(part) for part in zip(*parts, strict=True)
        )
        ctx.save_for_backward(hidden, weight, t_all, ignored, lse, mean_z, halo)
        ctx.params = p
        return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, t_all, ignored, lse, mean_z, halo = ctx.saved_tensors
        p: LogprobParams = ctx.params
        tile = p.deterministic_tile
        cfg, fixed = config_for(hidden.device, hidden.dtype, tile)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        own = p.tile_ownership()
        grads = masked_upstream(ignored, g_lp, g_ent, g_lse)
        dev = hidden.device
        spans, n_frag, width = _spans(own, p, cfg.vocab_chunk, need_w)
        # Pieces within one tile each (tiles wider than half a chunk) are cut alike on every
        # layout, and so are the d_logits buffer's shape and strides: then cuBLAS may
        # compute grad_W (the same call on every layout; a piece that runs into the halo
        # is computed whole, its halo rows sent back). Else a piece holds several
        # tiles, its width varies with the layout, and grad_W takes lp's fixed-tile GEMM,
        # whose rows never depend on the width.
        per_tile = 2 * tile > cfg.vocab_chunk
        rows = min(cfg.token_chunk, n)
        leaf32 = None  # fp32 products of wide tiles (per_tile), from their pieces
        slots = round_slots(own.tiles, n, h_dim)  # tiles rounded per pass (per_tile)
        pending = 0  # tiles whose products wait in leaf32 (per_tile)
        if need_h:
            e, bad = row_exponents(hidden, w_real, lse, ignored, *grads, p)
            scale = torch.exp2(e).float()
            # the first rounding overwrites it (ACC=False), unless no tile is here
            alloc = torch.empty if own.ext > 0 else torch.zeros
            acc_h = alloc((n, h_dim), dtype=torch.int64, device=dev)
            written = False  # whether acc_h holds sums (a tile or a group was rounded)
            if per_tile and own.ext > 0:
                leaf32 = scratch.empty((slots, n, h_dim), dtype=torch.float32, device=dev)
        grad_w = tri.grad_weight_buffer(weight, v_real, n) if need_w else None
        whole = [b + c <= v_real for b, c in spans]
        acc_w = None  # fp32 accumulator of a grad_W piece
        fp32_w = weight.dtype == torch.float32 and all(whole)  # grad_W sums in place
        if need_w and n > 0 and (rows < n or not per_tile) and not fp32_w:
            acc_w = scratch.empty((width, h_dim), dtype=torch.float32, device=dev)
        sums = RowSums(acc_h if need_h else None, p.tp_group, p.tp_size, rows, p.reduce_grad_hidden)

        def grad_h_rows(r0, r1, dl, cols, w_chunk):
            """The current span's grad_h for token rows [r0, r1) (one block of ``dl``);
            reads the span loop's state (frag, first, flush, pending, written)."""
            if frag:
                return  # the head fragment feeds grad_W only
            if per_tile:  # the default path's fp32 GEMM, then one rounding
                f = leaf32[pending, r0:r1]
                tri._matmul_acc_(f, dl, w_chunk, cfg, k_a=cols, accumulate=not first)
                if flush:
                    f = leaf32[: pending + 1, r0:r1]
                    _round_into_(acc_h[r0:r1], f, scale[r0:r1], accumulate=written)
            else:
                _matmul_fixed_(
                    acc_h[r0:r1], dl, w_chunk, scale[r0:r1], cols, fixed, cfg, leaf=tile,
                    accumulate=written,
                )  # fmt: skip

        # per_tile: the grad_W rows of the halo (other shards' rows) go back to their
        # shards, which compute no head fragment
        back = need_w and per_tile and p.tp_size > 1
        grad_halo = None
        if back:  # every halo row lies in an owned span (zeros without tokens)
            halo_alloc = torch.empty if n > 0 else torch.zeros
            grad_halo = halo_alloc((own.halo, h_dim), dtype=weight.dtype, device=dev)
        for j, (v_begin, v_count, blocks, w_chunk) in enumerate(
            _span_blocks(hidden, w_real, halo, t_all, lse, mean_z, grads, p, cfg, spans, width)
        ):
            local = max(0, min(v_begin + v_count, v_real) - v_begin)  # its grad_W rows
            # and its rows of grad_halo (per_tile): the span's columns [local, v_count)
            h_rows = (max(0, v_begin + local - v_real), max(0, v_begin + v_count - v_real))
            frag = j < n_frag
            rel = v_begin - own.skip
            first = not frag and rel % tile == 0  # the piece starts a tile
            final = not frag and rel + v_count == own.ext  # the piece ends the owned tiles
            last = final or (not frag and (rel + v_count) % tile == 0)  # it ends a tile
            # per_tile: round the waiting products when the slots are full or none follow
            flush = last and (pending + 1 == slots or final)
            gw = need_w and (local > 0 or (back and h_rows[1] > h_rows[0]))
            if gw:
                gw_rows = grad_w[v_begin : v_begin + local]
                if per_tile:
                    acc = gw_rows if acc_w is None else acc_w[:v_count]
                else:
                    acc = gw_rows if acc_w is None else acc_w[:local]
            # under TP the last span's rows are final once grad_h has run: their int64
            # all-reduce starts then, beside the span's grad_W GEMM
            early = need_h and sums.active and final
            for r0, r1, dl, cols in blocks:
                if early:
                    grad_h_rows(r0, r1, dl, cols, w_chunk)
                    sums.ready(r1)
                if gw and per_tile and rows == n:  # one cuBLAS GEMM, as the default path
                    if whole[j]:
                        tri._grad_weight_slice(dl, hidden, gw_rows)
                    else:  # the whole piece's call: this shard's rows, then the halo's
                        tmp = torch.empty((v_count, h_dim), dtype=weight.dtype, device=dev)
                        tri._grad_weight_slice(dl, hidden, tmp)
                        gw_rows.copy_(tmp[:local])
                        if back:
                            grad_halo[slice(*h_rows)].copy_(tmp[local:])
                elif gw and per_tile:  # the first token chunk overwrites acc
                    addmm_f32_(acc, dl.T, hidden[r0:r1], accumulate=r0 > 0)
                elif gw:  # lp's fixed-tile GEMM (the first token chunk overwrites acc)
                    tri._matmul_acc_(
                        acc, dl[:, :local].T, hidden[r0:r1], cfg, m_a=cols, accumulate=r0 > 0
                    )
                if need_h and not early:
                    grad_h_rows(r0, r1, dl, cols, w_chunk)
            if need_h and (flush or (last and not per_tile)):
                written, pending = True, 0
            elif need_h and last:
                pending += 1
            if gw and acc_w is not None and per_tile:
                gw_rows.copy_(acc[:local])
                if back:
                    grad_halo[slice(*h_rows)].copy_(acc[local:])
            elif gw and acc_w is not None:
                gw_rows.copy_(acc)
        grad_h = None
        if need_h:
            sums.finish()
            grad_h = _from_fixed_point(acc_h, e, bad, hidden.dtype)
        if back:  # after every all-reduce: the same order of collectives on every rank
            return_halo_grad(
                grad_halo, grad_w, p.shard_starts, p.shard_sizes, p.vocab_size, tile,
                p.tp_rank, p.tp_group,
            )  # fmt: skip
        return grad_h, grad_w, None, None
