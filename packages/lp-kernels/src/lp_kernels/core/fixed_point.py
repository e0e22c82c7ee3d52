"""Exact, order-free sums of ``grad_hidden`` for ``deterministic=True`` (both backends).

``grad_hidden[n] = sum over vocabulary tiles of d l[n, tile] @ W[tile]``. Each tile's
fp32 contribution (a "leaf", computed from zero over the tile's 128 columns) is scaled
by a per-row power of two ``2^e_n``, rounded to an integer and summed in int64. Integer
addition is associative, so neither the order of the tiles nor the TP all-reduce can
change the bits; one rounding back to the input dtype happens at the end.

The exponent comes from a bound on ``|grad_hidden[n, j]|`` built only from quantities
every rank computes bit-identically, whatever the TP degree and whatever the other rows:
maxima (exact in any order) and per-row float64 arithmetic::

    sum_v |d l[n, v]| <= (|g_lse - g_lp| + |g_lp| + 2 |g_ent| zmax_n) * gain
    zmax_n = z_bound(H * max_j |h[n, j]| * max |W| + max |b|)   (>= max_v |z[n, v]|)
    |grad_hidden[n, j]| <= sum_v |d l[n, v]| * max |W|

``gain`` bounds ``|dz / dl|`` and ``z_bound`` maps a bound on ``|l|`` to one on ``|z|``
(:class:`lp_kernels.core.transform.LogitTransform`: ``1 / T``, and at most ``c / T`` under
a cap ``c``); b is the bias. ``max |W|`` is a MAX all-reduce over the group. With a
2.02x margin for roundings,
``e_n = floor(60 - log2(2.02 * bound))`` keeps every partial sum below ``2^60`` (int64
holds ``2^63``); the quantum ``2^-e_n`` is ``~bound * 2^-60``, far below fp32 resolution
of any gradient this bound is not absurdly loose for. ``e_n`` is clamped to
``[-126, 126]`` so that ``2^e_n`` is a normal fp32 number (the Triton kernel scales in
fp32, which is exact for a power of two).

Non-finite values cannot travel through integers, so they are tracked beside them: a
row whose hidden state, upstream gradients or log-sum-exp is non-finite, or every row
when the weight holds a non-finite value (``max |W|`` propagates NaN and inf), gets a
NaN grad_hidden row, never a finite wrong one. Ignored rows take no part unless the
weight is non-finite (as ``0 @ W`` would be NaN in fp32 too).
"""

from __future__ import annotations

import torch

from lp_kernels.core.types import LogprobParams

E_MIN, E_MAX = -126, 126
MARGIN = 2.02  # the bound's margin for roundings (see above)
CONVERT_ELEMENTS = 1 << 24  # float64 elements per block of the final conversion (128 MiB)


def row_exponents(
    hidden: torch.Tensor,
    w_abs: torch.Tensor,
    lse: torch.Tensor,
    ignored: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    g_lse: torch.Tensor | None,
    p: LogprobParams,
    *,
    b_abs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, bad)``: per-row exponents (float64 holding integers) and non-finite rows.

    ``w_abs``: ``max |W|`` over every rank's real rows (float64, 0-d); ``b_abs``: ``max |b|``
    likewise for a bias (it joins the logit bound), or None. Upstream gradients are fp32
    per row, zero on ignored rows, or None.
    """
    n, h_dim = hidden.shape
    dev = hidden.device
    zero = torch.zeros(n, dtype=torch.float64, device=dev)
    g_lp64 = zero if g_lp is None else g_lp.double()
    g_lse64 = zero if g_lse is None else g_lse.double()
    g_ent64 = zero if g_ent is None else g_ent.double()
    t = p.transform
    if h_dim > 0:
        h_lo, h_hi = torch.aminmax(hidden, dim=1)
        h_abs = torch.maximum(-h_lo.double(), h_hi.double())
    else:
        h_abs = zero
    head_ok = torch.isfinite(w_abs)  # a non-finite weight (or bias) entry: every row NaN
    l_abs = h_dim * h_abs * w_abs  # |l| <= H max|h| max|W| (+ max|b|)
    if b_abs is not None:
        l_abs = l_abs + b_abs
        head_ok = head_ok & torch.isfinite(b_abs)
    zmax = t.z_bound(l_abs)
    ent_term = torch.where(g_ent64 != 0, 2 * g_ent64.abs() * zmax, 0.0)
    bound = (g_lse64 - g_lp64).abs() + g_lp64.abs() + ent_term
    bound = torch.where(bound != 0, MARGIN * bound * t.gain * w_abs, 0.0)
    bad = ~torch.isfinite(bound) | ~head_ok
    bad |= ~ignored & (~torch.isfinite(h_abs) | ~torch.isfinite(lse))
    return exponents(bound), bad


def exponents(bound: torch.Tensor) -> torch.Tensor:
    """Per-row exponents ``e_n = floor(60 - log2(bound_n))`` (float64 holding integers,
    clamped to ``[E_MIN, E_MAX]``; 0 where the bound is 0 or not finite) from a float64
    bound, margin included, on ``|grad_hidden[n, j]|``: every partial sum of the row's
    fixed-point leaves then stays below ``2^60``."""
    e = torch.where(bound > 0, torch.floor(60 - torch.log2(bound)), 0.0)
    e = torch.nan_to_num(e, nan=0.0, posinf=float(E_MAX), neginf=float(E_MIN))
    return e.clamp(E_MIN, E_MAX)


def from_fixed_point(
    acc: torch.Tensor, e: torch.Tensor, bad: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``acc [N, H]`` int64 in units of ``2^-e_n`` -> ``dtype`` (one rounding); NaN rows.

    Converted in row blocks, so the float64 intermediates stay small whatever N.
    """
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    scale = torch.exp2(-e)
    rows = max(1, CONVERT_ELEMENTS // max(acc.shape[1], 1))
    for r0 in range(0, acc.shape[0], rows):
        r1 = r0 + rows
        x = acc[r0:r1].double().mul_(scale[r0:r1, None])
        out[r0:r1] = x.masked_fill_(bad[r0:r1, None], float("nan"))
    return out
