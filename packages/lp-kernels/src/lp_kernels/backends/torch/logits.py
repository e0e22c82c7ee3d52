"""``vocab_parallel_logprob``'s implementation: lp's outputs from logits the caller holds.

For the stock Megatron path, where the output layer has produced ``[N, V_local]`` logits
(often upcast to fp32). Data flow::

    forward   for each chunk of C rows (the last zero-padded to C, as in the torch backend
              of linear_logprob, so every reduction has one shape):
                z = transform(logits_c[:, :V_r].float())   [C, V_r] fp32 scratch
                (m, s, a, t) per row -> stats[N, 4]
              all-gather over tp_group, merge in rank order -> logprob, entropy, lse
    backward  grad = one buffer [N, V_local] in the logits dtype, allocated once
              for each chunk:  grad[c, :V_r] = d z * dz/dl  (fp32 math, one cast on store)
                               grad[c, V_r:] = 0            (padded vocabulary)

The backward never builds a list of chunk gradients to concatenate: its peak is the
returned gradient plus one fp32 chunk, about (1 + 1/chunks) x the gradient for fp32
logits. The logits themselves are saved by reference (no copy). Logits may be masked to
``-inf`` (top-k / top-p): the statistics and d_logits take ``0 x -inf`` as 0 there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lp_kernels.backends.torch.deterministic import merged_tile_stats
from lp_kernels.backends.torch.linear import Grads, merged_extras
from lp_kernels.core.chunks import chunk_tiles, chunks, padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.extras import NO_EXTRAS, ExtraRows, extra_outputs, mark_extras
from lp_kernels.core.matmul import scratch
from lp_kernels.core.stats import (
    N_STATS,
    d_logits_,
    local_stats,
    masked_outputs,
    masked_upstream,
    merge_stats,
    target_columns,
)
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import gather_stats


def _chunk_z(logits, r0: int, r1: int, rows: int, v_real: int, p: LogprobParams, slope=False):
    """``(z, s)``: a fresh fp32 ``[rows, v_real]`` copy of ``transform(logits[r0:r1,
    :v_real])``, zero-padded rows, and the transform's slope (``slope`` and a cap) or None."""
    z = torch.empty((rows, v_real), dtype=torch.float32, device=logits.device)
    z[: r1 - r0] = logits[r0:r1, :v_real]
    z[r1 - r0 :] = 0.0
    return z, p.transform.apply_(z, slope=slope)


