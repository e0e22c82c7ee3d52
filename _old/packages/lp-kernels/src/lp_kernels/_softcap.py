"""Final-logit softcapping ``z = c * tanh(l / c)`` (Gemma 2 / 3), torch side.

The cap applies to the raw fp32 logits ``l = h W^T (+ b)``, before the temperature, and
its derivative ``dz / dl = 1 - tanh^2(l / c)`` to the logits gradient. The triton kernels
have no libdevice under the interpreter, so tanh is built from ``exp`` there
(``backends.triton.tl_utils.softcap_tile``); this module computes the same formula, so
both backends share one definition of the numerics::

    x = l / c,  a = |x|,  e = exp(-2a)
    tanh(x) = sign(x) * (1 - e) / (1 + e)              a >= 1/8
            = sign(x) * a (1 - a^2/3 + 2a^4/15 - 17a^6/315)   a < 1/8 (1 - e cancels there;
              the series' next term is below 2^-29 relative)
    1 - tanh^2(x) = 4e / (1 + e)^2                   (no cancellation at large a)

Non-finite logits stay what they are (``+-inf`` and NaN pass through, slope 0 / NaN), so
a non-finite input still makes its row's outputs NaN and a ``-inf`` mask stays a mask.
"""

from __future__ import annotations

import torch

SERIES_BELOW = 0.125
"""``|l / c|`` below which tanh is taken from its series."""


def softcap_(l: torch.Tensor, cap: float, *, slope: bool = False) -> torch.Tensor | None:
    """``l <- cap * tanh(l / cap)`` in place (fp32); returns ``1 - tanh^2`` when ``slope``."""
    x = l * (1.0 / cap)
    a = x.abs()
    e = torch.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = torch.where(a < SERIES_BELOW, series, t)
    t = torch.where(x < 0, -t, t)
    l.copy_(torch.where(a < float("inf"), cap * t, l))
    if not slope:
        return None
    one_e = 1.0 + e
    return 4.0 * e / (one_e * one_e)
