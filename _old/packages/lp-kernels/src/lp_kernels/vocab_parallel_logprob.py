"""``vocab_parallel_logprob``: the lp contract for callers that already hold logits.

For the stock Megatron path, where the output layer has produced ``[*, V_local]``
logits (often upcast to fp32). Data flow::

    forward   for each chunk of C token rows (the last zero-padded to C, as in the
              torch backend of linear_logprob, so every reduction has one shape):
                z = logits_c[:, :V_r].float() / T          [C, V_r] fp32 scratch
                (m, s, a, t) per row -> stats[N, 4]
              all-gather over tp_group, merge in rank order -> logprob, entropy, lse
    backward  grad = one buffer [N, V_local] in the logits dtype, allocated once
              for each chunk:  grad[c, :V_r] = d z / T  (fp32 math, one cast on store)
                               grad[c, V_r:] = 0        (padded vocabulary)

The backward never builds a list of chunk gradients to concatenate: its peak is
the returned gradient plus one fp32 chunk, about (1 + 1/chunks) x the gradient
for fp32 logits. The logits themselves are saved by reference (no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from lp_kernels import _amp
from lp_kernels._compile import backend_backward, eager_under_compile
from lp_kernels._matmul import scratch
from lp_kernels._prepare import group_tiles, prepare, shaped
from lp_kernels._softcap import softcap_
from lp_kernels._stats import (
    N_STATS,
    d_logits_,
    local_stats,
    masked_outputs,
    masked_upstream,
    merge_stats,
    target_columns,
)
from lp_kernels._types import LogProbOutput, LogprobParams
from lp_kernels.backends.torch.deterministic import merged_tile_stats
from lp_kernels.backends.torch.linear import chunks, padded_rows
from lp_kernels.distributed.collectives import gather_stats
from lp_kernels.tiles import DETERMINISTIC_TILE


def _scaled_chunk(
    logits: torch.Tensor,
    r0: int,
    r1: int,
    rows: int,
    v_real: int,
    p: LogprobParams,
    slope: bool = False,
):
    """``(z, s)``: a fresh fp32 ``[rows, v_real]`` copy of ``softcap(logits[r0:r1, :v_real]) /
    T``, zero-padded rows, and the cap's slope ``1 - tanh^2`` (``slope`` and a cap) or None."""
    z = torch.empty((rows, v_real), dtype=torch.float32, device=logits.device)
    z[: r1 - r0] = logits[r0:r1, :v_real]
    z[r1 - r0 :] = 0.0
    s = None if p.softcap is None else softcap_(z, p.softcap, slope=slope)
    if p.inv_temperature != 1.0:
        z.mul_(p.inv_temperature)
    return z, s


def _tile_groups(logits: torch.Tensor, r0: int, r1: int, rows: int, v_real: int, p):
    """``deterministic=True``: yield ``(j, slots, z)`` for this shard's tiles in groups of
    ``g = group_tiles(tile)``, from its first tile: ``z [rows, g * tile]`` fp32 holds tiles
    ``[j, j + slots)`` (``logits / T``, zero-padded rows; ``-inf`` past the vocabulary's
    end in its last tile) and zeros in the ``g - slots`` unused tiles after them. Every
    reduction then has one shape, ``[rows, g, tile]``, on every layout; a tile's position
    in its group may differ between layouts, which a reduction over its own row of
    ``tile`` values does not see."""
    tile = p.deterministic_tile
    g = group_tiles(tile)
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
        if p.softcap is not None:  # -inf (past the vocabulary) stays -inf
            softcap_(z, p.softcap)
        if p.temperature != 1.0:
            z.mul_(p.inv_temperature)
        yield j, min(g, count - j), z


