"""``deterministic=True`` of ``linear_logprob``: which rank computes which global tile,
and the point-to-point exchange of the rows of tiles that cross a shard bound.

A rank owns the global ``deterministic_tile``-column tiles that start in its shard
(:class:`TileOwnership`). Where a tile crosses the shard's end, the next ranks send it
the weight rows it lacks (:func:`exchange_halo`, once per forward) and, with one tile per
backward chunk, it sends their grad_weight rows back (:func:`return_halo_grad`).
Point-to-point sends only; every rank derives the same plan from the layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lp_kernels.core.tiles import TileOwnership, owned_columns
from lp_kernels.core.types import LogprobParams


def _halo_plan(p: LogprobParams):
    """``(lo, hi, sends, recvs)`` of :func:`exchange_halo`: this rank's halo is the global
    rows ``[lo, hi)``; ``sends`` lists ``(peer, a, b)``: rows ``[a, b)`` of this shard that
    ``peer``'s halo takes; ``recvs`` lists ``(peer, a, b)``: rows ``[a, b)`` of this rank's
    halo, held by ``peer``. Every rank derives the same plan from the layout."""
    starts, sizes, vocab_size = p.shard_starts, p.shard_sizes, p.vocab_size
    tile, rank = p.deterministic_tile, p.tp_rank
    reals = [max(0, min(sz, vocab_size - st)) for st, sz in zip(starts, sizes, strict=True)]
    need = []  # per rank: the global rows [lo, hi) of its halo
    for r, st in enumerate(starts):
        halo = owned_columns(st, reals[r], vocab_size, tile)[2]
        need.append((st + reals[r], st + reals[r] + halo))
    lo, hi = need[rank]
    mine = starts[rank]
    sends, recvs = [], []
    for r, (r_lo, r_hi) in enumerate(need):  # what this rank lends to r
        a, b = max(r_lo, mine), min(r_hi, mine + reals[rank])
        if r != rank and a < b:
            sends.append((r, a - mine, b - mine))
    for q, st in enumerate(starts):  # what this rank's halo takes from q
        a, b = max(lo, st), min(hi, st + reals[q])
        if q != rank and a < b:
            recvs.append((q, a - lo, b - lo))
    return lo, hi, sends, recvs


def _p2p(ops: list, group: Any) -> None:
    """Run ``[(dist.isend or dist.irecv, tensor, peer)]`` as one batch and wait for it
    (ranks with nothing to send or receive take no part)."""
    if ops:
        batch = [dist.P2POp(op, t, group=group, group_peer=peer) for op, t, peer in ops]
        for work in dist.batch_isend_irecv(batch):
            work.wait()


def exchange_halo(w_real: torch.Tensor, p: LogprobParams) -> torch.Tensor:
    """This rank's halo (``[halo, H]`` weight rows, see :class:`TileOwnership`), received
    from the ranks after it, while sending theirs the rows of ``w_real`` (this shard's real
    rows) that their halos need. Point-to-point sends only."""
    lo, hi, sends, recvs = _halo_plan(p)
    out = torch.empty((hi - lo, w_real.shape[1]), dtype=w_real.dtype, device=w_real.device)
    ops = [(dist.isend, w_real[a:b].contiguous(), r) for r, a, b in sends]
    _p2p(ops + [(dist.irecv, out[a:b], q) for q, a, b in recvs], p.tp_group)
    return out


def return_halo_grad(grad_halo: torch.Tensor, grad_w: torch.Tensor, p: LogprobParams) -> None:
    """:func:`exchange_halo` backwards: the weight-gradient rows of this rank's halo
    (``grad_halo [halo, H]``, computed with its owned tiles) go to the ranks that hold
    those rows, and the rows of this shard that other ranks' halos took (its head
    columns) arrive in ``grad_w``."""
    _, _, sends, recvs = _halo_plan(p)
    ops = [(dist.isend, grad_halo[a:b].contiguous(), q) for q, a, b in recvs]
    _p2p(ops + [(dist.irecv, grad_w[a:b], r) for r, a, b in sends], p.tp_group)


def return_halo_bias_grad(acc_b: torch.Tensor, v_real: int, p: LogprobParams) -> torch.Tensor:
    """grad_bias' fp32 sums over this shard's ``v_real`` real columns, from ``acc_b``'s sums
    over those columns and the halo (``[v_real + halo]``): the halo's entries go to their
    shards and the head's arrive, as grad_weight's rows do (:func:`return_halo_grad`)."""
    head = acc_b[:v_real].clone()
    return_halo_grad(acc_b[v_real:, None], head[:, None], p)
    return head


def owned_halo(w_real: torch.Tensor, p: LogprobParams) -> tuple[TileOwnership, torch.Tensor]:
    """``(ownership, halo)`` of ``linear_logprob(deterministic=True)``: this rank's
    :class:`TileOwnership` and its halo rows (``[halo, H]``, maybe empty), exchanged with
    the other ranks of ``p.tp_group`` (every rank calls this in the same step)."""
    own = p.tile_ownership()
    if p.tp_size == 1:
        return own, w_real[:0]
    halo = exchange_halo(w_real, p)
    return own, halo


def bias_halo(bias: torch.Tensor | None, v_real: int, p: LogprobParams):
    """``(b_real, halo)``: the shard's real bias entries in fp32 and those of its halo (the
    next shards' entries that its crossing tile needs), exchanged as the weight's halo is
    (every rank of the group passes a bias, or none does); ``(None, None)`` without bias."""
    if bias is None:
        return None, None
    b_real = bias[:v_real].float()
    if p.tp_size == 1:
        return b_real, b_real[:0]
    halo = exchange_halo(b_real[:, None], p)
    return b_real, halo[:, 0]


def with_halo(w_real: torch.Tensor, halo: torch.Tensor, start: int = 0) -> torch.Tensor:
    """This shard's real weight rows from row ``start``, followed by its halo rows: a
    view without a halo, else a copy of ``v_real - start + halo`` rows (callers that
    need only the columns that run into the halo pass where those begin)."""
    return torch.cat([w_real[start:], halo]) if halo.shape[0] else w_real[start:]
