"""Comparison helpers: bounds, messages, non-finite values, shapes, empty tensors."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lp_testing import assert_bitwise_equal, assert_close, assert_zero, error_report

TRUTH = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, -4.0]], dtype=torch.float64)


def test_error_report_finds_worst_element() -> None:
    actual = TRUTH.clone()
    actual[1, 2] = -4.5
    actual[0, 0] = 1.1
    r = error_report(actual.float(), TRUTH, name="lse")
    assert r.worst_index == (1, 2)
    assert r.max_abs == pytest.approx(0.5)
    assert r.actual_at_worst == -4.5 and r.truth_at_worst == -4.0
    assert r.max_rel == pytest.approx(0.125)
    assert r.num_nonfinite == 0
    assert "lse: max abs err 5.000e-01 at (1, 2)" in str(r)


def test_baseline_bound() -> None:
    baseline = TRUTH + 0.01
    ours = TRUTH.clone()
    ours[0, 1] += 0.019
    report = assert_close(ours, TRUTH, baseline=baseline, k=2.0, atol=0.0, rtol=0.0, name="ok")
    assert report.max_abs == pytest.approx(0.019)
    ours[0, 1] += 0.002  # 0.021 > 2 x 0.01
    with pytest.raises(AssertionError) as info:
        assert_close(ours, TRUTH, baseline=baseline, k=2.0, atol=0.0, rtol=0.0, name="grad_w")
    message = str(info.value)
    for piece in (
        "grad_w",
        "max abs err 2.100e-02 at (0, 1)",
        "actual -1.979",
        "truth -2",
        "max rel err 1.050e-02",
        "allowed max abs err 2.000e-02 = 2 x baseline err 1.000e-02",
        "2.10x the baseline's error",
    ):
        assert piece in message, (piece, message)


def test_baseline_floor_when_baseline_exact() -> None:
    ours = TRUTH + 1e-7
    with pytest.raises(AssertionError, match="floor"):
        assert_close(ours.float(), TRUTH, baseline=TRUTH.float(), atol=0.0, rtol=0.0)
    # Default floor: eps(actual dtype) x max|truth| = 1.2e-7 x 4.
    assert_close(ours.float(), TRUTH, baseline=TRUTH.float())
    assert_close(ours, TRUTH, baseline=TRUTH, atol=1e-6)


def test_baseline_nonfinite_elements_are_left_out() -> None:
    baseline = TRUTH.clone()
    baseline[0, 0] = math.inf
    with pytest.raises(AssertionError):
        assert_close(TRUTH + 0.1, TRUTH, baseline=baseline, atol=0.0, rtol=0.0)


def test_elementwise_mode() -> None:
    assert_close(TRUTH.float(), TRUTH)
    actual = TRUTH.clone()
    actual[0, 2] = 3.01
    with pytest.raises(AssertionError) as info:
        assert_close(actual, TRUTH, atol=1e-3, rtol=1e-3, name="logprob")
    message = str(info.value)
    assert "logprob" in message and "1 of 6 elements exceed" in message
    assert "worst excess at (0, 2): actual 3.01, truth 3" in message
    assert re.search(r"allowed 4\.000e-03", message)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_where_truth_finite_fails(bad: float) -> None:
    actual = TRUTH.clone()
    actual[1, 0] = bad
    actual[0, 0] = 100.0  # a larger finite error elsewhere: the non-finite one is reported
    with pytest.raises(AssertionError, match=r"1 non-finite values .* index \(1, 0\)"):
        assert_close(actual, TRUTH, baseline=TRUTH + 1e9, name="x")


def test_matching_nonfinite_values_are_equal() -> None:
    truth = torch.tensor([math.nan, math.inf, -math.inf, 1.0], dtype=torch.float64)
    assert_close(truth.clone(), truth)
    assert error_report(truth.clone(), truth).max_abs == 0.0
    wrong = truth.clone()
    wrong[1] = -math.inf
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(wrong, truth)


def test_shape_mismatch_and_empty() -> None:
    with pytest.raises(AssertionError, match=r"shape mismatch: actual \(2, 3\) vs truth \(3, 2\)"):
        assert_close(TRUTH, TRUTH.T.contiguous(), name="g")
    with pytest.raises(AssertionError, match="baseline"):
        assert_close(TRUTH, TRUTH, baseline=TRUTH[:1])
    empty = torch.empty(0, 5)
    report = assert_close(empty, empty.double(), baseline=empty)
    assert report.worst_index is None and report.max_abs == 0.0
    assert_bitwise_equal(empty, empty.clone())
    assert_zero(empty)


def test_assert_zero() -> None:
    grad = torch.zeros(4, 3)
    grad[2, 1] = 1e-30
    grad[0, 0] = -0.0
    rows = torch.tensor([True, False, False, True])
    assert_zero(grad, where=rows)
    with pytest.raises(AssertionError, match=r"1 elements are not exactly zero .*\(2, 1\)"):
        assert_zero(grad, name="grad_hidden")
    grad[3, 2] = math.nan
    with pytest.raises(AssertionError, match=r"first at \(3, 2\): nan"):
        assert_zero(grad, where=rows)


def test_assert_bitwise_equal() -> None:
    a = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    assert_bitwise_equal(a, a.clone())
    nan = torch.tensor([math.nan, 1.0])
    assert_bitwise_equal(nan, nan.clone())  # same NaN bits
    b = a.clone()
    b[1, 3] = torch.nextafter(b[1, 3], torch.tensor(math.inf))
    b[3, 0] += 1.0
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(a, b, "logprob tp2 vs tp1")
    message = str(info.value)
    assert "logprob tp2 vs tp1: not bitwise equal: 2 of 20 elements differ" in message
    assert "first at (1, 3)" in message and "max abs diff" in message
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(a, a.double())
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(a, a.T)
    assert_bitwise_equal(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert_bitwise_equal(a.T, a.T.contiguous())  # non-contiguous input
