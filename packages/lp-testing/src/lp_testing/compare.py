"""Comparisons that say where and by how much: error reports, closeness, bitwise equality.

All closeness math is in float64 on the actual tensor's device. Non-finite values are
compared exactly: a NaN or infinity where the truth is finite is an infinite error (and
is reported first), NaN where the truth is NaN and the same infinity where the truth has
it are no error.

Two ways to bound the error in :func:`assert_close`:

- against a baseline (preferred for low precision)::

      max|actual - truth| <= k * max|baseline - truth| + atol + rtol * max|truth|

  The baseline is the plain materialized-logits result in the same dtype
  (:func:`lp_testing.reference.materialized_baseline`): ours must be no worse than k
  times what everybody already accepts. The floor covers a baseline that happens to be
  exact.
- element-wise, as ``torch.allclose``: ``|actual - truth| <= atol + rtol * |truth|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ErrorReport",
    "assert_bitwise_equal",
    "assert_close",
    "assert_zero",
    "error_report",
]

# Element-wise defaults (torch.testing's) for assert_close without a baseline: (atol, rtol).
_ALLCLOSE_DEFAULTS: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 1.6e-2),
    torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7),
}

_INT_VIEW: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def _label(name: str) -> str:
    return name or "tensor"


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """Unravel a flat index into a tuple index for ``shape``."""
    index: list[int] = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def _abs_error(actual: Tensor, truth: Tensor) -> Tensor:
    """``|actual - truth|`` in float64 with the non-finite rules of the module docstring."""
    diff = (actual - truth).abs()
    same = (actual == truth) | (actual.isnan() & truth.isnan())
    diff = torch.where(same, torch.zeros_like(diff), diff)
    return torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)


def _as_f64(actual: Tensor, truth: Tensor, name: str) -> tuple[Tensor, Tensor]:
    if actual.shape != truth.shape:
        raise AssertionError(
            f"{_label(name)}: shape mismatch: actual {tuple(actual.shape)} vs truth "
            f"{tuple(truth.shape)}"
        )
    a = actual.detach().to(torch.float64)
    return a, truth.detach().to(device=a.device, dtype=torch.float64)


@dataclass(frozen=True)
class ErrorReport:
    """Error of ``actual`` against ``truth``.

    Attributes:
        name: label used in messages.
        shape: the compared shape.
        max_abs: ``max|actual - truth|`` (inf if a non-finite value is wrong).
        max_rel: ``max |actual - truth| / |truth|`` over elements (inf where truth is 0
            and actual is not).
        norm_rel: ``||actual - truth||_2 / ||truth||_2`` (norm-wise relative error).
        worst_index: index of the element with the largest abs error; None if empty.
        actual_at_worst: actual value there (nan if empty).
        truth_at_worst: true value there (nan if empty).
        num_nonfinite: elements where actual is NaN/inf and truth is not the same.
    """

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    norm_rel: float
    worst_index: tuple[int, ...] | None
    actual_at_worst: float
    truth_at_worst: float
    num_nonfinite: int

    def __str__(self) -> str:
        if self.worst_index is None:
            return f"{_label(self.name)}: empty {self.shape}"
        return (
            f"{_label(self.name)}: max abs err {self.max_abs:.3e} at {self.worst_index} "
            f"(actual {self.actual_at_worst:.8g}, truth {self.truth_at_worst:.8g}); "
            f"max rel err {self.max_rel:.3e}; norm rel err {self.norm_rel:.3e}; "
            f"shape {self.shape}"
            + (f"; {self.num_nonfinite} wrong non-finite values" if self.num_nonfinite else "")
        )


def error_report(actual: Tensor, truth: Tensor, *, name: str = "") -> ErrorReport:
    """Measure ``actual`` against ``truth`` (same shape; any dtypes; compared in float64).

    Raises:
        AssertionError: shapes differ.
    """
    a, t = _as_f64(actual, truth, name)
    shape = tuple(a.shape)
    if a.numel() == 0:
        return ErrorReport(name, shape, 0.0, 0.0, 0.0, None, math.nan, math.nan, 0)
    err = _abs_error(a, t)
    worst = int(err.reshape(-1).argmax())
    rel = torch.where(err == 0, torch.zeros_like(err), err / t.abs())
    finite = t.isfinite()
    denom = float(t[finite].norm()) if bool(finite.any()) else 0.0
    num = float(err.norm())
    norm_rel = 0.0 if num == 0 else (num / denom if denom > 0 else math.inf)
    return ErrorReport(
        name=name,
        shape=shape,
        max_abs=float(err.reshape(-1)[worst]),
        max_rel=float(rel.max()),
        norm_rel=norm_rel,
        worst_index=_index(worst, a.shape),
        actual_at_worst=float(a.reshape(-1)[worst]),
        truth_at_worst=float(t.reshape(-1)[worst]),
        num_nonfinite=int((err == math.inf).sum()),
    )


def _nonfinite_message(report: ErrorReport) -> str:
    return (
        f"{_label(report.name)}: {report.num_nonfinite} non-finite values where the truth is "
        f"finite or different (first at index {report.worst_index}: actual "
        f"{report.actual_at_worst}, truth {report.truth_at_worst})"
    )


def assert_close(
    actual: Tensor,
    truth: Tensor,
    *,
    baseline: Tensor | None = None,
    k: float = 2.0,
    atol: float | None = None,
    rtol: float | None = None,
    name: str = "",
) -> ErrorReport:
    """Assert that ``actual`` is close to ``truth``, relative to a baseline when given.

    Args:
        actual: the result under test, any shape and float dtype.
        truth: the reference (usually float64), same shape.
        baseline: the plain low-precision result, same shape. With it the bound is
            ``k * max|baseline - truth| + atol + rtol * max|truth|`` on the max abs error;
            defaults ``atol = 0``, ``rtol = eps(actual.dtype)``. Non-finite baseline
            elements (an fp16 overflow, say) are left out of the baseline's error.
        k: allowed multiple of the baseline's error.
        atol: absolute tolerance (see above; without baseline, torch.testing's default for
            actual's dtype).
        rtol: relative tolerance (see above; without baseline it is element-wise).
        name: what is compared, for the message (e.g. ``"grad_weight[bf16, N37-H64-V1009]"``).

    Returns:
        The :class:`ErrorReport` of ``actual`` (handy for logging).

    Raises:
        AssertionError: with the name, max abs and rel errors, the worst element's index
            and its actual and true values, and the allowed bound.

    Example:
        >>> truth = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> r = assert_close(torch.tensor([1.0, 2.001]), truth, baseline=torch.tensor([1.0, 2.002]))
        >>> f"{r.max_abs:.1e}"
        '1.0e-03'
    """
    report = error_report(actual, truth, name=name)
    if report.worst_index is None:
        if baseline is not None and baseline.shape != truth.shape:
            _as_f64(baseline, truth, f"{_label(name)} baseline")
        return report
    if report.num_nonfinite:
        raise AssertionError(_nonfinite_message(report))
    a, t = _as_f64(actual, truth, name)

    if baseline is not None:
        b, _ = _as_f64(baseline, truth, f"{_label(name)} baseline")
        b_err = _abs_error(b, t)
        b_err = b_err[b_err.isfinite()]
        base = float(b_err.max()) if b_err.numel() else 0.0
        atol_ = 0.0 if atol is None else atol
        if rtol is not None:
            rtol_ = rtol
        else:
            rtol_ = torch.finfo(actual.dtype).eps if actual.dtype.is_floating_point else 0.0
        t_max = float(t[t.isfinite()].abs().max()) if bool(t.isfinite().any()) else 0.0
        floor = atol_ + rtol_ * t_max
        bound = k * base + floor
        if report.max_abs <= bound:
            return report
        raise AssertionError(
            f"{report}\n  allowed max abs err {bound:.3e} = {k:g} x baseline err {base:.3e} + "
            f"floor {floor:.3e} (atol {atol_:g} + rtol {rtol_:g} x max|truth| {t_max:.3e}); "
            f"ours is {report.max_abs / base if base else math.inf:.2f}x the baseline's error"
        )

    default_atol, default_rtol = _ALLCLOSE_DEFAULTS.get(actual.dtype, (0.0, 0.0))
    atol_ = default_atol if atol is None else atol
    rtol_ = default_rtol if rtol is None else rtol
    allowed = atol_ + rtol_ * t.abs()
    excess = _abs_error(a, t) - allowed
    bad = excess > 0
    if not bool(bad.any()):
        return report
    worst = int(torch.where(bad, excess, torch.full_like(excess, -math.inf)).reshape(-1).argmax())
    i = _index(worst, a.shape)
    av, tv = float(a.reshape(-1)[worst]), float(t.reshape(-1)[worst])
    raise AssertionError(
        f"{report}\n  {int(bad.sum())} of {a.numel()} elements exceed atol + rtol * |truth| "
        f"(atol {atol_:g}, rtol {rtol_:g}); worst excess at {i}: actual {av:.8g}, truth "
        f"{tv:.8g}, abs err {abs(av - tv):.3e}, allowed {float(allowed.reshape(-1)[worst]):.3e}"
    )


def assert_zero(actual: Tensor, *, where: Tensor | None = None, name: str = "") -> None:
    """Assert that ``actual`` is exactly zero (``-0.0`` allowed), optionally only on a mask.

    Args:
        actual: e.g. ``logprob [N]`` or ``grad_hidden [N, H]``.
        where: bool mask over the leading dims of ``actual`` (e.g. the ignored rows
            ``[N]``; trailing dims are broadcast). None: everywhere.
        name: label for the message.

    Raises:
        AssertionError: giving how many elements are nonzero, the first index and value.
    """
    a = actual.detach()
    nonzero = a != 0  # NaN != 0 is True: NaN counts as nonzero
    if where is not None:
        mask = where.to(device=a.device, dtype=torch.bool)
        mask = mask.reshape(*mask.shape, *([1] * (a.dim() - mask.dim())))
        nonzero = nonzero & mask
    count = int(nonzero.sum())
    if count:
        first = _index(int(nonzero.reshape(-1).int().argmax()), a.shape)
        raise AssertionError(
            f"{_label(name)}: {count} elements are not exactly zero"
            f"{' where they must be' if where is not None else ''} (first at {first}: "
            f"{a[first].item()!r})"
        )


def _bits(x: Tensor) -> Tensor:
    """The raw bit pattern of ``x`` as integers (identity for integer and bool tensors)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype.is_floating_point:
        return x.contiguous().view(_INT_VIEW[x.element_size()])
    return x


def assert_bitwise_equal(actual: Tensor, expected: Tensor, name: str = "") -> None:
    """Assert identical dtype, shape and bits (determinism and invariance claims).

    Equal iff every element has the same bit pattern: like ``torch.equal``, except that
    ``-0.0`` differs from ``0.0`` and a NaN equals a NaN with the same bits.

    Raises:
        AssertionError: the count of differing elements, the first index, both values
            there, and the max abs difference.
    """
    label = _label(name)
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{label}: dtype {actual.dtype} vs {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{label}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.detach()
    e = expected.detach().to(a.device)
    if torch.equal(_bits(a), _bits(e)):
        return
    differ = _bits(a) != _bits(e)
    if differ.dim() > a.dim():  # complex: (real, imag) pairs
        differ = differ.any(-1)
    if not bool(differ.any()):
        return
    count = int(differ.sum())
    first = _index(int(differ.reshape(-1).int().argmax()), a.shape)
    diff = ""
    if a.dtype.is_floating_point:
        delta = (a.double() - e.double()).abs()
        delta = delta[delta.isfinite()]
        if delta.numel():
            diff = f"; max abs diff of finite elements {float(delta.max()):.3e}"
    raise AssertionError(
        f"{label}: not bitwise equal: {count} of {a.numel()} elements differ (first at "
        f"{first}: {a[first].item()!r} vs {e[first].item()!r}){diff}"
    )
