"""``linear_divergence(deterministic=True)``: outputs and gradients bitwise identical for any
TP degree and any shard layout whose bounds are multiples of 128, on both engines.

It computes on the global vocabulary tiles of ``linear_logprob(deterministic=True)``
(``deterministic_tile`` columns on a grid from column 0; a rank computes the tiles that
start in its shard, with the next shards' rows of both heads lent as a halo where a tile
crosses its end: ``distributed.halo``). Data flow::

    forward   sweep 1, per owned tile and chunk: each side's (max, sum exp) over the tile
                -> [N, T_own, 4] -> all-gather -> the global tile sequence [N, T, 4]
                -> lse(z), lse(y): one reduction over the tile axis (one shape everywhere)
              sweep 2 (the logits again): the tile's sums [N, T_own, 5] -> the global
                sequence -> summed over the tile axis -> D, entropies, K, A
    backward  per owned tile and chunk: d l (the engine's), then
                grad_W_j += d l^T h_c   (the tile's rows; the halo's go back to their shards)
                grad_b_j += column sums of d l
                grad_h   += round(2^e_n (d l @ W_j)) in int64: exact, so neither the tile
                            order nor the TP all-reduce changes the bits (core.fixed_point),
                            with e_n from the bound g_n (s / T) max|W| sum|dD/dz| (its sum
                            from core.divergence.grad_bound)

Every GEMM and reduction runs on one tile's shape with chunk rows from the tile, so it has
the same bits on every layout. The forward takes the logits twice (four GEMMs, where the
default path takes two).
"""

from __future__ import annotations

import torch

from lp_kernels.backends.divergence import (
    as_partial,
    engine_of,
    finish_forward,
    merged_lse,
    real_heads,
)
from lp_kernels.backends.torch.deterministic import (
    global_tiles,
    owned_tiles,
    rank_tiles,
    tile_biases,
)
from lp_kernels.backends.torch.linear import Grads
from lp_kernels.core.chunks import padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.divergence import N_SUMS, DivergenceParams, grad_bound
from lp_kernels.core.fixed_point import MARGIN, exponents, from_fixed_point
from lp_kernels.core.matmul import addmm_f32_, mm_f32
from lp_kernels.core.stats import bias_grad, masked_upstream
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums, gather_stats, global_abs_max
from lp_kernels.distributed.halo import (
    bias_halo,
    owned_halo,
    return_halo_bias_grad,
    return_halo_grad,
)


def exchange_halos(weight, bias, t_weight, t_bias, p: LogprobParams) -> tuple:
    """``(halo, teacher halo, bias halo, teacher bias halo)``: the next shards' rows that
    this rank's crossing tile needs (empty without one; None without a bias)."""
    v_real = p.local_real_columns(weight.shape[0])
    _, halo = owned_halo(weight[:v_real], p)
    _, t_halo = owned_halo(t_weight[:v_real], p)
    return halo, t_halo, bias_halo(bias, v_real, p)[1], bias_halo(t_bias, v_real, p)[1]


def heads_by_tile(weight, bias, t_weight, t_bias, halos, p: LogprobParams) -> list:
    """``[(begin, w_j, b_j, wt_j, bt_j)]``: each owned tile's first column in this shard
    and both heads' rows and fp32 biases (views, or for the crossing tile copies joined to
    the halos)."""
    w_s, b_s, w_t, b_t = real_heads(weight, bias, t_weight, t_bias, p)
    halo, t_halo, b_halo, tb_halo = halos
    own, tile = p.tile_ownership(), p.deterministic_tile
    ws, wt = owned_tiles(w_s, halo, own, tile), owned_tiles(w_t, t_halo, own, tile)
    bs = tile_biases(b_s, b_halo, own, tile, len(ws))
    bt = tile_biases(b_t, tb_halo, own, tile, len(ws))
    return [
        (begin, w_j, b_j, wt_j, bt_j)
        for (begin, w_j), (_, wt_j), b_j, bt_j in zip(ws, wt, bs, bt, strict=True)
    ]


