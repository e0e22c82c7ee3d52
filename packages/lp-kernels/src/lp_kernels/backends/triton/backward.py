"""The backward of the triton backend: d_logits, one bounded block at a time, and the
helpers of the two gradient GEMMs.

``dlogits_kernel`` recomputes ``z`` tile by tile and stores ``d l = d z / T`` in the input
dtype into a scratch ``[TOKEN_CHUNK, VOCAB_CHUNK]`` buffer (bounded, any N), with exact
zeros in its padded columns (``v_store``) so the GEMMs that read it vectorize alike on
every shard. :func:`dlogits_blocks` drives it for both triton modes; :func:`chunk_group`
picks how many vocabulary chunks one launch covers at small N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.config import (
    TileConfig,
    cap_args,
    compile_opts,
    group_size,
    launch_opts,
    logit_flags,
    pad128,
)
from lp_kernels.backends.triton.forward import logits_sources
from lp_kernels.backends.triton.gemm import mm_block_n, narrow_block_n
from lp_kernels.backends.triton.tl_utils import (
    IGNORED,
    cap_r,
    exp_ftz,
    grouped,
    logits_tile,
    target_codes,
)
from lp_kernels.core.matmul import mm_f32, scratch
from lp_kernels.core.types import LogprobParams

# ----------------------------------------------------------------------------- kernels


@triton.jit
def capped_dl(l, k_e, k_a, b_p, c0, hit, g_lp, INTERPRET: tl.constexpr = False):
    """d l of a capped logit ``l`` without the entropy term: ``(p c0 + [hit] g_lp) (1 -
    tanh^2)``. From ``r = 1 / (1 + e^(-2 l / c))`` (:func:`cap_r`; ``tanh = 2 r - 1``):
    ``p = e^(z / T - lse) = 2^(k_a r - b_p)`` (``k_a = 2 c log2(e) / T``, ``b_p = (lse + c
    / T) log2(e)``: one FMA), the slope ``(1 - tanh^2) / 4 = r - r^2`` (one FMA; ``c0``
    and ``g_lp`` carry the 1/T and the 4). Elementwise: a block, or one element under
    ``tl.map_elementwise``.

    Ten instructions per element, three of them ``MUFU``; the form with ``|l|`` and the
    sign bit (``tl_utils.softcap``'s) took fourteen. The slope's absolute error is a few
    2^-24 (``r``'s rounding), as ``1 - tanh^2`` from a rounded tanh has: relative only
    while the slope is well above that, so a logit the cap saturates (``l / c`` past about
    5, slope below 1e-4) keeps less of its small d l than bf16 stores. Under the cap ``p
    >= e^(-2c / T) / V``, so ``exp2``'s flush to zero takes nothing at the usual caps and
    temperatures (at worst a ``p`` below 2^-126 becomes 0). An infinite logit has ``r`` 0
    or 1, slope 0: its d l is 0."""
    r = cap_r(l, k_e, INTERPRET)
    s = r - r * r
    p = tl.math.exp2(r * k_a - b_p)
    return (p * c0 + tl.where(hit, g_lp, 0.0)) * s


@triton.jit
def capped_dl_entropy(l, k_e, k_a, b_p, c1, c2, hit, g_lp, INTERPRET: tl.constexpr = False):
    """:func:`capped_dl` with the entropy term: ``(p (c0 - g_ent (z / T - E)) + [hit]
    g_lp) (1 - tanh^2)``, where ``z / T = 2 k_z r - k_z`` makes the factor ``c1 - c2 r``
    with the rows' ``c1 = c0 + g_ent (k_z + E)`` and ``c2 = 2 k_z g_ent`` (both carry the 1/T
    and the slope's 4): one FMA. Its absolute error is that of ``z / T - E`` times
    ``g_ent``, as in the plain path."""
    r = cap_r(l, k_e, INTERPRET)
    s = r - r * r
    p = tl.math.exp2(r * k_a - b_p)
    return (p * (c1 - c2 * r) + tl.where(hit, g_lp, 0.0)) * s


@triton.jit
def capped_dlogits(
    b_l, b_trel, b_lse, b_c0, b_glp, b_mean, b_gent, inv_t, cap, inv_cap,
    BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, HAS_LP: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """d l of a block of capped logits ``b_l`` (``b_trel``: each row's target column
    relative to the tile, int32), on the GPU one element at a time (``tl.map_elementwise``).
    ``b_c0`` carries the 1/T; the slope's 4 joins it and the other per-row factors here
    (``b_glp``: the rows' upstream gradient of logprob, zeros without one).

    Op by op over the block (the plain path's form), the slope, ``z / T`` and ``p`` are
    three live ``[BLOCK_N, BLOCK_V]`` fp32 blocks beside the other state, and ptxas spills;
    element by element none is held. ``g_lp`` is selected into the target's column in
    every tile: the plain path's branch around it (only tiles that hold a target) makes
    ptxas spill here too."""
    k_e = inv_cap * -2.8853900817779268  # -2 log2(e) / c
    k_z = cap * inv_t
    k_a = k_z * 2.8853900817779268  # 2 c log2(e) / T
    b_p = (b_lse + k_z) * 1.4426950408889634
    b_c0 = b_c0 * 4.0  # exact: the slope's 4
    if HAS_LP:  # noqa: SIM108  (a constexpr branch)
        b_glp = b_glp * (4.0 * inv_t)
    else:
        b_glp = tl.zeros_like(b_c0)  # a constant: the select folds away
    m_hit = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
    if ENTROPY:
        b_gent = b_gent * (4.0 * inv_t)
        b_c1 = b_c0 + b_gent * (b_mean + k_z)
        b_c2 = b_gent * (2.0 * k_z)
        args = (b_l, k_e, k_a, b_p[:, None], b_c1[:, None], b_c2[:, None], m_hit, b_glp[:, None])
        if INTERPRET:
            b_dl = capped_dl_entropy(*args, INTERPRET)
        else:
            b_dl = tl.map_elementwise(capped_dl_entropy, *args)
    else:
        args = (b_l, k_e, k_a, b_p[:, None], b_c0[:, None], m_hit, b_glp[:, None])
        if INTERPRET:  # noqa: SIM108  (a constexpr branch)
            b_dl = capped_dl(*args, INTERPRET)
        else:
            b_dl = tl.map_elementwise(capped_dl, *args)
    return b_dl


@triton.jit
def dlogits_rows(
    lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_LSE: tl.constexpr,
):  # fmt: skip
    """The per-row inputs of :func:`dlogits_tile` for rows ``o_n``: ``(lse, g_lp, g_lse,
    E, g_ent)``, fp32 ``[BLOCK_N]``, an absent gradient (and E without ``ENTROPY``) as
    +0.0. Read as they come: an ignored row's may hold anything.

    A kernel that computes its logits calls this before the tile's MMAs (without entropy),
    so that these loads are in flight during them rather than after them."""
    b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0)
    b_glp = tl.zeros_like(b_lse)
    b_glse = tl.zeros_like(b_lse)
    b_mean = tl.zeros_like(b_lse)
    b_gent = tl.zeros_like(b_lse)
    if HAS_LP:
        b_glp = tl.load(glp_ptr + o_n, mask=m_n, other=0.0)
    if HAS_LSE:
        b_glse = tl.load(glse_ptr + o_n, mask=m_n, other=0.0)
    if ENTROPY:
        b_mean = tl.load(mean_ptr + o_n, mask=m_n, other=0.0)
        b_gent = tl.load(gent_ptr + o_n, mask=m_n, other=0.0)
    return b_lse, b_glp, b_glse, b_mean, b_gent


@triton.jit
def dlogits_tile(
    b_z, b_t, b_lse, b_glp, b_glse, b_mean, b_gent, col0, inv_t, cap, inv_cap,
    BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, HAS_LP: tl.constexpr,
    SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """d l of a tile of raw logits ``b_z`` (``h W^T + b``, fp32) whose first column is
    ``col0`` (the target codes' column numbering), rows with target codes ``b_t`` and the
    per-row inputs of :func:`dlogits_rows`: the arithmetic of both d_logits kernels, the one
    that recomputes the logits (:func:`dlogits_kernel`) and the one that reads them
    (``triton.loss``). Rows and columns outside the tile's bounds, and ignored rows, are the
    caller's to zero."""
    # d z / T = p (c0 - g_ent (z / T - E)) / T with the 1/T folded into per-row factors,
    # c0 = g_lse - g_lp (an absent gradient is +0.0)
    b_c0 = (b_glse - b_glp) * inv_t
    if SOFTCAP:  # d l = d z / T * (1 - tanh^2), element by element
        b_trel = (b_t - col0).to(tl.int32)  # int32: one compare each
        b_dz = capped_dlogits(
            b_z, b_trel, b_lse, b_c0, b_glp, b_mean, b_gent, inv_t, cap, inv_cap, BLOCK_V,
            ENTROPY, HAS_LP, INTERPRET,
        )  # fmt: skip
    else:
        b_zs = b_z * inv_t
        b_p = exp_ftz(b_zs - b_lse[:, None], INTERPRET)
        if ENTROPY:
            b_gent = b_gent * inv_t
            b_dz = b_p * (b_c0[:, None] - b_gent[:, None] * (b_zs - b_mean[:, None]))
        else:
            b_dz = b_p * b_c0[:, None]
        if HAS_LP:  # + g_lp / T in the target's column, in tiles that hold some row's target
            b_trel = b_t - col0
            if tl.max(((b_trel >= 0) & (b_trel < BLOCK_V)).to(tl.int32), axis=0) > 0:
                m_hit = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
                b_dz = tl.where(m_hit, b_dz + (b_glp * inv_t)[:, None], b_dz)
    return b_dz


@triton.jit
def store_column_sums(p_db, m_c, b_dl, INTERPRET: tl.constexpr):
    """Store the fp32 column sums of ``b_dl``, a ``[rows, cols]`` block of d l in the dtype
    the gradient GEMMs read, at ``p_db + [0, cols)`` (mask ``m_c``): grad_bias' share of the
    block, ``1^T d l`` as grad_weight's is ``d l^T h``.

    A 16-bit block goes through the tensor cores: one MMA of a ``[16, rows]`` block of ones
    with it, in fp32 (its 16 rows are the same sums; the first is stored). Each column's sum
    is the same bits wherever the column sits (an MMA column depends on its own inputs
    only), and it takes no cross-lane shuffles: ``tl.sum`` over the MMA layout's rows took
    about 600 instructions per thread of a 128 x 256 tile with 8 warps (220 of them
    shuffles; Triton 3.6), this about 100. An fp32 block, and the interpreter, sum with
    ``tl.sum``; ``rows`` must be at least 16 on the GPU."""
    if INTERPRET or b_dl.dtype == tl.float32:
        tl.store(p_db, tl.sum(b_dl.to(tl.float32), axis=0), mask=m_c)
    else:
        b_s = tl.dot(tl.full([16, b_dl.shape[0]], 1.0, b_dl.dtype), b_dl)  # fp32 [16, cols]
        o_r = tl.arange(0, 16)[:, None]
        tl.store(p_db[None, :] + o_r * 0, b_s, mask=(o_r == 0) & m_c[None, :])


@triton.jit(do_not_specialize=["N", "v_begin", "v_count", "ignore_index", "first_id", "group"])
def dlogits_kernel(
    h_src, w_src, t_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, glse_ptr, dl_ptr, b_ptr, db_ptr,
    N, H, v_begin, v_count, v_store, ignore_index, first_id, inv_t, cap, inv_cap, group,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_dn,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr, HAS_LP: tl.constexpr, HAS_LSE: tl.constexpr, EVEN_H: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, IGNORED: tl.constexpr, TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """d l = (p (c0 - g_ent (z - E)) + g_lp [col == target]) / T for columns [v_begin, +v_count),
    c0 = g_lse - g_lp; ``t_ptr``: the raw target ids, ``first_id`` the id of the weight's
    first row (:func:`~lp_kernels.backends.triton.tl_utils.target_codes`).

    Columns [v_count, v_store) of the output get exact zeros (v_store: v_count padded to 128).
    ``HAS_BIAS``: the logits are ``h W^T + b``; ``SOFTCAP``: z = c tanh(l / c) / T, and d l
    takes the factor 1 - tanh^2; ``BIAS_GRAD``: each program also writes the fp32 column
    sums of its stored block (:func:`store_column_sums`) to row ``i_n`` of ``db_ptr``
    (``[blocks, v_store]``).
    """
    i_n, i_v = grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_store, BLOCK_V), group)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column within the chunk
    m_n = o_n < N
    m_v = o_c < v_count
    # the rows' inputs first: their loads overlap the tile's MMAs (dlogits_rows); with the
    # entropy's two more, after them (held across the K loop, ptxas spilled 56-80 B)
    b_t = target_codes(t_ptr, o_n, m_n, ignore_index, first_id, v_begin + v_count, IGNORED)
    if not ENTROPY:
        b_lse, b_glp, b_glse, b_mean, b_gent = dlogits_rows(
            lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
        )
    b_z = logits_tile(
        h_src, w_src, b_ptr, i_n * BLOCK_N, v_begin + i_v * BLOCK_V, m_n, m_v, H, stride_hn,
        stride_hh, stride_wv, stride_wh, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, INTERPRET,
        PRECISION, TMA, HAS_BIAS,
    )  # fmt: skip
    if ENTROPY:
        b_lse, b_glp, b_glse, b_mean, b_gent = dlogits_rows(
            lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
        )
    b_dz = dlogits_tile(
        b_z, b_t, b_lse, b_glp, b_glse, b_mean, b_gent, v_begin + i_v * BLOCK_V, inv_t, cap,
        inv_cap, BLOCK_V, ENTROPY, HAS_LP, SOFTCAP, INTERPRET,
    )  # fmt: skip
    # ignored rows (code IGNORED) and rows past N get exact zeros, even where their hidden
    # is not finite, as do columns past v_count: a select only in tiles that have them
    m_live = m_n & (b_t != IGNORED)
    if (tl.min(m_live.to(tl.int32), axis=0) == 0) | ((i_v + 1) * BLOCK_V > v_count):
        b_dz = tl.where(m_live[:, None] & m_v[None, :], b_dz, 0.0)
    p_d = dl_ptr + o_n[:, None].to(tl.int64) * stride_dn + o_c[None, :]
    b_dl = b_dz.to(dl_ptr.dtype.element_ty)
    tl.store(p_d, b_dl, mask=m_n[:, None] & (o_c < v_store)[None, :])
    if BIAS_GRAD:  # the stored block's column sums (dead rows and columns hold exact zeros)
        p_db = db_ptr + i_n.to(tl.int64) * v_store + o_c
        store_column_sums(p_db, o_c < v_store, b_dl, INTERPRET)


@triton.jit(do_not_specialize=["B", "V"])
def colsum_kernel(part_ptr, out_ptr, B, V, stride_pb, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """out[v] += sum_i part[i, v], the rows i summed from +0.0 in order, then added once;
    ``ROWS`` rows' loads at a time, in flight together, then the rest one by one."""
    o_v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    p_i = part_ptr + o_v  # row i (pointer steps: no int32 product of rows and stride)
    full = B - B % ROWS
    for _ in range(0, full, ROWS):
        for r in tl.static_range(ROWS):
            b_acc += tl.load(p_i + r * stride_pb, mask=m_v, other=0.0)
        p_i += ROWS * stride_pb
    for _ in range(full, B):
        b_acc += tl.load(p_i, mask=m_v, other=0.0)
        p_i += stride_pb
    tl.store(out_ptr + o_v, tl.load(out_ptr + o_v, mask=m_v, other=0.0) + b_acc, mask=m_v)


# ----------------------------------------------------------------------------- launchers


def dlogits(
    hidden, w_real, targets, first_id, lse, mean, grads, out, v_begin, v_count, p, cfg,
    b_real=None, db=None,
):  # fmt: skip
    """d_logits of columns [v_begin, +v_count) into ``out``; its columns past v_count get
    exact zeros (callers pass ``pad_cols(v_count, buffer)`` columns). ``targets``: the raw
    ids of the rows, ``first_id`` the vocabulary id of ``w_real``'s first row; ``grads``:
    the upstream ``(g_lp, g_ent, g_lse)`` (:func:`upstream`). ``b_real``: the fp32 bias of
    ``w_real``'s rows, or None; ``db``: None, or a contiguous fp32 ``[cdiv(rows,
    block_n), out.shape[1]]`` buffer for the row blocks' column sums."""
    n, h_dim = hidden.shape
    v_store = out.shape[1]
    blocks_n = triton.cdiv(n, cfg.block_n)
    h_src, w_src, tma = logits_sources(hidden, w_real, cfg)
    g_lp, g_ent, g_lse = (lse if g is None else g for g in grads)
    dlogits_kernel[(blocks_n * triton.cdiv(v_store, cfg.block_v),)](
        h_src, w_src, targets, lse, mean if mean is not None else lse, g_lp, g_ent, g_lse, out,
        lse if b_real is None else b_real, lse if db is None else db,
        n, h_dim, v_begin, v_count, v_store, p.ignore_index, first_id, p.transform.inv_temperature,
        *cap_args(p), group_size(cfg, blocks_n),
        hidden.stride(0), hidden.stride(1), w_real.stride(0), w_real.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        ENTROPY=grads[1] is not None, HAS_LP=grads[0] is not None,
        HAS_LSE=grads[2] is not None, IGNORED=IGNORED, TMA=tma,
        HAS_BIAS=b_real is not None, BIAS_GRAD=db is not None, SOFTCAP=p.transform.softcap is not None,
        **logit_flags(hidden, cfg), **launch_opts(cfg, hidden.device),
    )  # fmt: skip


def add_column_sums(
    out: torch.Tensor, part: torch.Tensor, block: int = 32, rows: int = 16, warps: int = 1
) -> None:
    """``out [V] += part [B, >= V].sum(0)`` in fp32, the B rows summed in order: the same
    arithmetic for a column whatever its position or the width (no atomics).

    The launch is latency-bound (a few MB, rows in order): ``block`` columns per program
    (one per thread by default), ``rows`` rows' loads in flight, ``warps`` warps; none of
    them changes a bit (``benchmarks/colsum_launch.py`` times the choices)."""
    v = out.shape[0]
    if v == 0 or part.shape[0] == 0:
        return
    colsum_kernel[(triton.cdiv(v, block),)](
        part, out, part.shape[0], v, part.stride(0), BLOCK=block, ROWS=rows,
        **({} if out.device.type == "cpu" else {"num_warps": warps}), **compile_opts(out.device),
    )  # fmt: skip


def kernel_inputs(hidden, weight, targets, p: LogprobParams):
    """``(hidden, w_real, targets)`` as the kernels take them: ``hidden`` with a unit last
    stride, this shard's real weight rows, and the raw ``[N]`` target ids, contiguous (the
    kernels make each row's target code from them:
    :func:`~lp_kernels.backends.triton.tl_utils.target_codes`)."""
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    targets = targets if targets.is_contiguous() else targets.contiguous()
    return hidden, weight[: p.local_real_columns(weight.shape[0])], targets


def upstream(*grads):
    """The upstream gradients ``(g_lp, g_ent, g_lse)`` as the d_logits kernels read them:
    fp32 ``[N]`` with a unit stride (an expanded gradient, as ``out.sum().backward()``
    makes, is copied), None for an absent one. Ignored rows keep what they hold: the
    kernels give those rows exact zeros whatever it is."""
    return tuple(
        None if g is None else g if g.dtype == torch.float32 and g.is_contiguous()
        else g.float().contiguous()
        for g in grads
    )  # fmt: skip


def buffer_width(v_real: int, cfg: TileConfig) -> int:
    """Columns of the d_logits buffer: a multiple of 128, so its row stride specializes alike
    on every shard (the kernels' code must not depend on the shard width)."""
    return min(cfg.vocab_chunk, pad128(v_real))


def pad_cols(v_count: int, dl_buf: torch.Tensor) -> int:
    """The padded column bound of a d_logits chunk (what dlogits zero-fills)."""
    return min(pad128(v_count), dl_buf.shape[1])


def dlogits_blocks(
    hidden, w_real, targets, first_id, lse, mean_z, grads, p: LogprobParams, cfg: TileConfig,
    pieces=None, b_real=None, grad_bias=None,
):  # fmt: skip
    """The backward's d_logits, one bounded block at a time (shared by both triton modes).

    Yields ``(v_begin, v_count, blocks)`` per vocabulary chunk of ``cfg.vocab_chunk``
    columns (or per piece of ``pieces = (spans, width)``: ``(v_begin, v_count)`` spans in
    order, each at most ``width`` columns, a multiple of 128 that is then the buffer's
    width). ``blocks`` yields ``(r0, r1, dl, cols)`` per token chunk of
    ``cfg.token_chunk`` rows: ``dl [r1 - r0, v_count]`` (input dtype) is ``d loss / d
    logits`` of those rows and columns, in one reused buffer that holds exact zeros in
    columns ``[v_count, cols)``. ``targets``: the raw ids, ``first_id``: the vocabulary
    id of ``w_real``'s first row; ``grads``: the upstream ``(g_lp, g_ent, g_lse)``
    (:func:`upstream`). ``b_real``: the fp32 bias of ``w_real``'s rows, or None;
    ``grad_bias``: None, or fp32 ``[v_real]`` to which each block's fp32 column sums of d l
    are added before the block is yielded (row blocks in order, then token chunks).
    """
    n = hidden.shape[0]
    v_real = w_real.shape[0]
    if n == 0 or v_real == 0:
        return
    rows = min(cfg.token_chunk, n)
    if pieces is None:
        spans = [
            (v_begin, min(cfg.vocab_chunk, v_real - v_begin))
            for v_begin in range(0, v_real, cfg.vocab_chunk)
        ]
        width = buffer_width(v_real, cfg)
    else:
        spans, width = pieces
    dl_buf = scratch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)
    db_buf = None
    if grad_bias is not None:  # the row blocks' column sums of one token chunk
        shape = (triton.cdiv(rows, cfg.block_n), width)
        db_buf = scratch.empty(shape, dtype=torch.float32, device=hidden.device)

    def blocks(v_begin: int, v_count: int):
        cols = pad_cols(v_count, dl_buf)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)

            def cut(x, r0=r0, r1=r1):
                return None if x is None else x[r0:r1]

            db = None
            if db_buf is not None:  # contiguous [row blocks, cols]
                db = db_buf.view(-1)[: triton.cdiv(r1 - r0, cfg.block_n) * cols].view(-1, cols)
            dlogits(
                hidden[r0:r1], w_real, targets[r0:r1], first_id, lse[r0:r1], cut(mean_z),
                tuple(cut(g) for g in grads), dl_buf[: r1 - r0, :cols], v_begin, v_count, p,
                cfg, b_real, db,
            )  # fmt: skip
            if db is not None:
                add_column_sums(grad_bias[v_begin : v_begin + v_count], db)
            yield r0, r1, dl_buf[: r1 - r0, :v_count], cols

    for v_begin, v_count in spans:
        yield v_begin, v_count, blocks(v_begin, v_count)


def chunk_group(n: int, h_dim: int, v_real: int, cfg: TileConfig, device) -> int:
    """Vocabulary chunks the default backward handles per launch: 1, or, when its N rows
    fill at most half a token chunk and grad_hidden's GEMM takes the narrow tile anyway
    (:func:`mm_block_n`), as many chunks as a full token chunk's d_logits buffer holds
    (``token_chunk // N``; the same scratch bound), at most the shard's.

    At a thousand tokens the host, issuing three to four launches per 8192-column chunk,
    would otherwise set the step's pace. A group makes one d_logits launch, one grad_W GEMM
    and one grad_hidden GEMM whose ``chunk_k`` keeps each chunk's sum and the order of
    the additions: a row's bits are those of one launch per chunk, whatever N. The grouped
    GEMM needs the narrow tile, so where the pinned one fills the GPU the default stays one
    chunk per launch (docs/benchmarks.md has the measurements).
    """
    if n == 0 or 2 * n > cfg.token_chunk:
        return 1
    if mm_block_n(cfg, n, h_dim, device) != narrow_block_n(cfg):
        return 1
    return max(1, min(cfg.token_chunk // n, triton.cdiv(v_real, cfg.vocab_chunk)))


def grad_weight_slice(dl: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dl^T @ hidden`` in the input dtype with fp32 accumulation (one GEMM over
    all tokens), written in place on CUDA."""
    if hidden.device.type == "cuda":
        torch.mm(dl.T, hidden, out=out)  # cuBLAS accumulates half GEMMs in fp32
    else:
        out.copy_(mm_f32(dl.T, hidden))


def grad_weight_buffer(weight: torch.Tensor, v_real: int, n: int) -> torch.Tensor:
    """grad_weight, uninitialised where the backward writes every element (the real rows,
    when there are tokens), zero elsewhere (padding rows): no memset of the whole [V, H]."""
    if n == 0 or v_real == 0:
        return torch.zeros_like(weight)
    out = scratch.empty(tuple(weight.shape), dtype=weight.dtype, device=weight.device)
    out[v_real:].zero_()
    return out
