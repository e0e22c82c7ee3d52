"""The tile width of ``deterministic=True`` (public).

``deterministic=True`` merges partials of global vocabulary tiles in global tile order and
sums ``grad_hidden`` per tile in fixed point. The tile width (``deterministic_tile``) is a
multiple of :data:`DETERMINISTIC_TILE`; the bits depend on it, never on the layout.
"""

from __future__ import annotations

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
