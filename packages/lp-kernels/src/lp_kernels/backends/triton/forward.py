"""The forward of the triton backend: partial softmax statistics per (row block, split),
and their merge in order.

``fwd_stats_kernel``, one program per (row block, split): for each ``BLOCK_V`` block of the
split, the raw logits ``l = h W^T (+ b)`` on chip (fp32 accumulation), then the online
``(m, s, a, t)`` of each row (``softmax.softmax_update``) -> ``stats [S, N, 4]`` (the logits
are never stored, unless the fused loss asks for them). On Hopper, calls without entropy at
``H <= ForwardConfig.pingpong_max_h`` launch ``pingpong.pingpong_stats_kernel`` instead: the
same partials, bit for bit. Under tensor parallel a rank's S partials, and with
``deterministic=True`` each tile's, are merged into one first (``merge_runs_kernel``), then
all-gathered. ``merge_kernel`` visits the partials of each row in (rank, partial) order ->
lse and E (the backward's), and the op's logprob, entropy and lse, masked as
``lp_kernels.core.stats.masked_outputs`` masks them, in one launch. The algebra is
``lp_kernels.core.stats``'.

``extras=`` (``EXTRAS``, off by default: the default launches compile as before) adds each
split's extras partial ``(x, q, u, i)`` beside its softmax partial (``softmax.extras_update``,
never the ping-pong kernel); the host merges them in the same runs and (rank, partial)
order with ``lp_kernels.core.extras``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    descriptor,
    even_h,
    launch_opts,
    swizzle_rows,
    tma_ok,
)
from lp_kernels.backends.triton.pingpong import pingpong_ok, pingpong_stats
from lp_kernels.backends.triton.plan import merge_block_k, shard_splits, tile_splits
from lp_kernels.backends.triton.softmax import (
    cap_constants,
    extras_update,
    softmax_finish,
    softmax_update,
    transform_args,
)
from lp_kernels.backends.triton.tl_utils import IGNORED, logits_block, swizzle, target_codes
from lp_kernels.core.extras import (
    N_EXTRA,
    NO_COLUMN,
    extra_outputs,
    merge_extra_runs,
    merge_extras,
)
from lp_kernels.core.matmul import scratch
from lp_kernels.core.stats import N_STATS
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import gather_stats

# ----------------------------------------------------------------------------- kernels

_NO_COLUMN = tl.constexpr(NO_COLUMN)


@triton.jit(do_not_specialize=["N", "V_real", "ignore_index", "col0", "splits", "rows"])
def fwd_stats_kernel(
    h_src,
    w_src,
    t_ptr,
    stats_ptr,
    b_ptr,
    l_ptr,
    x_ptr,
    i_ptr,
    N,
    H,
    V_real,
    ignore_index,
    col0,
    inv_t,
    cap,
    inv_cap,
    splits,
    rows,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_ln,
    scale,
    V_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr,
    EVEN_H: tl.constexpr,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_L: tl.constexpr,
    IGNORED: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
    TILE_W: tl.constexpr = 0,
    EXTRAS: tl.constexpr = False,
):
    """Per (row, split): m = max z, s = sum e^(z-m), a = sum e^(z-m)(z-m), t = z[target],
    with z the transformed logits (``softmax``). ``t_ptr``: the raw target ids, ``col0`` the
    id of the weight's first row (``tl_utils.target_codes``; ``IGNORED``: an ignored row's
    code). ``STORE_L``: also store the raw logits l = h W^T (+ b) (fp32, the real columns) to
    ``l_ptr`` (row stride ``stride_ln``). ``rows``: the launch order's band (``swizzle``).

    Splits are ``V_SPLIT`` columns from column 0, or, with ``TILE_W`` (``deterministic=True``'s
    tile width), ``V_SPLIT`` columns from each ``TILE_W``-wide tile's first column, the
    tile's last split cut at its end: ``cdiv(TILE_W, V_SPLIT)`` splits per tile, in order.

    ``EXTRAS``: also each split's extras partial (``softmax.extras_update``): ``(x, q, u)`` to
    ``x_ptr [S, N, 3]`` fp32 and the first id of the maximum to ``i_ptr [S, N]`` int64."""
    i_n, i_s = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, rows)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # the target's column in this weight, -1 if elsewhere, IGNORED if ignored
    b_t = target_codes(t_ptr, o_n, m_n, ignore_index, col0, V_real, IGNORED)
    b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_lt = tl.zeros([BLOCK_N], dtype=tl.float32)  # the target's raw logit l
    k_e, k_z, k_a, k_t = cap_constants(cap, inv_cap, inv_t)
    if EXTRAS:
        b_xm = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        b_xq = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_xu = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_xi = tl.full([BLOCK_N], _NO_COLUMN, dtype=tl.int64)
    if TILE_W > 0:
        SUBS: tl.constexpr = (TILE_W + V_SPLIT - 1) // V_SPLIT
        i_t = i_s // SUBS
        v_begin = i_t * TILE_W + (i_s - i_t * SUBS) * V_SPLIT
        v_end = tl.minimum(tl.minimum(v_begin + V_SPLIT, i_t * TILE_W + TILE_W), V_real)
    else:
        v_begin = i_s * V_SPLIT
        v_end = tl.minimum(v_begin + V_SPLIT, V_real)
    for v0 in tl.range(v_begin, v_end, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < v_end
        # [BLOCK_N, BLOCK_V]
        b_l = logits_block(
            h_src,
            w_src,
            b_ptr,
            i_n * BLOCK_N,
            v0,
            m_n,
            m_v,
            H,
            stride_hn,
            stride_hh,
            stride_wv,
            stride_wh,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
            EVEN_H,
            TMA,
            HAS_BIAS,
        )
        if STORE_L:
            if TMA:  # a tensor descriptor over [N, V_real]: the block's out-of-bounds part is cut
                b_l0, b_l1 = tl.split(
                    tl.permute(tl.reshape(b_l, [BLOCK_N, 2, BLOCK_V // 2]), [0, 2, 1])
                )
                l_ptr.store([i_n * BLOCK_N, v0], b_l0)
                l_ptr.store([i_n * BLOCK_N, v0 + BLOCK_V // 2], b_l1)
            else:  # int32 offsets within the block from one int64 base per block
                p_l = l_ptr + (i_n * BLOCK_N).to(tl.int64) * stride_ln + v0
                o_l = tl.arange(0, BLOCK_N)[:, None] * stride_ln + tl.arange(0, BLOCK_V)[None, :]
                tl.store(p_l + o_l, b_l, mask=m_n[:, None] & m_v[None, :])
        # the target's column: masked past the split (a split that is not a multiple of
        # BLOCK_V, deterministic_tile, ends inside a block whose last columns belong to the
        # next); without a bias as an int32 offset in the block, one compare per element
        # (with one, ptxas spills the block that way)
        if HAS_BIAS:
            m_t = (o_v[None, :] == b_t[:, None]) & m_v[None, :]
        else:
            b_trel = tl.where(b_t < v_end, b_t - v0, -1).to(tl.int32)
            m_t = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
        b_lt += tl.sum(tl.where(m_t, b_l, 0.0), axis=1)  # raw: transformed after the loop
        b_m, b_s, b_a = softmax_update(
            b_m,
            b_s,
            b_a,
            b_l,
            m_v,
            None,
            v0,
            v_end,
            scale,
            inv_t,
            k_e,
            k_z,
            k_a,
            k_t,
            ENTROPY,
            CAP,
            SCALE,
        )
        if EXTRAS:
            b_xm, b_xq, b_xu, b_xi = extras_update(
                b_xm, b_xq, b_xu, b_xi, b_l, m_v, col0 + v0, scale, inv_t, k_e, k_z, CAP, SCALE
            )
    b_m, b_zt = softmax_finish(b_m, b_lt, scale, cap, inv_cap, inv_t, k_z, ENTROPY, CAP, SCALE)
    p_out = stats_ptr + (i_s.to(tl.int64) * N + o_n) * 4
    tl.store(p_out + 0, b_m, mask=m_n)
    tl.store(p_out + 1, b_s, mask=m_n)
    tl.store(p_out + 2, b_a, mask=m_n)
    tl.store(p_out + 3, b_zt, mask=m_n)
    if EXTRAS:
        p_x = x_ptr + (i_s.to(tl.int64) * N + o_n) * 3  # (x, q, u): core.extras.N_EXTRA
        tl.store(p_x + 0, b_xm, mask=m_n)
        tl.store(p_x + 1, b_xq, mask=m_n)
        tl.store(p_x + 2, b_xu, mask=m_n)
        tl.store(i_ptr + i_s.to(tl.int64) * N + o_n, b_xi, mask=m_n)


@triton.jit
def _partials_max(p_n, step, k_begin, k_end, m_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """max m over partials ``[k_begin, k_end)`` of a block of rows (``p_n``: the rows' first
    partial; ``step``: one partial to the next), ``BLOCK_K`` loads in flight at a time."""
    b_big_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K):
            ok = m_n & (tl.full([BLOCK_N], k0 + j, tl.int32) < k_end)
            b_mk = tl.load(p_n + (k0 + j) * step, mask=ok, other=float("-inf"))
            b_big_m = tl.maximum(b_big_m, b_mk)
    return b_big_m


@triton.jit
def _partials_sum(
    p_n,
    step,
    k_begin,
    k_end,
    m_n,
    b_big_m,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ENTROPY: tl.constexpr,
    EMPTY: tl.constexpr,
):
    """``(S, B, T)``: the partials ``[k_begin, k_end)`` of a block of rows rescaled to their
    maximum ``b_big_m`` and added in order (``lp_kernels.core.stats``' algebra; B only with
    ``ENTROPY``). ``BLOCK_K`` partials' loads are in flight together, each still added in
    its turn; the slots past ``k_end`` add exact zeros. ``EMPTY``: where the maximum is
    -inf (no column of the range has mass) the weights are 0, not e^(-inf + inf) = NaN, so
    S = B = 0 unless a partial carries a NaN."""
    b_big_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_big_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
    live = m_n
    if EMPTY:
        live = live & (b_big_m != float("-inf"))  # a NaN maximum stays live
    for k0 in range(k_begin, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K):
            in_range = m_n & (tl.full([BLOCK_N], k0 + j, tl.int32) < k_end)
            p = p_n + (k0 + j) * step
            b_mk = tl.load(p + 0, mask=in_range, other=0.0)
            b_sk = tl.load(p + 1, mask=in_range, other=0.0)
            b_w = tl.where(in_range & live, tl.exp(b_mk - b_big_m), 0.0)
            b_big_s += b_w * b_sk
            if ENTROPY:
                b_ak = tl.load(p + 2, mask=in_range, other=0.0)
                b_shift = tl.where(b_w > 0, b_mk - b_big_m, 0.0)
                b_big_b += b_w * (b_ak + b_shift * b_sk)
            b_zt += tl.load(p + 3, mask=in_range, other=0.0)
    return b_big_s, b_big_b, b_zt


@triton.jit(do_not_specialize=["K", "N", "G"])
def merge_runs_kernel(
    stats_ptr,
    out_ptr,
    K,
    N,
    G,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    """Merge each run of ``G`` consecutive partials (of K) into one partial: program
    (row block, run) -> ``out[run, rows] = (M, S, B, T)``, the run's maximum, its sums
    rescaled to it (B: its a relative to M; without ``ENTROPY``, 0) and its target terms.
    A run with no mass (M = -inf) gives ``(-inf, 0, 0, T)``, as an empty split does."""
    i_n = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
    i_g = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_n = stats_ptr + o_n.to(tl.int64) * 4
    step = N.to(tl.int64) * 4
    k_begin = i_g * G
    k_end = tl.minimum(k_begin + G, K)
    b_big_m = _partials_max(p_n, step, k_begin, k_end, m_n, BLOCK_N, BLOCK_K)
    b_big_s, b_big_b, b_zt = _partials_sum(
        p_n, step, k_begin, k_end, m_n, b_big_m, BLOCK_N, BLOCK_K, ENTROPY, True
    )
    p_out = out_ptr + (i_g.to(tl.int64) * N + o_n) * 4
    tl.store(p_out + 0, b_big_m, mask=m_n)
    tl.store(p_out + 1, b_big_s, mask=m_n)
    tl.store(p_out + 2, b_big_b, mask=m_n)
    tl.store(p_out + 3, b_zt, mask=m_n)


@triton.jit(do_not_specialize=["K", "N", "ignore_index"])
def merge_kernel(
    stats_ptr,
    lse_ptr,
    mean_ptr,
    zt_ptr,
    ent_ptr,
    t_ptr,
    lseo_ptr,
    K,
    N,
    ignore_index,
    BLOCK_N: tl.constexpr,
    ENTROPY: tl.constexpr,
    LSE_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Merge K partials per row in order (see lp_kernels.core.stats for the algebra).

    ``lse_ptr`` and ``mean_ptr`` (``ENTROPY``) receive the raw log-sum-exp and E (the
    backward's); ``zt_ptr``, ``ent_ptr`` (``ENTROPY``) and ``lseo_ptr`` (``LSE_OUT``) the op's
    logprob ``t - lse``, entropy and log-sum-exp as ``lp_kernels.core.stats.masked_outputs``
    makes them: exact zeros on the rows whose raw target id (``t_ptr``, int32 or int64) is
    ``ignore_index``, NaN where the log-sum-exp is not finite."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_n = stats_ptr + o_n.to(tl.int64) * 4
    step = N.to(tl.int64) * 4  # one partial to the next
    b_big_m = _partials_max(p_n, step, 0, K, m_n, BLOCK_N, BLOCK_K)
    b_big_s, b_big_b, b_zt = _partials_sum(
        p_n, step, 0, K, m_n, b_big_m, BLOCK_N, BLOCK_K, ENTROPY, False
    )
    b_log_s = tl.log(b_big_s)
    b_lse = b_big_m + b_log_s
    tl.store(lse_ptr + o_n, b_lse, mask=m_n)
    b_dead = tl.load(t_ptr + o_n, mask=m_n, other=0).to(tl.int64) == ignore_index
    b_bad = (tl.abs(b_lse) == float("inf")) | (b_lse != b_lse)
    tl.store(zt_ptr + o_n, _masked(b_zt - b_lse, b_dead, b_bad), mask=m_n)
    if LSE_OUT:
        tl.store(lseo_ptr + o_n, _masked(b_lse, b_dead, b_bad), mask=m_n)
    if ENTROPY:
        b_ms = b_big_b / b_big_s
        tl.store(mean_ptr + o_n, b_big_m + b_ms, mask=m_n)
        tl.store(ent_ptr + o_n, _masked(b_log_s - b_ms, b_dead, b_bad), mask=m_n)


@triton.jit
def _masked(x, dead, bad):
    """``masked_outputs``' rule for one output: +0.0 on ignored rows, NaN on rows whose
    log-sum-exp is not finite, else ``x``."""
    return tl.where(dead, 0.0, tl.where(bad, float("nan"), x))


# ----------------------------------------------------------------------------- launchers


def forward_stats(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    targets: torch.Tensor,
    first_id: int,
    p: LogprobParams,
    cfg: KernelConfig,
    b_real: torch.Tensor | None = None,
    l_out: torch.Tensor | None = None,
    tile: int = 0,
    extras: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[S, N, 4]`` fp32 partial statistics of this shard's splits. ``targets``: the raw
    ``[N]`` ids (contiguous; ``p.ignore_index`` marks ignored rows), ``first_id``: the
    vocabulary id of ``w_real``'s first row; ``b_real``: the fp32 bias of ``w_real``'s rows,
    or None. ``l_out``: None, or an fp32 ``[N, >= V_real]`` buffer (unit column stride) that
    receives the raw logits ``h W^T (+ b)`` of the real columns (before the transform).
    ``tile``: 0 (splits of :func:`~lp_kernels.backends.triton.config.split_width` columns
    of the group's widest shard), or the width of the tiles that the splits cut from their
    first columns (``forward.v_split`` each, :func:`tile_splits` per tile;
    ``deterministic=True``).

    S is set by the largest shard of the group, so that every rank makes the same partials;
    splits past this shard's end report ``m = -inf, s = a = t = 0``. ``extras``: return
    ``(stats, x [S, N, 3], i [S, N])`` with the splits' extras partials (``core.extras``;
    never the ping-pong kernel).
    """
    n, h_dim = hidden.shape
    v_real = w_real.shape[0]
    if tile:
        width = cfg.forward.v_split  # deterministic_config's, from the tile's width
        splits = triton.cdiv(max(p.max_v_local, v_real), tile) * tile_splits(tile, cfg)
    else:
        width, splits = shard_splits(v_real, p, cfg)
    stats = scratch.empty((splits, n, N_STATS), dtype=torch.float32, device=hidden.device)
    x_out = i_out = None
    if extras:
        x_out = torch.empty((splits, n, N_EXTRA), dtype=torch.float32, device=hidden.device)
        i_out = torch.empty((splits, n), dtype=torch.int64, device=hidden.device)
    if n == 0 or splits == 0:
        return (stats, x_out, i_out) if extras else stats
    if not (tile or extras) and l_out is None and pingpong_ok(hidden, w_real, p, cfg):
        return pingpong_stats(hidden, w_real, targets, first_id, p, cfg, stats, width, b_real)
    blocks_n = triton.cdiv(n, cfg.logits.block_n)
    h_src, w_src, tma = logits_sources(hidden, w_real, cfg)
    fwd_stats_kernel[(blocks_n * splits,)](
        h_src=h_src,
        w_src=w_src,
        t_ptr=targets,
        stats_ptr=stats,
        b_ptr=b_real,
        l_ptr=None if l_out is None else logits_out(l_out, n, v_real, cfg, tma),
        x_ptr=x_out,
        i_ptr=i_out,
        N=n,
        H=h_dim,
        V_real=v_real,
        ignore_index=p.ignore_index,
        col0=first_id,
        splits=splits,
        rows=swizzle_rows(cfg, blocks_n),
        stride_hn=hidden.stride(0),
        stride_hh=hidden.stride(1),
        stride_wv=w_real.stride(0),
        stride_wh=w_real.stride(1),
        stride_ln=0 if l_out is None else l_out.stride(0),
        V_SPLIT=width,
        BLOCK_N=cfg.logits.block_n,
        BLOCK_V=cfg.logits.block_v,
        BLOCK_H=cfg.logits.block_h,
        ENTROPY=p.return_entropy,
        EVEN_H=even_h(hidden, cfg),
        TMA=tma,
        HAS_BIAS=b_real is not None,
        STORE_L=l_out is not None,
        IGNORED=IGNORED,
        TILE_W=tile,
        EXTRAS=extras,
        **transform_args(p.transform),
        **launch_opts(cfg.logits, hidden.device),
    )
    return (stats, x_out, i_out) if extras else stats


