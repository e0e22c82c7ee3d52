"""linear_divergence / vocab_parallel_divergence against fp64, and their error contract.

Truth: ``lp_testing.reference_divergence`` (fp64, both heads' logits materialized, the
spec's formulas; jsd's ``log m`` by logsumexp). Tolerances are relative to the plain
materialized path in the same dtype (``materialized_divergence_baseline``): lp must be no
worse than k x its error (``lp_testing.DTYPES``). Masked rows hold NaN hidden states (both
heads) and get a nonzero upstream gradient: their outputs and gradient rows must be exact
zeros. Padding weight rows (``vocab_size`` < rows) are 4x larger than real ones and must
get exact zero gradients.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from lp_kernels import DivergenceOutput, linear_divergence, vocab_parallel_divergence
from lp_testing import (
    DIVERGENCE_KINDS,
    DIVERGENCE_OUTPUTS,
    DTYPES,
    Tolerance,
    assert_close,
    assert_zero,
    make_problem,
    materialized_divergence_baseline,
    materialized_divergence_baseline_from_logits,
    random_upstream,
    reference_divergence,
    reference_divergence_from_logits,
)

FP32, BF16 = DTYPES[0], DTYPES[1]


@dataclass(frozen=True)
class Case:
    """One distillation problem: sizes, dtype and every option that changes the math."""

    n: int
    h: int
    h_t: int
    v: int
    pad: int = 0
    tol: Tolerance = FP32
    masked: int = 0
    chunk_size: int | None = None
    options: dict = field(default_factory=dict)
    bias: bool = False
    teacher_bias: bool = False


ALL_OPTIONS = {
    "temperature": 0.7,
    "teacher_temperature": 1.3,
    "softcap": 5.0,
    "teacher_softcap": 7.0,
    "logit_scale": 1.25,
    "teacher_logit_scale": 0.8,
}

TEMPERATURES = {"temperature": 1.7, "teacher_temperature": 0.6}
_EVERY = Case(29, 24, 40, 1009, pad=15, masked=5, chunk_size=8, options=ALL_OPTIONS)
_EVERY = dataclasses.replace(_EVERY, bias=True, teacher_bias=True)

CASES = {
    # a single row, prime V, student H 24 < teacher H 40, default options
    "N1-H24-Ht40-V1009": Case(1, 24, 40, 1009),
    # prime V, H 40 > teacher 24, temperatures, padding rows, masked rows, 3 chunks
    "N37-H40-Ht24-V4999-pad-T": Case(
        37, 40, 24, 4999, 9, masked=6, chunk_size=16, options=TEMPERATURES
    ),
    # every option on both sides (chunks of 8 rows), fp32 and bf16
    "all-options-fp32": _EVERY,
    "all-options-bf16": dataclasses.replace(_EVERY, tol=BF16),
}


def _make(case: Case, seed: int = 0) -> dict:
    """hidden, weight, teacher_hidden, teacher_weight (+ biases, mask, upstream) of a case;
    masked rows of both hidden states hold NaN."""
    v_pad = case.v + case.pad
    dtype = case.tol.dtype
    s = make_problem(case.n, case.h, case.v, dtype=dtype, seed=seed, padded_vocab=v_pad)
    t = make_problem(case.n, case.h_t, case.v, dtype=dtype, seed=seed + 1, padded_vocab=v_pad)
    g = torch.Generator().manual_seed(seed + 2)
    mask = torch.ones(case.n, dtype=torch.bool)
    mask[torch.randperm(case.n, generator=g)[: case.masked]] = False
    hidden, teacher_hidden = s.hidden.clone(), t.hidden.clone()
    hidden[~mask] = math.nan
    teacher_hidden[~mask] = math.nan
    data = {
        "hidden": hidden,
        "weight": s.weight,
        "teacher_hidden": teacher_hidden,
        "teacher_weight": t.weight,
        "mask": mask if case.masked else None,
        "vocab_size": case.v if case.pad else None,
        "upstream": random_upstream((case.n,), seed=seed),
    }
    if case.bias:
        data["bias"] = torch.randn(v_pad, generator=g).to(dtype)
    if case.teacher_bias:
        data["teacher_bias"] = torch.randn(v_pad, generator=g).to(dtype)
    return data


def _run_op(data: dict, kind: str, options: dict, **extra) -> tuple[DivergenceOutput, dict]:
    """The op on fresh leaves (hidden, weight, bias), backward with ``data["upstream"]``;
    returns the outputs and ``{"grad_hidden", "grad_weight", "grad_bias"}``."""
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    b = data.get("bias")
    b = None if b is None else b.clone().requires_grad_()
    out = linear_divergence(
        h, w, data["teacher_hidden"], data["teacher_weight"], kind=kind, mask=data["mask"],
        bias=b, teacher_bias=data.get("teacher_bias"), vocab_size=data["vocab_size"],
        **options, **extra,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    grads = {"grad_hidden": h.grad, "grad_weight": w.grad}
    return out, grads | {"grad_bias": None if b is None else b.grad}


def _ref_kwargs(data: dict, kind: str, options: dict) -> dict:
    keys = ("mask", "bias", "teacher_bias", "vocab_size", "upstream")
    return {"kind": kind, **options, **{k: data[k] for k in keys if data.get(k) is not None}}


def _check(out, grads, data, kind, options, tol: Tolerance, tag: str) -> None:
    """Every output and gradient against fp64, relative to the materialized baseline; exact
    zeros on masked rows and padding rows."""
    tensors = [data[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
    kw = _ref_kwargs(data, kind, options)
    truth = reference_divergence(*tensors, **kw)
    base = materialized_divergence_baseline(*tensors, **kw)
    masked = None if data["mask"] is None else ~data["mask"]
    for name in DIVERGENCE_OUTPUTS:
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == data["hidden"].shape[:-1]
        assert_close(got, truth[name], baseline=base[name], name=f"{name}{tag}", **tol.kwargs())
        if masked is not None:
            assert_zero(got, where=masked, name=f"{name} on masked rows{tag}")
    assert not out.student_entropy.requires_grad and not out.teacher_entropy.requires_grad
    v = data["vocab_size"]
    for name, got in grads.items():
        if truth[name] is None:
            assert got is None, name
            continue
        leaf = {"grad_hidden": "hidden", "grad_weight": "weight", "grad_bias": "bias"}[name]
        assert got.dtype == data[leaf].dtype, f"{name}{tag}: dtype {got.dtype}"
        assert_close(got, truth[name], baseline=base[name], name=f"{name}{tag}", **tol.kwargs())
        if name == "grad_hidden" and masked is not None:
            assert_zero(got, where=masked, name=f"grad_hidden on masked rows{tag}")
        if name != "grad_hidden" and v is not None:
            assert_zero(got[v:], name=f"{name} on padding rows{tag}")


@pytest.mark.parametrize("kind", DIVERGENCE_KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_parity_against_fp64(case, kind, backend):
    """Both backends (triton under Triton's CPU interpreter when there is no GPU; there,
    for CI time, not the large-V case, nor every option in fp32, which the TP and the
    deterministic tests run on triton)."""
    if backend == "triton" and case in ("N37-H40-Ht24-V4999-pad-T", "all-options-fp32"):
        pytest.skip("Triton's interpreter: CI time (covered in bf16 and by the TP tests)")
    c = CASES[case]
    data = _make(c, seed=len(case))
    out, grads = _run_op(data, kind, c.options, backend=backend, chunk_size=c.chunk_size)
    _check(out, grads, data, kind, c.options, c.tol, f"[{case}, {kind}, {backend}]")


@pytest.mark.parametrize("kind", DIVERGENCE_KINDS)
def test_deterministic_parity_against_fp64(kind, backend):
    """deterministic=True (global 128-column tiles) is as accurate as the default path, with
    every option, padding rows, NaN in masked rows and several chunks."""
    data = _make(dataclasses.replace(_EVERY, n=9, v=250, pad=6, masked=2, chunk_size=4), seed=1)
    out, grads = _run_op(
        data, kind, ALL_OPTIONS, backend=backend, chunk_size=4, deterministic=True
    )  # fmt: skip
    _check(out, grads, data, kind, ALL_OPTIONS, FP32, f"[deterministic, {kind}, {backend}]")


@pytest.mark.parametrize("beta", [0.1, 0.9])
def test_jsd_beta_and_leading_dims(beta):
    """jsd away from beta = 0.5 (the asymmetric mixture), on ``[B, S]`` rows."""
    c = Case(12, 16, 8, 257, masked=3, chunk_size=5, teacher_bias=True)
    data = _make(c, seed=3)
    for key in ("hidden", "teacher_hidden"):
        data[key] = data[key].reshape(3, 4, -1)
    data["mask"] = data["mask"].reshape(3, 4)
    data["upstream"] = data["upstream"].reshape(3, 4)
    options = {"beta": beta, "temperature": 1.1}
    out, grads = _run_op(data, "jsd", options)
    assert out.divergence.shape == (3, 4)
    _check(out, grads, data, "jsd", options, FP32, f"[jsd beta={beta}]")


def test_chunk_sizes_auto_backend_and_reproducibility():
    """Any chunk size (1, not dividing N, N, more than N, the default) gives the fp64 result;
    backend="auto" on CPU is the torch backend bit for bit; a rerun is bitwise equal."""
    c = Case(23, 16, 24, 211, pad=5, masked=4, options={"temperature": 0.9}, bias=True)
    data = _make(c, seed=5)
    for chunk in (1, 7, 23, 100, None):
        out, grads = _run_op(data, "reverse_kl", c.options, chunk_size=chunk, backend="torch")
        _check(out, grads, data, "reverse_kl", c.options, FP32, f"[chunk {chunk}]")
    first = _run_op(data, "forward_kl", c.options, backend="torch")
    for again in (_run_op(data, "forward_kl", c.options, backend="auto"), first):
        assert all(torch.equal(a, b) for a, b in zip(again[0], first[0], strict=True))
        for name, grad in first[1].items():
            assert torch.equal(again[1][name], grad), name


def test_empty_input_and_every_row_masked(backend):
    """No rows, or every row masked (NaN hidden): zero outputs and exact-zero gradients."""
    c = Case(6, 8, 12, 50, masked=6)
    data = _make(c, seed=4)
    data["mask"] = torch.zeros(6, dtype=torch.bool)
    out, grads = _run_op(data, "jsd", {}, backend=backend)
    for name, value in (*zip(DIVERGENCE_OUTPUTS, out, strict=True), *grads.items()):
        if value is not None:
            assert_zero(value, name=f"{name} (every row masked)")
    for key in ("hidden", "teacher_hidden", "upstream"):
        data[key] = data[key][:0]
    data["mask"] = None
    out, grads = _run_op(data, "reverse_kl", {}, backend=backend)
    assert out.divergence.shape == (0,) and grads["grad_hidden"].shape == (0, 8)
    assert_zero(grads["grad_weight"], name="grad_weight (no rows)")


def test_identical_heads_give_zero_divergence_and_gradient():
    """Teacher == student: every kind is 0 (to rounding) and so is its gradient."""
    p = make_problem(9, 16, 101, seed=2)
    for kind in DIVERGENCE_KINDS:
        h = p.hidden.clone().requires_grad_()
        out = linear_divergence(h, p.weight, p.hidden, p.weight, kind=kind)
        out.divergence.sum().backward()
        assert_close(out.divergence, torch.zeros(9), atol=1e-6, rtol=0, name=kind)
        assert_close(h.grad, torch.zeros_like(h), atol=1e-6, rtol=0, name=f"grad {kind}")
        assert torch.equal(out.student_entropy, out.teacher_entropy)


# ----------------------------------------------------------------------------------------
# vocab_parallel_divergence


def _topk(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """A top-k payload: the k largest log-probs per row, -inf elsewhere."""
    top = logprobs.topk(k, dim=-1).indices
    return torch.full_like(logprobs, -math.inf).scatter(-1, top, logprobs.gather(-1, top))


def _logits_case(tol: Tolerance, k: int | None, seed: int = 0):
    n, v, pad = 19, 503, 7
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v + pad, generator=g) * 3).to(tol.dtype)
    logits[:, v:] += 20  # padding columns would dominate if counted
    teacher = (torch.randn(n, v + pad, generator=g) * 2).log_softmax(-1)
    if k is not None:
        teacher = _topk(teacher, k)
    teacher = teacher.to(tol.dtype)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[2, 11]] = False
    logits[~mask] = 1e4  # garbage, finite (NaN: the test after the parity test)
    return logits, teacher, mask, v


@pytest.mark.parametrize(
    ("kind", "k", "tol"),
    [
        ("forward_kl", None, FP32),
        ("reverse_kl", None, FP32),
        ("jsd", None, BF16),
        ("forward_kl", 20, FP32),
        ("jsd", 20, FP32),
        ("forward_kl", 20, BF16),
    ],
    ids=lambda x: str(x) if not isinstance(x, str) else x,
)
def test_vocab_parallel_parity(kind, k, tol):
    logits, teacher, mask, v = _logits_case(tol, k, seed=len(kind))
    options = {"kind": kind, "beta": 0.3, "temperature": 0.8, "softcap": 9.0, "logit_scale": 1.2}
    up = random_upstream((logits.shape[0],), seed=1)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_divergence(
        x, teacher, mask=mask, vocab_size=v, chunk_size=6, **options
    )  # fmt: skip
    (out.divergence * up).sum().backward()
    kw = {"mask": mask, "vocab_size": v, "upstream": up, **options}
    truth = reference_divergence_from_logits(logits, teacher, **kw)
    base = materialized_divergence_baseline_from_logits(logits, teacher, **kw)
    tag = f"[{kind}, top-{k}, {tol}]"
    for name in DIVERGENCE_OUTPUTS:
        got = getattr(out, name)
        assert_close(got, truth[name], baseline=base[name], name=name + tag, **tol.kwargs())
        assert_zero(got, where=~mask, name=f"{name} on masked rows{tag}")
    assert x.grad.dtype == logits.dtype
    assert_close(
        x.grad, truth["grad_logits"], baseline=base["grad_logits"], name="grad_logits" + tag,
        **tol.kwargs(),
    )  # fmt: skip
    assert_zero(x.grad, where=~mask, name=f"grad_logits on masked rows{tag}")
    assert_zero(x.grad[:, v:], name=f"grad_logits on padding columns{tag}")


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_vocab_parallel_masked_rows_may_hold_nan(softcap):
    """Masked rows give 0 and an exact-zero gradient whatever their logits hold, NaN
    included (as linear_divergence's masked hidden rows), with a cap too."""
    logits, teacher, mask, v = _logits_case(FP32, None)
    logits[~mask] = math.nan
    x = logits.clone().requires_grad_()
    out = vocab_parallel_divergence(x, teacher, mask=mask, vocab_size=v, softcap=softcap)
    out.divergence.sum().backward()
    for name in DIVERGENCE_OUTPUTS:
        assert_zero(getattr(out, name), where=~mask, name=f"{name} on masked rows")
    assert_zero(x.grad, where=~mask, name="grad_logits on masked rows")
    assert bool(x.grad[mask].isfinite().all())


def test_vocab_parallel_top_k_reverse_kl_is_infinite():
    """reverse_kl against a top-k teacher is +inf on every kept row (the student puts mass
    where q = 0), as documented; the teacher entropy stays the top-k's."""
    logits, teacher, mask, v = _logits_case(FP32, 20)
    out = vocab_parallel_divergence(logits, teacher, kind="reverse_kl", mask=mask, vocab_size=v)
    assert bool(torch.isposinf(out.divergence[mask]).all()), out.divergence
    assert_zero(out.divergence, where=~mask, name="masked rows")
    truth = reference_divergence_from_logits(
        logits, teacher, kind="reverse_kl", mask=mask, vocab_size=v
    )
    assert_close(out.teacher_entropy, truth["teacher_entropy"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Errors

N, H, HT, V = 4, 8, 6, 30


def _args() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(N, H, generator=g),
        "weight": torch.randn(V, H, generator=g),
        "teacher_hidden": torch.randn(N, HT, generator=g),
        "teacher_weight": torch.randn(V, HT, generator=g),
    }


def _call(**over):
    kw = _args() | over
    tensors = [kw.pop(k) for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
    return linear_divergence(*tensors, **kw)


BAD = [
    ({"teacher_hidden": torch.randn(N, HT, requires_grad=True)}, ValueError, "teacher_hidden"),
    ({"teacher_weight": torch.randn(V, HT, requires_grad=True)}, ValueError, "teacher_weight"),
    ({"teacher_bias": torch.zeros(V, requires_grad=True)}, ValueError, "teacher_bias"),
    ({"teacher_weight": torch.randn(V + 1, HT)}, ValueError, "teacher_weight"),
    ({"teacher_weight": torch.randn(V - 2, HT)}, ValueError, "teacher_weight"),
    ({"teacher_hidden": torch.randn(N + 1, HT)}, ValueError, "teacher_hidden"),
    ({"teacher_hidden": torch.randn(N, HT + 1)}, ValueError, "hidden size"),
    ({"mask": torch.ones(N, dtype=torch.int64)}, TypeError, "mask"),
    ({"mask": torch.ones(N)}, TypeError, "mask"),
    ({"mask": torch.ones(N + 1, dtype=torch.bool)}, ValueError, "mask"),
    ({"mask": torch.ones(N, 1, dtype=torch.bool)}, ValueError, "mask"),
    ({"kind": "kl"}, ValueError, "kind"),
    ({"kind": "JSD"}, ValueError, "kind"),
    ({"kind": "jsd", "beta": 0.0}, ValueError, "beta"),
    ({"kind": "jsd", "beta": 1.0}, ValueError, "beta"),
    ({"kind": "jsd", "beta": -0.2}, ValueError, "beta"),
    ({"kind": "jsd", "beta": 1.5}, ValueError, "beta"),
    ({"kind": "jsd", "beta": float("nan")}, ValueError, "beta"),
    ({"kind": "jsd", "beta": torch.tensor(0.5)}, TypeError, "beta"),
    ({"teacher_temperature": 0.0}, ValueError, "temperature"),
    ({"teacher_softcap": -1.0}, ValueError, "softcap"),
    ({"deterministic": True, "deterministic_tile": 100}, ValueError, "deterministic_tile"),
    ({"vocab_size": V + 1}, ValueError, "vocab_size"),
]


@pytest.mark.parametrize(("over", "exc", "match"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_arguments(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    """backend="triton" runs on CUDA, or on CPU under TRITON_INTERPRET=1 only (as
    documented); "auto" on CPU is the torch backend."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        _call(backend="triton")
    assert torch.equal(_call(backend="auto").divergence, _call(backend="torch").divergence)


def test_teacher_requires_grad_message_names_the_fix():
    with pytest.raises(ValueError, match=r"teacher_weight requires grad.*detach\(\)"):
        _call(teacher_weight=torch.randn(V, HT, requires_grad=True))


def test_jsd_beta_is_ignored_by_the_kls():
    """beta is jsd's only: the KLs accept (and ignore) a beta outside (0, 1)."""
    a = _call(kind="forward_kl", beta=0.5).divergence
    assert torch.equal(_call(kind="forward_kl", beta=2.0).divergence, a)


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"teacher_logprobs": torch.zeros(N, V, requires_grad=True)}, ValueError, "teacher_"),
        ({"teacher_logprobs": torch.zeros(N, V + 1)}, ValueError, "teacher_logprobs"),
        ({"teacher_logprobs": torch.zeros(N, V, dtype=torch.int64)}, TypeError, "teacher_"),
        ({"mask": torch.ones(N + 1, dtype=torch.bool)}, ValueError, "mask"),
        ({"kind": "jsd", "beta": 1.0}, ValueError, "beta"),
        ({"kind": "tvd"}, ValueError, "kind"),
    ],
    ids=["requires-grad", "shape", "dtype", "mask", "beta", "kind"],
)
def test_vocab_parallel_bad_arguments(over, exc, match):
    kw = {"logits": torch.randn(N, V), "teacher_logprobs": torch.zeros(N, V)} | over
    with pytest.raises(exc, match=match):
        vocab_parallel_divergence(kw.pop("logits"), kw.pop("teacher_logprobs"), **kw)
