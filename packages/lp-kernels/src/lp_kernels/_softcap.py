"""Final-logit softcapping ``z = c * tanh(l / c)`` (Gemma 2 / 3), torch side.

The cap applies to the raw fp32 logits ``l = h W^T (+ b)``, before the temperature, and
its derivative ``dz / dl = 1 - tanh^2(l / c)`` to the logits gradient. The triton kernels
have no libdevice under the interpreter, so tanh is built from ``exp`` and one reciprocal
there (``backends.triton.tl_utils.softcap``); this module computes the same formula,
so both backends share one definition of the numerics (the triton kernels' softmax terms
take ``tanh = 2 r - 1`` and the slope ``4 r (1 - r)`` from ``r = 1 / (1 + e^(-2x))``
signed, ``tl_utils.cap_r``: only absolute errors matter there, and theirs are the
formula's own; the target's logit takes all of it)::

    x = l / c,  a = |x|,  e = exp(-2a),  r = 1 / (1 + e)
    tanh(x) = sign(x) * (r - e r)                      a >= 1/8   ((1 - e) / (1 + e))
            = sign(x) * a (1 - a^2/3 + 2a^4/15 - 17a^6/315)   a < 1/8 (1 - e cancels there;
              the series' next term is below 2^-29 relative)
    1 - tanh^2(x) = (1 - t)(1 + t) = 4 e r^2         (no cancellation at large a)

One reciprocal serves both: on the GPU it is one ``rcp.approx`` (at most 1 ulp), ``e`` one
``ex2`` (``exp(-2a) = 2^(-2a log2 e)``) and ``r - e r`` one FMA; here, as under the
interpreter, the divisions and the exponential are correctly rounded fp32 operations.

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
    r = torch.reciprocal(1.0 + e)
    er = e * r
    t = r - er
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = torch.copysign(torch.where(a < SERIES_BELOW, series, t), x)
    l.copy_(torch.where(a < float("inf"), cap * t, l))
    if not slope:
        return None
    return 4.0 * (er * r)