def _tile_chunks(logits, r0: int, r1: int, rows: int, v_real: int, p: LogprobParams) -> Iterator:
    """``deterministic=True``: yield ``(j, count, z)`` for this shard's tiles in vocabulary
    chunks of ``g = chunk_tiles(tile)`` tiles, from its first tile: ``z [rows, g * tile]``
    fp32 holds tiles ``[j, j + count)`` (transformed, zero-padded rows; ``-inf`` past the
    vocabulary's end in its last tile) and zeros in the ``g - count`` unused tiles after them.
    Every reduction then has one shape, ``[rows, g, tile]``, on every layout; a tile's
    position in its chunk may differ between layouts, which a reduction over its own row of
    ``tile`` values does not see."""
    tile = p.deterministic_tile
    g = chunk_tiles(tile)
    count = -(-v_real // tile)
    dev = logits.device
    for j in range(0, count, g):
        c0, c1 = j * tile, min((j + g) * tile, v_real)
        real = c1 - c0
        z = torch.empty((rows, g * tile), dtype=torch.float32, device=dev)
        z[: r1 - r0, :real] = logits[r0:r1, c0:c1]
        z[r1 - r0 :, :real] = 0.0
        cut = -(-real // tile) * tile  # the end of the last tile with real columns
        z[:, real:cut] = float("-inf")  # the vocabulary's last tile, past its end
        z[:, cut:] = 0.0
        p.transform.apply_(z)  # -inf (past the vocabulary) stays -inf
        yield j, min(g, count - j), z


def forward(logits: torch.Tensor, targets: torch.Tensor, p: LogprobParams):
    """``((logprob, entropy, lse), lse, E)``: the outputs (masked) and the raw statistics the
    backward reads."""
    n = logits.shape[0]
    v_real = p.local_real_columns(logits.shape[1])
    t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
    if p.deterministic:
        tile_chunks = (
            (r0, r1, rows, j, count, z)
            for r0, r1, rows in chunks(n, p.chunk_size)
            for j, count, z in _tile_chunks(logits, r0, r1, rows, v_real, p)
        )
        lse, mean_z, zt, ent, extra = merged_tile_stats(
            tile_chunks, t_local, in_shard, n, p, logits.device, p.vocab_start
        )
        extras = NO_EXTRAS if extra is None else extra_outputs(*extra, lse, targets, p)
    else:
        stats = scratch.empty((n, N_STATS), dtype=torch.float32, device=logits.device)
        rows_x = ExtraRows(n, logits.device) if p.extras else None
        for r0, r1, rows in chunks(n, p.chunk_size):
            z, _ = _chunk_z(logits, r0, r1, rows, v_real, p)
            if rows_x is not None:  # before local_stats turns z into z - m
                rows_x.add(r0, r1, z, p.vocab_start)
            part = torch.empty((rows, N_STATS), dtype=torch.float32, device=logits.device)
            local_stats(
                z,
                padded_rows(t_local, r0, r1, rows),
                padded_rows(in_shard, r0, r1, rows, False),
                entropy=p.return_entropy,
                out=part,
                masked=True,  # logits may be masked to -inf (top-k / top-p)
            )
            stats[r0:r1] = part[: r1 - r0]
        gathered = gather_stats(stats, p.tp_group, p.tp_size)
        lse, mean_z, zt, ent = merge_stats(gathered, entropy=p.return_entropy)
        extras = merged_extras(rows_x, lse, targets, p)
    outputs = masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)
    return (*outputs, *extras), lse, mean_z


def backward(logits, targets, lse, mean_z, upstream: Grads, p: LogprobParams) -> torch.Tensor:
    """The logits' gradient (their dtype, ``[N, V_local]``; zeros in padding columns and on
    ignored rows) for the upstream gradients ``(g_lp, g_ent, g_lse)``."""
    n, v_local = logits.shape
    v_real = p.local_real_columns(v_local)
    t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
    g_lp, g_ent, g_lse = masked_upstream(ignored, *upstream)
    grad = scratch.empty((n, v_local), dtype=logits.dtype, device=logits.device)
    for r0, r1, rows in chunks(n, p.chunk_size):
        z, slope = _chunk_z(logits, r0, r1, rows, v_real, p, slope=True)
        dz = d_logits_(
            z,
            padded_rows(lse, r0, r1, rows),
            None if mean_z is None else padded_rows(mean_z, r0, r1, rows),
            padded_rows(t_local, r0, r1, rows),
            padded_rows(in_shard, r0, r1, rows, False),
            *(None if g is None else padded_rows(g, r0, r1, rows) for g in (g_lp, g_ent, g_lse)),
            masked=True,
        )
        p.transform.chain_(dz, slope)
        dz.masked_fill_(padded_rows(ignored, r0, r1, rows, False)[:, None], 0.0)
        grad[r0:r1, :v_real] = dz[: r1 - r0]
        if v_real < v_local:
            grad[r0:r1, v_real:] = 0.0
    return grad


class VocabParallelLogprob(torch.autograd.Function):
    """Chunked fp32 log-probs from logits with a streaming backward buffer: saves the logits
    (by reference) and the statistics, calls :func:`forward` and :func:`backward`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, p: LogprobParams):
        ctx.set_materialize_grads(False)
        outputs, lse, mean_z = forward(logits, targets, p)
        ctx.save_for_backward(logits, targets, lse, mean_z)
        ctx.params = p
        mark_extras(ctx, outputs)
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse, *_):
        logits, targets, lse, mean_z = ctx.saved_tensors
        grad = backward(logits, targets, lse, mean_z, (g_lp, g_ent, g_lse), ctx.params)
        return grad, None, None