def _tile_sequence(per_tile: torch.Tensor, p: LogprobParams) -> torch.Tensor:
    """``[N, T_own_max, k]`` of every rank -> ``[N, T, k]``, the global tile sequence."""
    return global_tiles(gather_stats(per_tile, p.tp_group, p.tp_size), rank_tiles(p))


def _sweep(engine, hidden, t_hidden, tiles, dp, width: int, fill) -> torch.Tensor:
    """``[N, T, width]``: ``fill(state, r0, r1, rows)`` (``[rows, width]``) of every owned
    tile and chunk, in the global tile sequence."""
    p = dp.student
    n = hidden.shape[0]
    per_tile = torch.zeros((n, max(rank_tiles(p)), width), device=hidden.device)
    for j, (_, w_j, b_j, wt_j, bt_j) in enumerate(tiles):
        for r0, r1, h_c, state in engine.chunks(hidden, w_j, b_j, t_hidden, wt_j, bt_j, dp):
            per_tile[r0:r1, j] = fill(state, r0, r1, h_c.shape[0])[: r1 - r0]
    return _tile_sequence(per_tile, p)


def forward(engine, hidden, t_hidden, tiles, dp: DivergenceParams):
    """``(saved [N, 4], sums [N, 5])`` as the default path's, over the global tiles."""

    def lse_parts(state, r0, r1, rows):
        parts_s, parts_t = engine.lse_partials(state, dp)
        return torch.cat([as_partial(merged_lse(parts_s)), as_partial(merged_lse(parts_t))], 1)

    table = _sweep(engine, hidden, t_hidden, tiles, dp, 4, lse_parts).transpose(0, 1)
    lse_s, lse_t = merged_lse(table[..., :2]), merged_lse(table[..., 2:])

    def sums(state, r0, r1, rows):
        pad = (padded_rows(x, r0, r1, rows) for x in (lse_s, lse_t))
        return engine.local_sums(state, *pad, dp)

    total = _sweep(engine, hidden, t_hidden, tiles, dp, N_SUMS, sums).sum(dim=1)
    return torch.stack([lse_s, lse_t, total[:, 0], total[:, 3]], dim=1), total


class _FixedPointRows:
    """grad_hidden as an exact int64 sum of per-tile leaves (see the module docstring)."""

    def __init__(self, hidden, w_abs, bound, g, saved, ignored, p: LogprobParams):
        row = MARGIN * bound * g.double().abs() * p.transform.gain * w_abs
        self.e = exponents(row)
        finite = torch.isfinite(saved).all(dim=1)
        self.bad = ~torch.isfinite(row) | ~torch.isfinite(w_abs) | (~ignored & ~finite)
        self.acc = torch.zeros(hidden.shape, dtype=torch.int64, device=hidden.device)
        self.sums = RowSums(self.acc, p.tp_group, p.tp_size, enabled=p.reduce_grad_hidden)
        self.dtype = hidden.dtype

    def add(self, r0: int, r1: int, dl, w_j, *, last: bool) -> None:
        exp2 = torch.exp2(padded_rows(self.e, r0, r1, dl.shape[0])).float()
        leaf = mm_f32(dl, w_j).mul_(exp2[:, None]).round_()
        self.acc[r0:r1] += leaf[: r1 - r0].to(torch.int64)
        if last:
            self.sums.ready(r1)

    def finish(self) -> torch.Tensor:
        self.sums.finish()
        return from_fixed_point(self.acc, self.e, self.bad, self.dtype)


def host_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, dp: DivergenceParams):
    """``(saved [N, 4], sums [N, 5], bound [N] fp64, halos)``: the forward of
    :class:`LinearDivergenceDeterministic` on the prepared heads (``halos``: as
    :func:`exchange_halos` gives them)."""
    p = dp.student
    halos = exchange_halos(weight, bias, t_weight, t_bias, p)
    tiles = heads_by_tile(weight, bias, t_weight, t_bias, halos, p)
    saved, sums = forward(engine_of(dp), hidden, t_hidden, tiles, dp)
    bound = grad_bound(sums[:, 0], sums[:, 3], sums[:, 4], dp.kind, dp.beta)
    return saved, sums, bound, halos


