"""``deterministic=True`` for the torch backend: bitwise tensor-parallel invariance (CPU).

Outputs and both gradients are bitwise identical for any TP degree and any shard
layout whose bounds are multiples of 128, for any tile width ``w = deterministic_tile``
(128 by default). A rank owns the global w-column tiles that start in its shard and
computes each whole, with the next shards' rows lent to it where a tile crosses its end
(``_dist.tile_ownership``, ``_dist.exchange_halo``). Data flow::

    forward   halo rows from the next ranks; W_o = the owned tiles' rows
              per chunk of rows, z = (h W_o^T) / T                 [C, V_o] fp32
              per owned w-column tile: (m, s, a, t)                 [C, T_r, 4]
              all-gather -> keep each rank's owned tiles, in rank order
                         =  the global tile sequence             [N, T_global, 4]
              merge over the tile axis (one shape for every layout) -> outputs
    backward  d l as in the default path (rounded to the input dtype for the GEMMs), over
              the shard's real rows and the halo
              grad_W_r += d l^T h_c                                 (local rows, fp32)
              grad_h: each owned w-column tile's contribution d l[:, tile] @ W[tile] is
                      computed in fp32 from zero, scaled by 2^e_n and rounded to int64,
                      and summed in int64: exact, so the order (and the TP all-reduce)
                      cannot change the bits; one rounding back at the end.

The fixed-point scale per row comes from a bound that every rank computes alike
(``lp_kernels._fixed_point``, shared with the triton backend).

Scope: the torch backend on CPU, where the per-row results of these GEMMs and
reductions do not depend on the shard width (tested). On CUDA the torch backend's GEMMs
are not shape-invariant, so ``deterministic=True`` there needs the triton backend.
"""

from __future__ import annotations

import torch

from lp_kernels._compile import backend_backward
from lp_kernels._dist import (
    RowSums,
    gather_stats,
    owned_weight,
    tile_ownership,
    with_halo,
)
from lp_kernels._fixed_point import from_fixed_point, row_exponents
from lp_kernels._matmul import addmm_f32_, mm_f32
from lp_kernels._stats import N_STATS, masked_outputs, masked_upstream, target_columns
from lp_kernels._types import LogprobParams
from lp_kernels.backends.torch_linear import (
    logits_grad_chunks,
    padded_rows,
    scaled_logits_chunks,
)


