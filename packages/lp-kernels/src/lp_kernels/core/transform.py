"""The logit transform: from a raw logit to the softmax argument, its value and derivative.

Every op and backend reads one :class:`LogitTransform`; this module is its torch side, and
``lp_kernels.backends.triton.softmax`` its Triton side (the same formulas as jit helpers)::

    l = h W^T (+ b)          the raw logit, fp32 (a bias is added to the finished GEMM sums)
    x = s l                  logit_scale s (Granite, Cohere, Falcon-H1, MiniCPM3), when set
    y = c tanh(x / c)        softcap (Gemma 2 / 3's final_logit_softcapping), when set
    z = y / T                the sampler's temperature
    z = -inf                 past the real vocabulary (padding columns): the vocabulary mask

    d z / d l = s (1 - tanh^2(x / c)) / T

The softcap is computed from ``exp`` and one reciprocal, as the Triton kernels must (no
libdevice under the interpreter)::

    u = x / c,  a = |u|,  e = exp(-2a),  r = 1 / (1 + e)
    tanh(u) = sign(u) * (r - e r)                      a >= 1/8   ((1 - e) / (1 + e))
            = sign(u) * a (1 - a^2/3 + 2a^4/15 - 17a^6/315)   a < 1/8 (1 - e cancels there;
              the series' next term is below 2^-29 relative)
    1 - tanh^2(u) = (1 - t)(1 + t) = 4 e r^2         (no cancellation at large a)

Here, as under the interpreter, the divisions and the exponential are correctly rounded fp32
operations; on the GPU the reciprocal is one ``rcp.approx`` (at most 1 ulp) and ``e`` one
``ex2``. The Triton kernels' softmax terms take ``tanh = 2 r - 1`` and the slope ``4 r (1 -
r)`` from a signed ``r``: only absolute errors matter there; the target's logit, which a
log-prob returns as it is, takes the form above. Non-finite logits stay what they are
(``+-inf`` and NaN pass through, slope 0 / NaN), so a non-finite input still makes its row's
outputs NaN and a ``-inf`` mask stays a mask.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

SERIES_BELOW = 0.125
"""``|l / c|`` below which tanh is taken from its series."""


def _positive_float(name: str, value: Any, *, optional: bool) -> float | None:
    """``value`` as a float, checked finite and > 0 (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    what = "None or a Python float" if optional else "a Python float"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}finite and > 0, got {value}")
    return float(value)


@dataclass(frozen=True)
class LogitTransform:
    """The map from a raw logit ``l`` to the softmax argument ``z`` of one call.

    Every field is a Python float (or None: the step is the identity), checked by
    :meth:`checked`. The fields, in order, are also the transform's part of the per-call
    rank record (``lp_kernels.distributed.contract``)."""

    temperature: float = 1.0
    """Divides the (capped) logits; finite and > 0."""
    softcap: float | None = None
    """The cap ``c`` of ``c tanh(x / c)``, applied before the temperature; None: no cap."""
    logit_scale: float | None = None
    """Multiplies the raw logits (bias included) before the cap; None: no scale."""

    @classmethod
    def checked(
        cls, *, temperature: Any = 1.0, softcap: Any = None, logit_scale: Any = None
    ) -> LogitTransform:
        """A transform from a public op's arguments, each checked (``TypeError`` /
        ``ValueError`` naming the argument). A ``logit_scale`` of 1 is no scale."""
        scale = _positive_float("logit_scale", logit_scale, optional=True)
        return cls(
            temperature=_positive_float("temperature", temperature, optional=False),
            softcap=_positive_float("softcap", softcap, optional=True),
            logit_scale=None if scale == 1.0 else scale,
        )

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature

    @property
    def capped(self) -> bool:
        return self.softcap is not None

    def record(self) -> tuple[tuple[str, float | None], ...]:
        """``(name, value)`` of every field, in order (the per-call rank record's part)."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def apply_(self, l: torch.Tensor, *, slope: bool = False) -> torch.Tensor | None:
        """``l <- z`` in place for fp32 raw logits (``-inf`` stays ``-inf``); returns the
        softcap's slope ``1 - tanh^2(x / c)`` (fp32, ``l``'s shape) when ``slope`` and a cap
        is set, else None: what :meth:`chain_` takes."""
        if self.logit_scale is not None:
            l.mul_(self.logit_scale)
        s = None
        if self.softcap is not None:
            s = softcap_(l, self.softcap, slope=slope)
        if self.temperature != 1.0:
            l.mul_(self.inv_temperature)
        return s

    def chain_(self, dz: torch.Tensor, slope: torch.Tensor | None) -> torch.Tensor:
        """``dz <- d l = dz * dz/dl`` in place (fp32): the chain rule through the transform,
        with ``slope`` from :meth:`apply_`."""
        if self.temperature != 1.0:
            dz.mul_(self.inv_temperature)
        if slope is not None:
            dz.mul_(slope)
        if self.logit_scale is not None:
            dz.mul_(self.logit_scale)
        return dz

    @property
    def gain(self) -> float:
        """An upper bound on ``|dz / dl|``: ``s / T`` (the cap's slope is at most 1). It is
        also the factor of a bound on ``|l|`` in one on ``|z|`` (:meth:`z_bound`)."""
        if self.logit_scale is None:
            return self.inv_temperature
        return self.logit_scale * self.inv_temperature

    @property
    def z_max(self) -> float | None:
        """The largest ``|z|`` the transform can give, ``c / T`` under a cap, else None."""
        return None if self.softcap is None else self.softcap * self.inv_temperature

    def z_bound(self, l_abs: torch.Tensor) -> torch.Tensor:
        """An upper bound on ``|z|`` from one on ``|l|`` (float64; NaN stays NaN):
        ``|l| gain``, at most :attr:`z_max`."""
        z = l_abs * self.gain
        if self.z_max is not None:
            z = torch.clamp(z, max=self.z_max)
        return z


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