def host_backward(kept: tuple, g_div, needs, dp: DivergenceParams) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` of :class:`LinearDivergenceDeterministic` for
    the forward's ``kept = (hidden, weight, bias, t_hidden, t_weight, t_bias, ignored,
    saved, bound, *halos)``."""
    hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, saved, bound, *halos = kept
    engine = engine_of(dp)
    p = dp.student
    need_h, need_w, need_b = needs
    v_real = p.local_real_columns(weight.shape[0])
    own, h_dim, dev = p.tile_ownership(), hidden.shape[1], hidden.device
    tiles = heads_by_tile(weight, bias, t_weight, t_bias, halos, p)
    (g,) = masked_upstream(ignored, g_div)
    sum_h = None
    if need_h:
        w_abs = global_abs_max(weight[:v_real], p.tp_group, p.tp_size)
        sum_h = _FixedPointRows(hidden, w_abs, bound, g, saved, ignored, p)
    acc_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
    acc_b = torch.zeros(v_real + own.halo, dtype=torch.float32, device=dev) if need_b else None
    back = need_w and p.tp_size > 1
    grad_halo = torch.zeros((own.halo, h_dim), dtype=torch.float32, device=dev) if back else None
    for j, (begin, w_j, b_j, wt_j, bt_j) in enumerate(tiles):
        width = w_j.shape[0]
        rows_here = min(width, v_real - begin)  # the rest are halo rows
        acc = None if acc_w is None else acc_w[begin : begin + width]
        if need_w and rows_here < width:
            acc = torch.zeros((width, h_dim), dtype=torch.float32, device=dev)
        chunks = engine.chunks(hidden, w_j, b_j, t_hidden, wt_j, bt_j, dp, backward=ignored)
        for r0, r1, h_c, state in chunks:
            rows = h_c.shape[0]
            pad = (padded_rows(x, r0, r1, rows) for x in (saved, g))
            dl = engine.dlogits(state, *pad, dp).to(hidden.dtype)
            if acc_b is not None:
                acc_b[begin : begin + width] += dl.sum(dim=0, dtype=torch.float32)
            if sum_h is not None:
                sum_h.add(r0, r1, dl, w_j, last=j == len(tiles) - 1)
            if acc is not None:
                h_c = torch.where(padded_rows(ignored, r0, r1, rows, False)[:, None], 0, h_c)
                addmm_f32_(acc, dl.T, h_c)
        if need_w and rows_here < width:
            acc_w[begin:v_real] = acc[:rows_here]
            grad_halo.copy_(acc[rows_here:])
    grad_h = None if sum_h is None else sum_h.finish()
    if back:  # after every all-reduce: the same order of collectives on every rank
        return_halo_grad(grad_halo, acc_w, p)
    if need_b and p.tp_size > 1:
        acc_b = return_halo_bias_grad(acc_b, v_real, p)
    grad_w = None if acc_w is None else acc_w.to(weight.dtype)
    return grad_h, grad_w, bias_grad(None if acc_b is None else acc_b[:v_real], bias)


class LinearDivergenceDeterministic(torch.autograd.Function):
    """``linear_divergence(deterministic=True)``: inputs and outputs as
    :class:`lp_kernels.backends.divergence.LinearDivergence`'s."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, dp):
        ctx.set_materialize_grads(False)
        heads = (hidden, weight, bias, t_hidden, t_weight, t_bias)
        saved, sums, bound, halos = host_forward(*heads, dp)
        saved_all = (*heads, ignored, saved, bound, *halos)
        return finish_forward(ctx, dp, saved_all, ignored, sums)

    @staticmethod
    @backend_backward
    def backward(ctx, g_div, *_):
        needs = tuple(ctx.needs_input_grad[:3])
        if g_div is None or not any(needs):
            return (None,) * 8
        grads = host_backward(ctx.saved_tensors, g_div, needs, ctx.params)
        return (*grads, None, None, None, None, None)