class VocabParallelLogprob(torch.autograd.Function):
    """Chunked fp32 log-probs from logits with a streaming backward buffer."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, p: LogprobParams):
        ctx.set_materialize_grads(False)
        n = logits.shape[0]
        v_real = p.local_real_columns(logits.shape[1])
        t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
        if p.deterministic:
            blocks = (
                (r0, r1, rows, j, slots, z)
                for r0, r1, rows in chunks(n, p.chunk_size)
                for j, slots, z in _tile_groups(logits, r0, r1, rows, v_real, p)
            )
            lse, mean_z, zt, ent = merged_tile_stats(blocks, t_local, in_shard, n, p, logits.device)
            ctx.save_for_backward(logits, targets, lse, mean_z)
            ctx.params = p
            return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)
        stats = scratch.empty((n, N_STATS), dtype=torch.float32, device=logits.device)
        for r0, r1, rows in chunks(n, p.chunk_size):
            z, _ = _scaled_chunk(logits, r0, r1, rows, v_real, p)
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
        lse, mean_z, zt, ent = merge_stats(
            gather_stats(stats, p.tp_group, p.tp_size), entropy=p.return_entropy
        )
        ctx.save_for_backward(logits, targets, lse, mean_z)
        ctx.params = p
        return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        logits, targets, lse, mean_z = ctx.saved_tensors
        p: LogprobParams = ctx.params
        n, v_local = logits.shape
        v_real = p.local_real_columns(v_local)
        t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
        g_lp, g_ent, g_lse = masked_upstream(ignored, g_lp, g_ent, g_lse)
        grad = scratch.empty((n, v_local), dtype=logits.dtype, device=logits.device)
        for r0, r1, rows in chunks(n, p.chunk_size):
            z, slope = _scaled_chunk(logits, r0, r1, rows, v_real, p, slope=True)
            dz = d_logits_(
                z,
                padded_rows(lse, r0, r1, rows),
                None if mean_z is None else padded_rows(mean_z, r0, r1, rows),
                padded_rows(t_local, r0, r1, rows),
                padded_rows(in_shard, r0, r1, rows, False),
                *(
                    None if g is None else padded_rows(g, r0, r1, rows)
                    for g in (g_lp, g_ent, g_lse)
                ),
                masked=True,
            )
            if p.temperature != 1.0:
                dz.mul_(p.inv_temperature)
            if slope is not None:  # d logits = d z / T * (1 - tanh^2)
                dz.mul_(slope)
            dz.masked_fill_(padded_rows(ignored, r0, r1, rows, False)[:, None], 0.0)
            grad[r0:r1, :v_real] = dz[: r1 - r0]
            if v_real < v_local:
                grad[r0:r1, v_real:] = 0.0
        return grad, None, None


@eager_under_compile
def vocab_parallel_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_lse: bool = False,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
    deterministic: bool = False,
    deterministic_tile: int = DETERMINISTIC_TILE,
) -> LogProbOutput:
    """Log-probabilities of ``targets`` from (vocabulary-sharded) logits, in fp32.

    Same semantics as :func:`lp_kernels.linear_logprob` with ``z = logits / T``.
    Logits may be masked to ``-inf`` (top-k / top-p): masked entries have probability 0
    and every output and gradient stays exact and finite; a masked target has logprob
    ``-inf`` (with a finite gradient); a row with every entry ``-inf`` gives NaN.
    Works chunk by chunk in fp32 whatever the logits dtype; the backward writes
    each chunk's gradient into one preallocated buffer (the returned gradient).
    Under ``torch.compile`` it runs eagerly behind a graph break (same bits as eager);
    ``torch.autocast`` changes nothing (the logits are taken in their own dtype).

    Args:
        logits: ``[*, V_local]`` float32, bfloat16 or float16: the whole vocabulary,
            or this rank's contiguous shard under ``tp_group``.
        targets: ``[*]`` int64 (or int32) global token ids, the leading shape of
            ``logits``; ``ignore_index`` rows give 0 and no gradient.
        temperature: logits are divided by it (> 0).
        softcap: None, or a cap ``c > 0``: ``z = c * tanh(logits / c) / temperature`` (the
            cap on the raw logits, then the temperature), in fp32; ``-inf`` (masked)
            logits stay ``-inf``.
        ignore_index: target value of rows to skip (any int64; a real token id too:
            those rows are then ignored, e.g. a pad token masked by its id).
        return_entropy: also return the entropy per row (differentiable).
        return_lse: also return the log-sum-exp per row (differentiable).
        tp_group: the group the vocabulary is sharded over (every rank passes the
            same targets); every rank returns the same outputs.
        vocab_start: global id of this rank's first column; default 0, or
            ``rank * V_local`` under ``tp_group`` (even shards only).
        vocab_size: the real global vocabulary; columns ``>= vocab_size`` are
            padding, excluded from the softmax, and get zero gradient.
        chunk_size: token rows per step (at least 16 are used; fewer N use N rounded
            up to a power of two); None = a default
            from the shard width (with ``deterministic``: from the width of its groups
            of tiles, the same on every layout) and device, never from N.
        validate: check target ids (one host sync), and under a ``tp_group`` of several
            ranks exchange one record of the call so that disagreeing ranks all raise
            (see :func:`lp_kernels.linear_logprob`); False = no host sync, no exchange.
        deterministic: tensor-parallel invariance: outputs and the logits gradient are
            bitwise identical for any TP degree and any layout whose shard bounds are
            multiples of 128 (else ``ValueError`` on every rank): partials of each
            global 128-column tile are merged in global tile order.
        deterministic_tile: the width of those tiles (a multiple of 128; unused
            otherwise), as in :func:`lp_kernels.linear_logprob`.

    Returns:
        ``LogProbOutput(logprob, entropy, lse)``, each ``[*]`` float32.

    Example:
        >>> import torch
        >>> from lp_kernels import vocab_parallel_logprob
        >>> logits = torch.randn(3, 5, 100, requires_grad=True)
        >>> out = vocab_parallel_logprob(logits, torch.randint(0, 100, (3, 5)))
        >>> out.logprob.sum().backward()
        >>> logits.grad.shape
        torch.Size([3, 5, 100])
    """
    prep = prepare(
        logits,
        None,
        targets,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        return_lse=return_lse,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        deterministic=deterministic,
        deterministic_tile=deterministic_tile,
        chunk_size=chunk_size,
        validate=validate,
    )
    # fp32 math whatever the logits dtype, autocast or not (log_softmax is fp32 there too)
    with _amp.autocast_off(prep.inputs.device):
        out = VocabParallelLogprob.apply(prep.inputs, prep.targets, prep.params)
    return shaped(out, prep.lead)
