"""Tensor-parallel plumbing: the once-per-layout check and the two collectives.

Layout check. Under ``tp_group`` every rank holds a contiguous vocabulary shard.
The first call with a given (group, local layout) all-gathers a small int64 record
from every rank (shard size, start, vocab_size, H, dtype, flags) and checks the
whole table on every rank with the same code, so a bad layout raises the same
``ValueError`` on every rank and no rank is left waiting. The resolved layout is
cached per group; later calls with the same local layout spend no collective and
no host sync. Caveat: the cache is per rank, so a layout that changes on some
ranks but not on others is not re-checked in lockstep; change layouts on every
rank together (Megatron never changes them).

Collectives. Forward: one all-gather of per-row statistics (bytes only, merged in
rank order by ``_stats.merge_stats``). Backward: one all-reduce (sum) of the fp32
``grad_hidden`` partials unless the caller reduces them itself, started per token block
as soon as the block's rows are final (the triton backend: in its last vocabulary chunk;
the torch backend: per chunk), asynchronously, so that it runs beside the GEMMs that
follow (:class:`RowSums`). ``deterministic=True``
of ``linear_logprob`` adds, where a tile crosses a shard bound, point-to-point sends of
the weight rows the tile's owner lacks (:func:`exchange_halo`, once per forward) and, with
one tile per backward piece, of their grad_weight rows back (:func:`return_halo_grad`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_NAMES = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
_UNSET = -1
# deterministic=True: the default (and the smallest) global vocabulary tile whose partials
# are merged in order; ``deterministic_tile`` may take any multiple of it.
DETERMINISTIC_TILE = 128
# Fields of the per-rank record, in order.
_FIELDS = (
    "v_local",
    "vocab_start",
    "vocab_size",
    "hidden",
    "dtype",
    "deterministic",
    "tile",
    "align",
    "problem",
)


def deterministic_tile_for(vocab_size: int, max_tp: int) -> int:
    """The widest ``deterministic_tile`` that serves every TP degree dividing ``max_tp``.

    Pad the vocabulary to ``V_pad``, a multiple of ``128 * max_tp``, and keep that padding
    at every degree (Megatron: ``make_vocab_size_divisible_by = 128 * max_tp // TP``). Then
    every degree's even shards fall on multiples of ``V_pad / max_tp``, which this returns,
    so ``deterministic=True`` gives the same bits at each of those degrees, at far less
    cost than 128-column tiles (docs/design.md).

    Example:
        >>> deterministic_tile_for(151936, 8)  # V_pad = 152576 = 8 x 19072
        19072
    """
    for name, val in (("vocab_size", vocab_size), ("max_tp", max_tp)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    unit = DETERMINISTIC_TILE * max_tp
    return -(-vocab_size // unit) * DETERMINISTIC_TILE


def default_deterministic_tile(vocab_size: int) -> int:
    """``linear_logprob``'s ``deterministic_tile`` when none is given:
    ``deterministic_tile_for(vocab_size, 8)``, the vocabulary padded to a multiple of 1024
    and cut in eight (19072 for 151936 ids). A function of the global vocabulary alone, so
    every layout and TP degree of one model computes the same tiles; layouts whose bounds
    are off its grid lend rows across bounds (:func:`tile_ownership`). Megatron's shards at
    TP 8 (and at any degree when the vocabulary is padded for TP 8) lie on its grid."""
    return deterministic_tile_for(vocab_size, 8)


@dataclass(frozen=True)
class ShardLayout:
    """The validated global layout, identical on every rank."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    vocab_size: int
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def start(self) -> int:
        """Global id of this rank's first row."""
        return self.starts[self.rank]

    def real_columns(self, rank: int) -> int:
        """How many of ``rank``'s rows are real vocabulary (below ``vocab_size``)."""
        return max(0, min(self.sizes[rank], self.vocab_size - self.starts[rank]))


class _LayoutCache:
    """Validated layouts keyed by (group, local record). Holds groups weakly where it can."""

    def __init__(self) -> None:
        self._by_ref: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], ShardLayout]] = (
            weakref.WeakKeyDictionary()
        )
        self._by_id: dict[tuple[int, tuple[int, ...]], ShardLayout] = {}

    def get(self, group: Any, key: tuple[int, ...]) -> ShardLayout | None:
        try:
            return self._by_ref.get(group, {}).get(key)
        except TypeError:  # group type without weakref support
            return self._by_id.get((id(group), key))

    def put(self, group: Any, key: tuple[int, ...], layout: ShardLayout) -> None:
        try:
            self._by_ref.setdefault(group, {})[key] = layout
        except TypeError:
            self._by_id[(id(group), key)] = layout

    def clear(self) -> None:
        self._by_ref.clear()
        self._by_id.clear()