def _tiles(real: int, tile: int) -> int:
    return -(-real // tile)


def _tile_stats(z: torch.Tensor, t_local, in_shard, tile: int, *, entropy: bool) -> torch.Tensor:
    """``[C, T_r, 4]`` partials of each ``tile``-column tile of ``z [C, V_r]`` (overwritten)."""
    rows, v_real = z.shape
    n_tiles = _tiles(v_real, tile)
    out = torch.zeros((rows, n_tiles, N_STATS), dtype=torch.float32, device=z.device)
    if n_tiles == 0:
        return out
    zt = torch.where(in_shard, z.gather(1, torch.where(in_shard, t_local, 0)[:, None])[:, 0], 0.0)
    tile_of_t = torch.where(in_shard, t_local // tile, 0)
    out[torch.arange(rows, device=z.device), tile_of_t, 3] = zt
    zz = torch.full((rows, n_tiles * tile), float("-inf"), dtype=torch.float32, device=z.device)
    zz[:, :v_real] = z
    zz = zz.view(rows, n_tiles, tile)
    m = zz.amax(dim=2)
    d = zz - m[..., None]  # -inf on padding columns of the last tile
    e = torch.exp(d)
    out[..., 0] = m
    out[..., 1] = e.sum(dim=2)
    if entropy:
        out[..., 2] = torch.where(e > 0, e * d, 0.0).sum(dim=2)
    return out


def _merge_tiles(stats: torch.Tensor, *, entropy: bool):
    """Merge ``[N, T, 4]`` tile partials over the tile axis (see lp_kernels._stats)."""
    m, s, a, t = stats.unbind(dim=2)
    big_m = m.amax(dim=1)
    w = torch.exp(m - big_m[:, None])
    big_s = (w * s).sum(dim=1)
    zt = t.sum(dim=1)  # one nonzero per row: exact
    log_s = torch.log(big_s)
    lse = big_m + log_s
    if not entropy:
        return lse, None, zt, None
    shift = torch.where(w > 0, m - big_m[:, None], 0.0)
    mean_shift = (w * (a + shift * s)).sum(dim=1) / big_s
    return lse, big_m + mean_shift, zt, log_s - mean_shift


def _rank_tiles(p: LogprobParams) -> list[int]:
    """Tiles owned by each rank, in rank order (see ``_dist.tile_ownership``)."""
    return [
        tile_ownership(p.shard_starts, p.shard_sizes, p.vocab_size, p.deterministic_tile, r).tiles
        for r in range(len(p.shard_sizes))
    ]


def _global_tiles(gathered: torch.Tensor, p: LogprobParams) -> torch.Tensor:
    """``[P, N, T_max, 4]`` -> ``[N, T_global, 4]``: each rank's owned tiles, in rank order."""
    parts = [gathered[r, :, :tiles] for r, tiles in enumerate(_rank_tiles(p))]
    return torch.cat(parts, dim=1)


def merged_tile_stats(z_chunks, t_local, in_shard, n: int, p: LogprobParams, device):
    """Tile partials of every ``(r0, r1, rows, z)`` chunk, exchanged and merged in tile order.

    ``z`` holds the columns of this rank's owned tiles (from the first one's start).
    Returns ``(lse, E or None, target logit, entropy or None)``, each ``[N]`` fp32. Shared
    with ``vocab_parallel_logprob(deterministic=True)`` (shard bounds on the tile grid,
    so each rank owns the tiles of its own columns).
    """
    t_max = max(_rank_tiles(p))
    stats = torch.zeros((n, t_max, N_STATS), dtype=torch.float32, device=device)
    for r0, r1, rows, z in z_chunks:
        part = _tile_stats(
            z,
            padded_rows(t_local, r0, r1, rows),
            padded_rows(in_shard, r0, r1, rows, False),
            p.deterministic_tile,
            entropy=p.return_entropy,
        )
        stats[r0:r1, : part.shape[1]] = part[: r1 - r0]
    tiles = _global_tiles(gather_stats(stats, p.tp_group, p.tp_size), p)
    return _merge_tiles(tiles, entropy=p.return_entropy)


class LinearLogprobTorchDeterministic(torch.autograd.Function):
    """TP-invariant torch implementation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        v_real = p.local_real_columns(weight.shape[0])
        own, w_all = owned_weight(weight[:v_real], p)
        w_own = w_all[own.skip : own.skip + own.ext]
        t_local, in_shard, ignored = target_columns(
            targets, p.ignore_index, p.vocab_start + own.skip, own.ext
        )
        z_chunks = (c[:3] + c[4:] for c in scaled_logits_chunks(hidden, w_own, p))
        lse, mean_z, zt, ent = merged_tile_stats(z_chunks, t_local, in_shard, n, p, hidden.device)
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z, w_all[v_real:])
        ctx.params = p
        return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, targets, lse, mean_z, halo = ctx.saved_tensors
        p: LogprobParams = ctx.params
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        own = p.tile_ownership()
        # this shard's real rows, then the halo: d_logits of all of them (columns past
        # v_real feed only grad_h, the first `skip` only grad_W)
        w_all = with_halo(weight[:v_real], halo)
        ignored = targets == p.ignore_index
        g_lp_, g_ent_, g_lse_ = masked_upstream(ignored, g_lp, g_ent, g_lse)
        scale = bad = None
        if need_h:
            scale, bad = row_exponents(hidden, w_all, lse, ignored, g_lp_, g_ent_, g_lse_, p)
            acc_h = torch.zeros((n, h_dim), dtype=torch.int64, device=hidden.device)
        acc_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        sums = RowSums(acc_h if need_h else None, p.tp_group, p.tp_size,
                       enabled=p.reduce_grad_hidden)  # fmt: skip
        for r0, r1, h_c, dl in logits_grad_chunks(
            hidden, w_all, targets, lse, mean_z, (g_lp, g_ent, g_lse), p
        ):
            if need_h:
                exp2 = torch.exp2(padded_rows(scale, r0, r1, dl.shape[0]))[:, None]
                tile = p.deterministic_tile
                for c0 in range(own.skip, own.skip + own.ext, tile):
                    leaf = mm_f32(dl[:, c0 : c0 + tile], w_all[c0 : c0 + tile]).double()
                    acc_h[r0:r1] += torch.round(leaf * exp2)[: r1 - r0].to(torch.int64)
                sums.ready(r1)  # rows [0, r1) are final
            if need_w and v_real > 0:
                addmm_f32_(acc_w[:v_real], dl[:, :v_real].T, h_c)
        grad_h = None
        if need_h:
            sums.finish()
            grad_h = from_fixed_point(acc_h, scale, bad, hidden.dtype)
        grad_w = acc_w.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None