def logits_out(l_out: torch.Tensor, n: int, v_real: int, cfg: KernelConfig, tma: bool):
    """``fwd_stats_kernel``'s ``l_ptr``: a tensor descriptor over ``l_out[:n, :v_real]`` when
    the kernel runs on descriptors (the store needs no pointer block beside the block's
    registers), else the tensor."""
    block = (cfg.logits.block_n, cfg.logits.block_v // 2)
    return descriptor(l_out, n, v_real, block) if tma else l_out


def logits_sources(hidden: torch.Tensor, w_real: torch.Tensor, cfg: KernelConfig):
    """``(h_src, w_src, tma)``: tensor descriptors over hidden and the shard's real rows when
    the config asks for them and both tensors allow them, else the tensors themselves.

    Which one runs depends on H, the dtype and the tensors' alignment, never on N or on
    the shard's width; both compute the same products in the same order.
    """
    if cfg.tma and w_real.shape[0] > 0 and tma_ok(hidden, w_real):
        n, h_dim = hidden.shape
        lc = cfg.logits
        return (
            descriptor(hidden, n, h_dim, (lc.block_n, lc.block_h)),
            descriptor(w_real, w_real.shape[0], h_dim, (lc.block_v, lc.block_h)),
            True,
        )
    return hidden, w_real, False


def merge_outputs(
    stats: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    *,
    entropy: bool,
    return_lse: bool,
):
    """Merge ``[K, N, 4]`` partials per row in order, and make the op's outputs in the same
    launch: ``(lse, E or None, (logprob, entropy or None, lse or None))``. The first two
    are raw (what the backward reads); the outputs are exactly what
    ``lp_kernels.core.stats.masked_outputs`` makes of the merged statistics (ignored rows:
    those of the raw ``[N]`` ids ``targets``, contiguous, that equal ``ignore_index``)."""
    k, n, _ = stats.shape
    dev = stats.device

    def empty():
        return torch.empty(n, dtype=torch.float32, device=dev)

    lse, zt = empty(), empty()
    mean, ent = (empty(), empty()) if entropy else (None, None)
    lse_out = empty() if return_lse else None
    if n == 0:
        return lse, mean, (zt, ent, lse_out)
    block = 128 if dev.type != "cpu" else 256
    merge_kernel[(triton.cdiv(n, block),)](
        stats_ptr=stats.contiguous(),
        lse_ptr=lse,
        mean_ptr=mean,
        zt_ptr=zt,
        ent_ptr=ent,
        t_ptr=targets,
        lseo_ptr=lse_out,
        K=k,
        N=n,
        ignore_index=ignore_index,
        BLOCK_N=block,
        ENTROPY=entropy,
        LSE_OUT=lse_out is not None,
        BLOCK_K=merge_block_k(entropy, dev),
        **compile_opts(dev),
    )
    return lse, mean, (zt, ent, lse_out)


def gather_partials(stats: torch.Tensor, p: LogprobParams, run: int | None = None) -> torch.Tensor:
    """This rank's ``[K, N, 4]`` partials merged in runs of ``run`` (:func:`merge_runs`; 1: as
    they are; None: all K into one under tensor parallel, none on one GPU, where the final
    merge takes them as they are), all-gathered over the tensor-parallel group: ``[P * K',
    N, 4]`` in (rank, partial) order, the final merge's input."""
    if run is None:
        run = stats.shape[0] if p.tp_size > 1 else 1
    if run > 1 and stats.shape[0] > 1:
        stats = merge_runs(stats, run, p.return_entropy)
    return gather_stats(stats, p.tp_group, p.tp_size).flatten(0, 1)


def merge_runs(stats: torch.Tensor, run: int, entropy: bool) -> torch.Tensor:
    """``[K, N, 4]`` partials -> ``[cdiv(K, run), N, 4]``: each run of ``run`` consecutive
    partials merged into one (``merge_runs_kernel``), in order. A rank's splits become one
    partial per rank (tensor parallel) or per tile (``deterministic=True``) before the
    all-gather, so the bytes exchanged do not grow with the number of splits. Without
    ``entropy`` the B column is 0."""
    k, n, _ = stats.shape
    runs = triton.cdiv(k, run) if k else 0
    out = scratch.empty((runs, n, N_STATS), dtype=torch.float32, device=stats.device)
    if n == 0 or runs == 0:
        return out
    dev = stats.device
    block = 128 if dev.type != "cpu" else 256
    merge_runs_kernel[(triton.cdiv(n, block) * runs,)](
        stats_ptr=stats.contiguous(),
        out_ptr=out,
        K=k,
        N=n,
        G=run,
        BLOCK_N=block,
        BLOCK_K=merge_block_k(entropy, dev),
        ENTROPY=entropy,
        **compile_opts(dev),
    )
    return out


def merged_extras(parts, lse, targets, p: LogprobParams, run: int | None = None) -> tuple:
    """The ``extras=`` outputs from this rank's split partials ``parts = (x [K, N, 3], i [K,
    N])`` (:func:`forward_stats`), gathered as :func:`gather_partials` gathers the softmax
    partials (runs of ``run`` merged first) and merged in (rank, partial) order; ``lse``: the
    raw log-sum-exp, ``targets`` the raw ids."""
    x, i = parts
    if run is None:
        run = x.shape[0] if p.tp_size > 1 else 1
    if run > 1 and x.shape[0] > 1:
        x, i = merge_extra_runs(x, i, run)
    x = gather_stats(x, p.tp_group, p.tp_size).flatten(0, 1)
    i = gather_stats(i, p.tp_group, p.tp_size).flatten(0, 1)
    return extra_outputs(*merge_extras(x, i), lse, targets, p)
