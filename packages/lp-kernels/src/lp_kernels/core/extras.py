"""Per-row extra statistics (``extras=``): collision log-probability, mean logit, top-1 hit.

Computed without gradient, on the same transformed logits ``z`` whose softmax gives the
log-probs, over the real vocabulary. Data flow for one row, in the partials' vocabulary
(splits, tiles, shards)::

    partial k:  x_k = max z                 (its own maximum: exact in any order)
                q_k = sum e^(2 (z - x_k))   (rescaled online, as s is)
                u_k = sum z
                i_k = the first column (global id) where z = x_k
                    |  gathered like the softmax partials (rank order; global tile
                    v  order with ``deterministic=True``)
    merge in order:  X = max_k x_k,  Q = sum_k e^(2 (x_k - X)) q_k,  U = sum_k u_k
                     I = min { i_k : x_k = X }          (lowest global id on ties)
    outputs:  log_sum_sq_probs = log Q - 2 (lse - X)    (log sum p^2; lse - X = log S)
              mean_logit       = U / V                  (V = vocab_size)
              is_top1          = I == target

``log_sum_sq_probs`` takes every exponent relative to the maximum, as the log-sum-exp
does, so a peaked row (``Q ~ 1``, ``lse ~ X``) and a flat one (``Q ~ V``) keep full
accuracy. The merge adds the partials one by one in their order: an empty partial
(``x = -inf, q = u = 0``, no column) adds exact zeros, so the deterministic mode's
gathered sequence, with empty partials after each rank's owned tiles, merges to the same
bits on every layout (the rule the softmax partials follow). Ignored rows give 0, 0 and
False; rows whose log-sum-exp is not finite NaN, NaN and False (``stats.masked_outputs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lp_kernels.core.stats import ignored_rows
from lp_kernels.core.types import LogprobParams

EXTRAS: tuple[str, ...] = ("log_sum_sq_probs", "mean_logit", "is_top1")
"""The names ``extras=`` accepts, in the order the outputs hold them."""
N_EXTRA = 3
"""fp32 values of an extras partial per row: x (max z), q (sum e^(2 (z - x))), u (sum z)."""
NO_COLUMN = 2**62
"""An empty partial's column: above every vocabulary id, so a minimum never picks it."""


def check_extras(extras: Any) -> tuple[str, ...]:
    """``extras`` as a tuple of names in :data:`EXTRAS` order (``TypeError`` / ``ValueError``
    naming ``extras`` and the accepted names)."""
    accepted = ", ".join(repr(name) for name in EXTRAS)
    if isinstance(extras, str | bytes) or not isinstance(extras, Sequence):
        raise TypeError(
            f"extras must be a sequence of names (any of {accepted}), "
            f"got {type(extras).__name__}"
        )
    for name in extras:
        if not isinstance(name, str):
            raise TypeError(
                f"extras must hold str names (any of {accepted}), got {type(name).__name__}"
            )
        if name not in EXTRAS:
            raise ValueError(f"extras: unknown name {name!r}; the accepted names are {accepted}")
    if len(set(extras)) != len(extras):
        raise ValueError(f"extras names a statistic twice ({list(extras)}); accepted: {accepted}")
    return tuple(name for name in EXTRAS if name in extras)


def empty_partials(shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [*shape, 3], i [*shape])`` filled with the empty partial."""
    x = torch.zeros((*shape, N_EXTRA), dtype=torch.float32, device=device)
    x[..., 0] = float("-inf")
    return x, torch.full(shape, NO_COLUMN, dtype=torch.int64, device=device)


def extra_terms(
    z: torch.Tensor, first_id: int | torch.Tensor, real: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [..., 3], i [...])``: the extras partial of each row of fp32 ``z [..., W]`` over
    its last dimension, whose column 0 is vocabulary id ``first_id`` (a tensor broadcast to
    ``z``'s leading shape, or an int). ``real``: None, or a bool mask broadcast to ``z`` of
    the real columns (the others take no part)."""
    lead = z.shape[:-1]
    if z.shape[-1] == 0:
        return empty_partials(lead, z.device)
    z_max, z_sum = z, z
    if real is not None:
        z_max = torch.where(real, z, float("-inf"))
        z_sum = torch.where(real, z, 0.0)
    x_max = z_max.amax(dim=-1)
    top = z_max.argmax(dim=-1)  # the first maximal column
    empty = x_max == float("-inf")
    shift = torch.where(empty, 0.0, x_max)  # a row all -inf here: e^(-inf) = 0, not NaN
    sq = torch.exp((z_max - shift.unsqueeze(-1)).mul_(2.0)).sum(dim=-1)
    out = torch.stack([x_max, sq, z_sum.sum(dim=-1)], dim=-1)
    return out, torch.where(empty, NO_COLUMN, top + first_id)


