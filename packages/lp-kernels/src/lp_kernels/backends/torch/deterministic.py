"""``deterministic=True`` for the torch backend: bitwise tensor-parallel invariance.

Outputs and both gradients are bitwise identical for any TP degree and any shard
layout whose bounds are multiples of 128, for any tile width ``w = deterministic_tile``.
A rank owns the global w-column tiles that start in its shard and computes each whole,
with the next shards' rows lent to it where a tile crosses its end
(``distributed.halo.tile_ownership``, ``exchange_halo``). Data flow::

    forward   halo rows from the next ranks
              per owned tile W_j (a view of the shard's rows; the crossing tile a copy
              of its rows here joined to the halo), per chunk of C token rows:
                z = (h_c W_j^T) / T                                 [C, w] fp32
                (m, s, a, t) of the tile                            [C, 4]
              all-gather -> keep each rank's owned tiles, in rank order
                         =  the global tile sequence             [N, T_global, 4]
              merge over the tile axis (one shape for every layout) -> outputs
    backward  per owned tile and chunk, d l as in the default path (rounded to the input
              dtype for the GEMMs)
              grad_W_j += d l^T h_c              (fp32, the tile's rows; the halo's rows
                                                  go back to their shards afterwards)
              grad_h: the tile's contribution d l @ W_j is computed in fp32 from zero,
                      scaled by 2^e_n and rounded to int64, and summed in int64: exact,
                      so the order (and the TP all-reduce) cannot change the bits; one
                      rounding back at the end.

Why it holds on CUDA as on CPU: every GEMM and every reduction runs on a tensor of one
tile's shape, ``[C, w]`` (the vocabulary's last tile: narrower, the same on every
layout), and C is a function of the tile, not of the shard (``linear_logprob`` passes
``default_chunk_rows(w)``). cuBLAS and torch's reduction kernels choose their summation
order from the shape, so the same tile gets the same kernel, and the same bits, on every
layout. Element-wise ops do not depend on the shape. The fixed-point scale per row comes
from a bound that every rank computes alike
(``lp_kernels.core.fixed_point``, shared with the triton backend).

Not batch-invariant on CUDA (a row's bits may depend on the other rows of its chunk, as
for the default torch path there); on CPU it is.
"""

from __future__ import annotations

import os
import warnings

import torch

from lp_kernels.backends.torch.linear import Grads, dlogits_chunks, logits_chunks
from lp_kernels.core.chunks import padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.extras import (
    NO_EXTRAS,
    empty_partials,
    extra_outputs,
    extra_terms,
    mark_extras,
    merge_extras,
)
from lp_kernels.core.fixed_point import from_fixed_point, row_exponents
from lp_kernels.core.matmul import addmm_f32_, mm_f32
from lp_kernels.core.stats import (
    N_STATS,
    bias_grad,
    masked_outputs,
    masked_upstream,
    target_columns,
)
from lp_kernels.core.tiles import tile_ownership
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import (
    RowSums,
    bias_abs_max,
    gather_stats,
    global_abs_max,
)
from lp_kernels.distributed.halo import (
    bias_halo,
    owned_halo,
    return_halo_bias_grad,
    return_halo_grad,
)

MANY_TILES = 128
"""A CUDA call with more owned tiles than this warns: each tile makes its own calls."""