_CACHE = _LayoutCache()


def clear_layout_cache() -> None:
    """Forget every validated layout (the next call per group validates again)."""
    _CACHE.clear()


def resolve_layout(
    group: Any,
    *,
    v_local: int,
    vocab_start: int | None,
    vocab_size: int | None,
    hidden: int,
    dtype: torch.dtype,
    deterministic: bool,
    tile: int,
    device: torch.device,
    problem: int = 0,
    align: int | None = None,
) -> ShardLayout:
    """Return the validated layout of ``group``, checking it across ranks on first use.

    With ``deterministic``, shard bounds must be multiples of ``align`` (default: the
    tile; ``linear_logprob`` passes 128, its ranks lend each other the rows of tiles that
    cross a bound, see :func:`tile_ownership`).

    Raises:
        ValueError: on every rank, naming the offending rank and field, when shards
            are not contiguous, overlap, disagree on vocab_size / H / dtype / flags,
            or when uneven shards lack an explicit ``vocab_start``.
    """
    key = (
        v_local,
        _UNSET if vocab_start is None else vocab_start,
        _UNSET if vocab_size is None else vocab_size,
        hidden,
        _DTYPE_CODES.get(dtype, 0),
        int(deterministic),
        tile,
        tile if align is None else align,
        problem,
    )
    cached = _CACHE.get(group, key)
    if cached is not None:
        return cached
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor(key, dtype=torch.int64, device=device)
    table = torch.empty(world * len(key), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, mine, group=group)
    rows = [tuple(r) for r in table.view(world, len(key)).tolist()]
    layout = _check_table(rows, rank)
    _CACHE.put(group, key, layout)
    return layout


def resolve_vocab(
    group: Any,
    *,
    v_local: int,
    vocab_start: int | None,
    vocab_size: int | None,
    hidden: int,
    dtype: torch.dtype,
    deterministic: bool,
    device: torch.device,
    problem: int = 0,
    tile: int = DETERMINISTIC_TILE,
    align: int | None = None,
) -> ShardLayout:
    """This rank's view of the validated layout (checked across ranks under a group).

    Without a group the layout is one shard ``[0, v_local)``.
    """
    if group is not None:
        return resolve_layout(
            group,
            v_local=v_local,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            hidden=hidden,
            dtype=dtype,
            deterministic=deterministic,
            tile=tile,
            device=device,
            problem=problem,
            align=align,
        )
    if v_local == 0:
        raise ValueError("the vocabulary dimension is empty (V_local = 0)")
    if vocab_size is None:
        vocab_size = v_local
    elif vocab_size > v_local:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the {v_local} vocabulary entries given "
            "(without tp_group they are the whole vocabulary)"
        )
    return ShardLayout(starts=(0,), sizes=(v_local,), vocab_size=vocab_size, rank=0)