def merge_extras(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``x [K, N, 3]``, ``i [K, N]`` partials one by one in order -> ``[N, 3]``, ``[N]``
    (see the module docstring); K = 0 gives the empty partial."""
    k, n = i.shape
    if k == 0:
        return empty_partials((n,), x.device)
    big = x[..., 0].amax(dim=0)
    base = torch.where(big == float("-inf"), 0.0, big)
    sq = torch.zeros(n, dtype=torch.float32, device=x.device)
    total = torch.zeros(n, dtype=torch.float32, device=x.device)
    for j in range(k):
        sq = sq + torch.exp(2.0 * (x[j, :, 0] - base)) * x[j, :, 1]
        total = total + x[j, :, 2]
    top = torch.where(x[..., 0] == big, i, NO_COLUMN).amin(dim=0)
    return torch.stack([big, sq, total], dim=-1), top


def merge_extra_runs(x: torch.Tensor, i: torch.Tensor, run: int):
    """``[K, N, 3]``, ``[K, N]`` partials -> ``[cdiv(K, run), ...]``: each run of ``run``
    consecutive partials merged into one, in order (a rank's splits, or a tile's)."""
    k = i.shape[0]
    parts = [merge_extras(x[j : j + run], i[j : j + run]) for j in range(0, k, run)]
    if not parts:
        return x[:0], i[:0]
    return torch.stack([a for a, _ in parts]), torch.stack([b for _, b in parts])


def extra_outputs(
    x: torch.Tensor, i: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, p: LogprobParams
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(log_sum_sq_probs, mean_logit, is_top1)`` of merged extras ``x [N, 3]``, ``i [N]``
    and the raw log-sum-exp ``lse [N]``, each None unless ``p.extras`` names it; masked as
    the other outputs are (ignored rows 0 / False, rows with a non-finite lse NaN / False)."""
    names, ignore_index, vocab_size = p.extras, p.ignore_index, p.vocab_size
    ignored = ignored_rows(targets, ignore_index)
    bad = ~torch.isfinite(lse)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=lse.device)

    def masked(v: torch.Tensor) -> torch.Tensor:
        return torch.where(ignored, 0.0, torch.where(bad, nan, v))

    out: dict[str, torch.Tensor] = {}
    if "log_sum_sq_probs" in names:
        out["log_sum_sq_probs"] = masked(torch.log(x[:, 1]) - 2.0 * (lse - x[:, 0]))
    if "mean_logit" in names:
        out["mean_logit"] = masked(x[:, 2] / float(vocab_size))
    if "is_top1" in names:
        out["is_top1"] = (i == targets.long()) & ~ignored & ~bad
    return tuple(out.get(name) for name in EXTRAS)


NO_EXTRAS: tuple[None, None, None] = (None, None, None)
"""The extras outputs of a call that asks for none."""


class ExtraRows:
    """One rank's extras partial of every row, filled chunk by chunk of rows (the default
    paths of the torch backend: one partial per row and rank)."""

    def __init__(self, n: int, device) -> None:
        self.x, self.i = empty_partials((n,), device)

    def add(self, r0: int, r1: int, z: torch.Tensor, first_id: int) -> None:
        """Rows ``[r0, r1)`` from their transformed logits ``z [rows >= r1 - r0, W]`` (real
        columns, column 0 is id ``first_id``), before anything overwrites ``z``."""
        x, i = extra_terms(z, first_id)
        self.x[r0:r1] = x[: r1 - r0]
        self.i[r0:r1] = i[: r1 - r0]


def mark_extras(ctx: Any, outputs: tuple) -> None:
    """Mark an autograd Function's extras outputs (``outputs[3:]``) non-differentiable."""
    marked = [x for x in outputs[3:] if x is not None]
    if marked:
        ctx.mark_non_differentiable(*marked)
