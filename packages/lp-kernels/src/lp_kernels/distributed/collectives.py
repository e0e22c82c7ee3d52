"""The collectives of lp's ops; each returns early for one rank.

Forward: one all-gather of per-row statistics (:func:`gather_stats`: bytes only, merged in
rank order by ``_stats.merge_stats``). Backward: one all-reduce (sum) of the fp32
``grad_hidden`` partials unless the caller reduces them itself, started per token block as
soon as the block's rows are final (the triton backend: in its last vocabulary chunk; the
torch backend: per chunk), asynchronously, so that it runs beside the GEMMs that follow
(:class:`RowSums`). ``deterministic=True`` adds one MAX all-reduce of ``max |W|``
(:func:`global_abs_max`, the fixed-point scale's bound) and, where a tile crosses a shard
bound, the point-to-point sends of :mod:`lp_kernels.distributed.halo`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_stats(stats: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """All-gather ``stats [N, k]`` from every rank into ``[P, N, k]`` (rank order)."""
    if world == 1:
        return stats.unsqueeze(0)
    out = torch.empty((world, *stats.shape), dtype=stats.dtype, device=stats.device)
    if stats.numel() > 0:
        dist.all_gather_into_tensor(out.view(-1), stats.contiguous().view(-1), group=group)
    return out


SUM_ROWS = 2048
"""Rows per block of :class:`RowSums` when the caller's own blocks may differ by rank."""


class RowSums:
    """The TP sum of ``t [N, ...]`` (grad_hidden's partials), started block by block.

    Blocks are ``block`` rows (default :data:`SUM_ROWS`), the same on every rank: every
    rank must make the same sequence of collectives, while the rows a rank finishes at a
    time may follow its own shard (the torch backend's chunk rows do). The backward calls
    :meth:`ready` once rows ``[0, r1)`` are final: each block they complete starts its
    all-reduce asynchronously (NCCL runs it on its own stream, beside the GEMMs that
    follow). :meth:`finish` sums the blocks not started, in the same blocks (a rank with
    no vocabulary chunk starts none), then waits for every one (on CUDA the current
    stream waits, not the host). The int64 sums of ``deterministic=True`` are exact
    however they are split. Inert for one rank or ``enabled=False``."""

    def __init__(self, t, group: Any, world: int, block: int | None = None, enabled=True):
        self.t, self.group = t, group
        self.block = max(1, SUM_ROWS if block is None else block)
        self.active = enabled and world > 1 and t is not None
        self.done = 0  # rows [0, done) are started
        self.works: list = []

    def _blocks(self, upto: int):
        n = self.t.shape[0]
        while self.done < n and min(self.done + self.block, n) <= upto:
            r0, self.done = self.done, min(self.done + self.block, n)
            yield self.t[r0 : self.done]

    def ready(self, r1: int) -> None:
        if self.active:
            for part in self._blocks(r1):
                work = dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                self.works.append(work)

    def finish(self) -> None:
        if not self.active:
            return
        for part in self._blocks(self.t.shape[0]):
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group)
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []


def local_abs_max(w_real: torch.Tensor) -> torch.Tensor:
    """``max |W|`` of this rank's real rows (float64 ``[1]``; NaN if one is NaN; 0 for none)."""
    if w_real.numel() > 0:  # one read of W (abs() would write a copy of it first)
        lo, hi = torch.aminmax(w_real)
        return torch.maximum(-lo.double(), hi.double()).reshape(1)
    return torch.zeros(1, dtype=torch.float64, device=w_real.device)


def global_abs_max(w_real: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``max |W|`` over every rank's real rows (float64 scalar; exact in any order)."""
    local = local_abs_max(w_real)
    if world > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return local[0]


def bias_abs_max(b_real: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``max |b|`` over every rank's real bias entries but the ``-inf`` ones (float64
    scalar): a ``-inf`` entry masks its column, whose probability is exactly 0 and which
    adds nothing to a gradient, so it does not bound a logit. A NaN or ``+inf`` entry
    stays (a non-finite head)."""
    return global_abs_max(torch.where(b_real == float("-inf"), 0.0, b_real), group, world)