def _check_table(rows: list[tuple[int, ...]], rank: int) -> ShardLayout:
    """Validate the gathered per-rank records; every rank runs this on the same rows."""
    recs = [dict(zip(_FIELDS, r, strict=True)) for r in rows]
    world = len(recs)

    def first_disagreement(field: str) -> str | None:
        vals = [r[field] for r in recs]
        if len(set(vals)) == 1:
            return None
        return ", ".join(f"rank {i}: {v}" for i, v in enumerate(vals))

    for r, rec in enumerate(recs):
        if rec["problem"]:
            from lp_kernels._checks import WEIGHT_PROBLEMS

            raise ValueError(
                f"the weight shard of rank {r} does not fit hidden: "
                f"{WEIGHT_PROBLEMS[rec['problem']]}"
            )
        if rec["v_local"] <= 0:
            raise ValueError(
                f"weight shard of rank {r} is empty (V_local = {rec['v_local']}); "
                "every rank of tp_group needs at least one vocabulary row"
            )
        if rec["dtype"] == 0:
            raise ValueError(f"rank {r} passed an unsupported dtype")
    for field, what in (
        ("hidden", "hidden size H"),
        ("dtype", "dtype"),
        ("deterministic", "deterministic flag"),
        ("tile", "tile size"),
        ("align", "shard alignment (linear_logprob against vocab_parallel_logprob)"),
        ("vocab_size", "vocab_size"),
    ):
        diff = first_disagreement(field)
        if diff is not None:
            if field == "dtype":
                diff = ", ".join(
                    f"rank {i}: {_DTYPE_NAMES.get(r['dtype'], '?')}" for i, r in enumerate(recs)
                )
            raise ValueError(f"tensor-parallel ranks disagree on the {what}: {diff}")

    given = [r["vocab_start"] != _UNSET for r in recs]
    sizes = tuple(r["v_local"] for r in recs)
    if not any(given):
        if len(set(sizes)) != 1:
            raise ValueError(
                "uneven vocabulary shards need an explicit vocab_start on every rank "
                f"(shard sizes: {list(sizes)})"
            )
        starts = tuple(i * sizes[0] for i in range(world))
    elif not all(given):
        missing = [i for i, g in enumerate(given) if not g]
        raise ValueError(
            f"vocab_start must be given on every rank or on none; missing on {missing}"
        )
    else:
        starts = tuple(r["vocab_start"] for r in recs)
        expected = 0
        for i, (st, sz) in enumerate(zip(starts, sizes, strict=True)):
            if st != expected:
                raise ValueError(
                    f"vocabulary shards must be contiguous in rank order starting at 0: rank {i} "
                    f"starts at {st}, expected {expected} (starts {list(starts)}, "
                    f"sizes {list(sizes)})"
                )
            expected = st + sz
    total = starts[-1] + sizes[-1]
    vocab_size = recs[0]["vocab_size"]
    if vocab_size == _UNSET:
        vocab_size = total
    if not 1 <= vocab_size <= total:
        raise ValueError(
            f"vocab_size must be in [1, {total}] (the shards cover {total} ids), got {vocab_size}"
        )
    if recs[0]["deterministic"]:
        tile, align = recs[0]["tile"], recs[0]["align"]
        for i, (st, sz) in enumerate(zip(starts, sizes, strict=True)):
            end_ok = i == world - 1 or (st + sz) % align == 0
            if st % align or not end_ok:
                hint = (
                    "Megatron pads the vocabulary so"
                    if align == DETERMINISTIC_TILE
                    else f"deterministic_tile={tile} here; linear_logprob takes any "
                    f"multiple of {DETERMINISTIC_TILE}"
                )
                raise ValueError(
                    f"deterministic=True needs shard bounds on multiples of {align} "
                    f"({hint}): rank {i} holds [{st}, {st + sz})"
                )
    return ShardLayout(starts=starts, sizes=sizes, vocab_size=vocab_size, rank=rank)


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


@dataclass(frozen=True)
class TileOwnership:
    """Which global ``deterministic_tile``-column tiles one rank computes, and what it
    needs from the ranks after it (``deterministic=True`` of ``linear_logprob``).

    Tiles lie on a global grid from column 0 (the last one cut by ``vocab_size``). A rank
    computes every tile that *starts* in its shard, whole: the tiles partition the
    vocabulary in rank order, whatever the layout, and each tile's numbers come from one
    computation over all of its columns. A tile that runs past the shard's end needs the
    weight rows of the next shard(s) up to its end: the *halo*, sent by their owners
    (:func:`exchange_halo`). The shard's first ``skip`` columns belong to a tile that
    starts on an earlier rank: this rank computes them only for its own grad_weight rows.
    """

    skip: int
    """Columns at the shard's start that belong to an earlier rank's tile."""
    ext: int
    """Columns of the owned tiles, from column ``skip`` of the shard (halo included)."""
    halo: int
    """Weight rows past this shard's real rows that the owned tiles need."""
    tiles: int
    """Owned tiles."""
    max_tiles: int
    """The most tiles any rank of the layout owns (sizes the exchange of tile partials)."""


