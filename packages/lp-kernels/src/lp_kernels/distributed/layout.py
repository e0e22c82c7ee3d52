"""Shard layout: the once-per-layout check across ranks, and its cache.

Under ``tp_group`` every rank holds a contiguous vocabulary shard. The first call with a
given (group, local layout) all-gathers a small int64 record from every rank (shard size,
start, vocab_size, H, dtype, flags) and checks the whole table on every rank with the same
code, so a bad layout raises the same ``ValueError`` on every rank and no rank is left
waiting. The resolved layout is cached per group; later calls with the same local layout
spend no collective and no host sync. Caveat: the cache is per rank, so with
``validate=False`` a layout that changes on some ranks but not on others is not
re-checked in lockstep; change layouts on every rank together (Megatron never changes
them). With ``validate=True`` the per-call record (:mod:`lp_kernels.distributed.contract`)
carries the layout key and :func:`check_table` checks it on every call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lp_kernels.core.tiles import DETERMINISTIC_TILE

WEIGHT_PROBLEMS = {
    1: "its dtype is not float32, bfloat16 or float16",
    3: "it is on a different device than hidden",
    4: "its hidden size (dim 1) differs from hidden's last dimension",
    5: "its bias must be 1-D [V_local], one entry per weight row",
    6: "its bias must be float32, bfloat16 or float16, on weight's device",
}
"""Codes of a rank's weight (and bias) problems; under tp_group they travel in the layout
record so that every rank raises, not just the one with the bad shard."""
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_NAMES = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
_UNSET = -1
# Fields of the per-rank record, in order.
LAYOUT_FIELDS = (
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


def layout_key(
    *,
    v_local: int,
    vocab_start: int | None,
    vocab_size: int | None,
    hidden: int,
    dtype: torch.dtype,
    deterministic: bool,
    tile: int,
    problem: int = 0,
    align: int | None = None,
) -> tuple[int, ...]:
    """This rank's layout record (the fields of :data:`LAYOUT_FIELDS`), as int64 values."""
    return (
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


def cache_layout(group: Any, key: tuple[int, ...], layout: ShardLayout) -> None:
    """Remember ``layout`` as the validated layout of ``group`` for the local ``key``
    (the per-call record checks the layout itself; later ``validate=False`` calls reuse it)."""
    _CACHE.put(group, key, layout)


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
    """This rank's view of the validated layout.

    Without a group the layout is one shard ``[0, v_local)``. Under a group it is checked
    across ranks on first use (one all-gather of :func:`layout_key`) and cached. With
    ``deterministic``, shard bounds must be multiples of ``align`` (default: the tile;
    ``linear_logprob`` passes 128, its ranks lend each other the rows of tiles that cross a
    bound, see :func:`tile_ownership`).

    Raises:
        ValueError: on every rank, naming the offending rank and field, when shards
            are not contiguous, overlap, disagree on vocab_size / H / dtype / flags,
            or when uneven shards lack an explicit ``vocab_start``.
    """
    if group is None:
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
    key = layout_key(
        v_local=v_local,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        hidden=hidden,
        dtype=dtype,
        deterministic=deterministic,
        tile=tile,
        problem=problem,
        align=align,
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
    layout = check_table(rows, rank)
    _CACHE.put(group, key, layout)
    return layout


def check_table(rows: list[tuple[int, ...]], rank: int) -> ShardLayout:
    """Validate the gathered per-rank records; every rank runs this on the same rows."""
    recs = [dict(zip(LAYOUT_FIELDS, r, strict=True)) for r in rows]
    _check_records(recs)
    _check_agreement(recs)
    starts, sizes = _shard_starts(recs)
    total = starts[-1] + sizes[-1]
    vocab_size = recs[0]["vocab_size"]
    if vocab_size == _UNSET:
        vocab_size = total
    if not 1 <= vocab_size <= total:
        raise ValueError(
            f"vocab_size must be in [1, {total}] (the shards cover {total} ids), got {vocab_size}"
        )
    if recs[0]["deterministic"]:
        _check_alignment(starts, sizes, recs[0]["tile"], recs[0]["align"])
    return ShardLayout(starts=starts, sizes=sizes, vocab_size=vocab_size, rank=rank)


def _check_records(recs: list[dict]) -> None:
    """Each rank's own record: a weight that fits, at least one row, a supported dtype."""
    for r, rec in enumerate(recs):
        if rec["problem"]:
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


def _check_agreement(recs: list[dict]) -> None:
    """The fields every rank must pass alike."""
    for field, what in (
        ("hidden", "hidden size H"),
        ("dtype", "dtype"),
        ("deterministic", "deterministic flag"),
        ("tile", "tile size"),
        ("align", "shard alignment (linear_logprob against vocab_parallel_logprob)"),
        ("vocab_size", "vocab_size"),
    ):
        if len({r[field] for r in recs}) == 1:
            continue
        if field == "dtype":
            diff = ", ".join(
                f"rank {i}: {_DTYPE_NAMES.get(r['dtype'], '?')}" for i, r in enumerate(recs)
            )
        else:
            diff = ", ".join(f"rank {i}: {r[field]}" for i, r in enumerate(recs))
        raise ValueError(f"tensor-parallel ranks disagree on the {what}: {diff}")


def _shard_starts(recs: list[dict]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(starts, sizes)`` of the shards: the given starts, contiguous in rank order from 0,
    or, where no rank gives one, even shards."""
    given = [r["vocab_start"] != _UNSET for r in recs]
    sizes = tuple(r["v_local"] for r in recs)
    if not any(given):
        if len(set(sizes)) != 1:
            raise ValueError(
                "uneven vocabulary shards need an explicit vocab_start on every rank "
                f"(shard sizes: {list(sizes)})"
            )
        return tuple(i * sizes[0] for i in range(len(recs))), sizes
    if not all(given):
        missing = [i for i, g in enumerate(given) if not g]
        raise ValueError(
            f"vocab_start must be given on every rank or on none; missing on {missing}"
        )
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
    return starts, sizes


def _check_alignment(starts, sizes, tile: int, align: int) -> None:
    """``deterministic=True``: every shard bound (but the vocabulary's end) on a multiple of
    ``align``."""
    world = len(starts)
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
