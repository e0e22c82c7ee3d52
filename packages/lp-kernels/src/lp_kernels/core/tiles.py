"""The tile width of ``deterministic=True`` (public).

``deterministic=True`` merges partials of global vocabulary tiles in global tile order and
sums ``grad_hidden`` per tile in fixed point. The tile width (``deterministic_tile``) is a
multiple of :data:`DETERMINISTIC_TILE`; the bits depend on it, never on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

DETERMINISTIC_TILE = 128
"""The alignment of ``deterministic=True``: the smallest (and the unit of every) global
vocabulary tile, and what shard bounds must be multiples of."""


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


def owned_columns(start: int, real: int, vocab_size: int, tile: int) -> tuple[int, int, int, int]:
    """``(skip, ext, halo, tiles)`` of a shard of ``real`` real columns from ``start`` (see
    :class:`TileOwnership`)."""
    first = -(-start // tile) * tile  # the first tile edge at or after the shard's start
    if real <= 0 or first >= start + real:
        return max(real, 0), 0, 0, 0
    last_end = min(((start + real - 1) // tile + 1) * tile, vocab_size)
    ext = last_end - first
    return first - start, ext, max(0, last_end - start - real), -(-ext // tile)


def tile_ownership(starts, sizes, vocab_size: int, tile: int, rank: int) -> TileOwnership:
    """:class:`TileOwnership` of ``rank`` in the layout ``(starts, sizes)``."""
    owned = [
        owned_columns(st, min(sz, vocab_size - st), vocab_size, tile)
        for st, sz in zip(starts, sizes, strict=True)
    ]
    skip, ext, halo, tiles = owned[rank]
    return TileOwnership(skip, ext, halo, tiles, max(o[3] for o in owned))