def _owned(start: int, real: int, vocab_size: int, tile: int) -> tuple[int, int, int, int]:
    first = -(-start // tile) * tile  # the first tile edge at or after the shard's start
    if real <= 0 or first >= start + real:
        return max(real, 0), 0, 0, 0
    last_end = min(((start + real - 1) // tile + 1) * tile, vocab_size)
    ext = last_end - first
    return first - start, ext, max(0, last_end - start - real), -(-ext // tile)


def tile_ownership(starts, sizes, vocab_size: int, tile: int, rank: int) -> TileOwnership:
    """:class:`TileOwnership` of ``rank`` in the layout ``(starts, sizes)``."""
    owned = [
        _owned(st, min(sz, vocab_size - st), vocab_size, tile)
        for st, sz in zip(starts, sizes, strict=True)
    ]
    skip, ext, halo, tiles = owned[rank]
    return TileOwnership(skip, ext, halo, tiles, max(o[3] for o in owned))


def _halo_plan(starts, sizes, vocab_size: int, tile: int, rank: int):
    """``(lo, hi, sends, recvs)`` of :func:`exchange_halo`: this rank's halo is the global
    rows ``[lo, hi)``; ``sends`` lists ``(peer, a, b)``: rows ``[a, b)`` of this shard that
    ``peer``'s halo takes; ``recvs`` lists ``(peer, a, b)``: rows ``[a, b)`` of this rank's
    halo, held by ``peer``. Every rank derives the same plan from the layout."""
    reals = [max(0, min(sz, vocab_size - st)) for st, sz in zip(starts, sizes, strict=True)]
    need = []  # per rank: the global rows [lo, hi) of its halo
    for r, st in enumerate(starts):
        halo = _owned(st, reals[r], vocab_size, tile)[2]
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


def exchange_halo(
    w_real: torch.Tensor, starts, sizes, vocab_size: int, tile: int, rank: int, group: Any
) -> torch.Tensor:
    """This rank's halo (``[halo, H]`` weight rows, see :class:`TileOwnership`), received
    from the ranks after it, while sending theirs the rows of ``w_real`` (this shard's real
    rows) that their halos need. Point-to-point sends only."""
    lo, hi, sends, recvs = _halo_plan(starts, sizes, vocab_size, tile, rank)
    out = torch.empty((hi - lo, w_real.shape[1]), dtype=w_real.dtype, device=w_real.device)
    ops = [(dist.isend, w_real[a:b].contiguous(), r) for r, a, b in sends]
    _p2p(ops + [(dist.irecv, out[a:b], q) for q, a, b in recvs], group)
    return out


def return_halo_grad(
    grad_halo: torch.Tensor,
    grad_w: torch.Tensor,
    starts,
    sizes,
    vocab_size: int,
    tile: int,
    rank: int,
    group: Any,
) -> None:
    """:func:`exchange_halo` backwards: the weight-gradient rows of this rank's halo
    (``grad_halo [halo, H]``, computed with its owned tiles) go to the ranks that hold
    those rows, and the rows of this shard that other ranks' halos took (its head
    fragment) arrive in ``grad_w``."""
    _, _, sends, recvs = _halo_plan(starts, sizes, vocab_size, tile, rank)
    ops = [(dist.isend, grad_halo[a:b].contiguous(), q) for q, a, b in recvs]
    _p2p(ops + [(dist.irecv, grad_w[a:b], r) for r, a, b in sends], group)


def owned_halo(w_real: torch.Tensor, p) -> tuple[TileOwnership, torch.Tensor]:
    """``(ownership, halo)`` of ``linear_logprob(deterministic=True)``: this rank's
    :class:`TileOwnership` and its halo rows (``[halo, H]``, maybe empty), exchanged with
    the other ranks of ``p.tp_group`` (every rank calls this in the same step)."""
    own = p.tile_ownership()
    if p.tp_size == 1:
        return own, w_real[:0]
    halo = exchange_halo(
        w_real, p.shard_starts, p.shard_sizes, p.vocab_size, p.deterministic_tile,
        p.tp_rank, p.tp_group,
    )  # fmt: skip
    return own, halo


def owned_weight(w_real: torch.Tensor, p) -> tuple[TileOwnership, torch.Tensor]:
    """``(ownership, w_all)``: as :func:`owned_halo`, with the shard's real weight rows
    followed by its halo as one tensor (:func:`with_halo`)."""
    own, halo = owned_halo(w_real, p)
    return own, with_halo(w_real, halo)


def with_halo(w_real: torch.Tensor, halo: torch.Tensor, start: int = 0) -> torch.Tensor:
    """This shard's real weight rows from row ``start``, followed by its halo rows: a
    view without a halo, else a copy of ``v_real - start + halo`` rows (callers that
    need only the columns that run into the halo pass where those begin)."""
    return torch.cat([w_real[start:], halo]) if halo.shape[0] else w_real[start:]