_NOT_THE_CALLER = (  # lp_kernels' and torch's own frames (warnings.warn skips them)
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _tile_stats(z: torch.Tensor, t_rel, hit, tile: int, *, entropy: bool) -> torch.Tensor:
    """``[C, T, 4]`` partials of each ``tile``-column tile of ``z [C, width]``; ``t_rel``
    is the target's column in ``z`` where ``hit``."""
    rows, width = z.shape
    n_tiles = -(-width // tile)
    out = torch.zeros((rows, n_tiles, N_STATS), dtype=torch.float32, device=z.device)
    zt = torch.where(hit, z.gather(1, torch.where(hit, t_rel, 0)[:, None])[:, 0], 0.0)
    out[torch.arange(rows, device=z.device), torch.where(hit, t_rel // tile, 0), 3] = zt
    if width != n_tiles * tile:  # the vocabulary's last tile: -inf past its end
        zz = torch.full((rows, n_tiles * tile), float("-inf"), dtype=z.dtype, device=z.device)
        zz[:, :width] = z
        z = zz
    zz = z.view(rows, n_tiles, tile)
    m = zz.amax(dim=2)
    # -inf past the vocabulary's end and at masked entries; a tile all -inf in a row
    # (masked) subtracts 0, not -inf, so its e = 0 and it drops out of the merge exactly
    d = zz - torch.where(m == float("-inf"), 0.0, m)[..., None]
    e = torch.exp(d)
    out[..., 0] = m
    out[..., 1] = e.sum(dim=2)
    if entropy:
        out[..., 2] = torch.where(e > 0, e * d, 0.0).sum(dim=2)
    return out


def _merge_tiles(stats: torch.Tensor, *, entropy: bool):
    """Merge ``[N, T, 4]`` tile partials over the tile axis (see lp_kernels.core.stats)."""
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


def rank_tiles(p: LogprobParams) -> list[int]:
    """Tiles owned by each rank, in rank order (see ``distributed.halo.tile_ownership``)."""
    return [
        tile_ownership(p.shard_starts, p.shard_sizes, p.vocab_size, p.deterministic_tile, r).tiles
        for r in range(len(p.shard_sizes))
    ]


def global_tiles(gathered: torch.Tensor, tiles: list[int]) -> torch.Tensor:
    """``[P, N, T_max, 4]`` -> ``[N, T_global, 4]``: each rank's owned tiles, in rank order."""
    return torch.cat([gathered[r, :, :count] for r, count in enumerate(tiles)], dim=1)


def merged_tile_stats(blocks, t_own, in_own, n: int, p: LogprobParams, device, first_id=0):
    """Tile partials of every block, exchanged and merged in global tile order.

    ``blocks`` yields ``(r0, r1, rows, j, count, z)``: token rows ``[r0, r1)`` padded to
    ``rows``, and ``z [rows, width]``, the scaled logits of consecutive tiles whose first
    ``count`` are this rank's owned tiles ``[j, j + count)`` (the first owned tile is 0);
    any after them are ignored. ``t_own`` / ``in_own``: the target's column counted from
    the first owned tile's start, and whether it is an owned column. Returns ``(lse, E or
    None, target logit, entropy or None, extras)``, each ``[N]`` fp32; ``extras``: with
    ``p.extras`` the merged extras ``(x [N, 3], i [N])`` (``first_id``: the global id of
    the first owned tile's first column), else None. Shared with
    ``vocab_parallel_logprob(deterministic=True)``.
    """
    tile = p.deterministic_tile
    tiles = rank_tiles(p)
    stats = torch.zeros((n, max(tiles), N_STATS), dtype=torch.float32, device=device)
    extra = empty_partials((n, max(tiles)), device) if p.extras else None
    for r0, r1, rows, j, count, z in blocks:
        if extra is not None:  # before _tile_stats (which may reuse z)
            x, i = tile_extras(z, first_id + j * tile, p)
            extra[0][r0:r1, j : j + count] = x[: r1 - r0, :count]
            extra[1][r0:r1, j : j + count] = i[: r1 - r0, :count]
        t_rel = padded_rows(t_own, r0, r1, rows) - j * tile  # z's column
        in_z = (t_rel >= 0) & (t_rel < count * tile)
        hit = padded_rows(in_own, r0, r1, rows, False) & in_z  # (a view: not in place)
        part = _tile_stats(z, t_rel, hit, tile, entropy=p.return_entropy)
        stats[r0:r1, j : j + count] = part[: r1 - r0, :count]
    merged = global_tiles(gather_stats(stats, p.tp_group, p.tp_size), tiles)
    out = _merge_tiles(merged, entropy=p.return_entropy)
    if extra is None:
        return *out, None
    # the global tile sequence, merged tile by tile in order (one sequence on every layout)
    x, i = (global_tiles(gather_stats(t, p.tp_group, p.tp_size), tiles) for t in extra)
    return *out, merge_extras(x.transpose(0, 1), i.transpose(0, 1))


def tile_extras(z: torch.Tensor, first_id: int, p: LogprobParams):
    """``(x [C, T, 3], i [C, T])``: the extras partial of each ``tile``-column tile of ``z
    [C, width]`` (``core.extras``), whose column 0 is id ``first_id``; columns at or past
    ``vocab_size`` (the vocabulary's last tile) take no part."""
    rows, width = z.shape
    tile = p.deterministic_tile
    n_tiles = -(-width // tile)
    if width != n_tiles * tile:
        zz = torch.zeros((rows, n_tiles * tile), dtype=z.dtype, device=z.device)
        zz[:, :width] = z
        z = zz
    ids = first_id + torch.arange(n_tiles * tile, device=z.device).view(n_tiles, tile)
    starts = ids[:, 0]  # each tile's first id: its partial's column counts from there
    return extra_terms(z.view(rows, n_tiles, tile), starts, ids < p.vocab_size)


def owned_tiles(w_real: torch.Tensor, halo: torch.Tensor, own, tile: int):
    """``[(begin, W_j)]`` for each owned tile: its first column in this shard and its
    weight rows, a view of ``w_real``; the tile that runs into the halo is a copy of its
    rows here joined to the halo (never the whole shard). ``w_real`` may be the fp32 bias
    ``[V_r]`` too, with its halo."""
    v_real = w_real.shape[0]
    out = []
    for begin in range(own.skip, own.skip + own.ext, tile):
        end = min(begin + tile, own.skip + own.ext)
        w_j = w_real[begin:end] if end <= v_real else torch.cat([w_real[begin:], halo])
        out.append((begin, w_j))
    return out


def tile_biases(b_real, b_halo, own, tile: int, count: int) -> list:
    """Each owned tile's fp32 bias (as :func:`owned_tiles`), or ``count`` Nones."""
    if b_real is None:
        return [None] * count
    return [b for _, b in owned_tiles(b_real, b_halo, own, tile)]


def forward(hidden, weight, bias, targets, p: LogprobParams):
    """``((logprob, entropy, lse), lse, E, halo, bias halo)``: the outputs (masked), the raw
    statistics and the halo rows the backward reads (see the module docstring)."""
    n = hidden.shape[0]
    v_real = p.local_real_columns(weight.shape[0])
    own, halo = owned_halo(weight[:v_real], p)
    b_real, b_halo = bias_halo(bias, v_real, p)
    if hidden.is_cuda and own.tiles > MANY_TILES:
        warnings.warn(
            f"deterministic=True with backend='torch' on CUDA makes its GEMMs and "
            f"reductions tile by tile: this shard has {own.tiles} tiles of "
            f"deterministic_tile={p.deterministic_tile} columns, and the step is bound by "
            "kernel launches. Use the default tile (deterministic_tile=None) or "
            "backend='triton'",
            skip_file_prefixes=_NOT_THE_CALLER,  # point at the caller's line
        )
    t_own, in_own, ignored = target_columns(
        targets, p.ignore_index, p.vocab_start + own.skip, own.ext
    )
    tiles = owned_tiles(weight[:v_real], halo, own, p.deterministic_tile)
    b_tiles = tile_biases(b_real, b_halo, own, p.deterministic_tile, len(tiles))
    chunks = (
        (r0, r1, rows, j, 1, z)
        for j, ((_, w_j), b_j) in enumerate(zip(tiles, b_tiles, strict=True))
        for r0, r1, rows, _, z, _ in logits_chunks(hidden, w_j, p, b_real=b_j)
    )
    first_id = p.vocab_start + own.skip
    lse, mean_z, zt, ent, extra = merged_tile_stats(
        chunks, t_own, in_own, n, p, hidden.device, first_id
    )
    outputs = masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)
    extras = NO_EXTRAS if extra is None else extra_outputs(*extra, lse, targets, p)
    return (*outputs, *extras), lse, mean_z, halo, b_halo


def backward(saved, upstream: Grads, needs: tuple[bool, bool, bool], p: LogprobParams) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` from the forward's saved tensors ``(hidden,
    weight, bias, targets, lse, E, halo, bias halo)`` and the upstream gradients."""
    hidden, weight, bias, targets, lse, mean_z, halo, b_halo = saved
    need_h, need_w, need_b = needs
    h_dim = hidden.shape[1]
    dev = hidden.device
    v_real = p.local_real_columns(weight.shape[0])
    w_real = weight[:v_real]
    own = p.tile_ownership()
    tiles = owned_tiles(w_real, halo, own, p.deterministic_tile)
    b_real = None if bias is None else bias[:v_real].float()
    b_tiles = tile_biases(b_real, b_halo, own, p.deterministic_tile, len(tiles))
    # grad_bias over this shard's real columns, then the halo's (sent back like grad_W)
    acc_b = torch.zeros(v_real + own.halo, dtype=torch.float32, device=dev) if need_b else None
    sum_h = FixedPointRows(hidden, w_real, b_real, lse, targets, upstream, p) if need_h else None
    acc_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
    # the halo's grad_W rows are computed here, with their tile, and go back to the ranks
    # that hold them; this shard's first `skip` rows arrive from their owner
    back = need_w and p.tp_size > 1
    grad_halo = torch.zeros((own.halo, h_dim), dtype=torch.float32, device=dev) if back else None
    for j, (begin, w_j) in enumerate(tiles):
        rows_here = min(w_j.shape[0], v_real - begin)  # the rest are halo rows
        acc = None
        if need_w:
            acc = acc_w[begin : begin + w_j.shape[0]]
            if rows_here < w_j.shape[0]:
                acc = torch.zeros((w_j.shape[0], h_dim), dtype=torch.float32, device=dev)
        acc_bj = None if acc_b is None else acc_b[begin : begin + w_j.shape[0]]
        for r0, r1, h_c, dl in dlogits_chunks(
            hidden,
            w_j,
            targets,
            lse,
            mean_z,
            upstream,
            p,
            first_id=p.vocab_start + begin,
            b_real=b_tiles[j],
            grad_bias=acc_bj,
        ):
            if sum_h is not None:
                sum_h.add(r0, r1, dl, w_j, last=j == len(tiles) - 1)
            if need_w:
                addmm_f32_(acc, dl.T, h_c)
        if need_w and rows_here < w_j.shape[0]:
            acc_w[begin:v_real] = acc[:rows_here]
            grad_halo.copy_(acc[rows_here:])
    grad_h = None if sum_h is None else sum_h.finish()
    if back:  # after every all-reduce: the same order of collectives on every rank
        return_halo_grad(grad_halo, acc_w, p)
    if need_b and p.tp_size > 1:  # the halo's entries to their shards, as for grad_W
        acc_b = return_halo_bias_grad(acc_b, v_real, p)
    grad_w = acc_w.to(weight.dtype) if need_w else None
    grad_b = bias_grad(None if acc_b is None else acc_b[:v_real], bias)
    return grad_h, grad_w, grad_b


class FixedPointRows:
    """grad_hidden as an exact int64 sum (lp_kernels.core.fixed_point): each tile's fp32
    ``d l @ W_j``, from zero, scaled by the row's ``2^e_n`` and rounded, then added; the
    rows' tensor-parallel sum (int64, exact) starts as the last tile finishes them."""

    def __init__(self, hidden, w_real, b_real, lse, targets, upstream: Grads, p):
        n, h_dim = hidden.shape
        ignored = targets.long() == p.ignore_index
        g_lp, g_ent, g_lse = masked_upstream(ignored, *upstream)
        w_abs = global_abs_max(w_real, p.tp_group, p.tp_size)
        b_abs = None if b_real is None else bias_abs_max(b_real, p.tp_group, p.tp_size)
        self.scale, self.bad = row_exponents(
            hidden, w_abs, lse, ignored, g_lp, g_ent, g_lse, p, b_abs=b_abs
        )
        self.acc = torch.zeros((n, h_dim), dtype=torch.int64, device=hidden.device)
        self.dtype = hidden.dtype
        self.sums = RowSums(self.acc, p.tp_group, p.tp_size, enabled=p.reduce_grad_hidden)

    def add(self, r0: int, r1: int, dl: torch.Tensor, w_j: torch.Tensor, *, last: bool):
        """Tile ``w_j``'s contribution to rows ``[r0, r1)`` (``dl`` padded to its chunk);
        ``last``: no tile follows, so rows ``[0, r1)`` are final."""
        # 2^e_n is an fp32 power of two (|e_n| <= 126) and |leaf| 2^e_n < 2^61 (the
        # bound): the scaling is exact in fp32, the integers those of fp64
        exp2 = torch.exp2(padded_rows(self.scale, r0, r1, dl.shape[0])).float()
        leaf = mm_f32(dl, w_j).mul_(exp2[:, None]).round_()
        self.acc[r0:r1] += leaf[: r1 - r0].to(torch.int64)
        if last:
            self.sums.ready(r1)

    def finish(self) -> torch.Tensor:
        """grad_hidden in the hidden dtype (one rounding; NaN rows where the bound is not
        finite)."""
        self.sums.finish()
        return from_fixed_point(self.acc, self.scale, self.bad, self.dtype)


class LinearLogprobTorchDeterministic(torch.autograd.Function):
    """TP-invariant torch implementation: saves the inputs, the statistics and the halo,
    calls :func:`forward` and :func:`backward`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        outputs, *stats = forward(hidden, weight, bias, targets, p)
        ctx.save_for_backward(hidden, weight, bias, targets, *stats)
        ctx.params = p
        mark_extras(ctx, outputs)
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse, *_):
        needs = tuple(ctx.needs_input_grad[:3])
        grads = backward(ctx.saved_tensors, (g_lp, g_ent, g_lse), needs, ctx.params)
        return (*grads, None, None)
