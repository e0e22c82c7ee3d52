"""linear_logprob against fp64 over awkward shapes, every dtype and option, CPU and CUDA.

Tolerances are relative to the plain materialized-logits path in the same dtype
(``lp_testing.materialized_baseline``): lp must be no worse than k x its error.
"""

from __future__ import annotations

import pytest
import torch
from _parity import check_against_fp64 as _check

from lp_kernels import linear_logprob
from lp_testing import (
    AWKWARD_SHAPES,
    DTYPES,
    assert_close,
    make_problem,
    materialized_baseline,
    reference_all,
)

# (temperature, ignore_frac, padded columns, return_entropy, return_lse)
OPTIONS = {
    "plain": (1.0, 0.0, 0, False, False),
    "all-options": (0.7, 0.25, 13, True, True),
}


@pytest.mark.parametrize("opts", list(OPTIONS), ids=str)
@pytest.mark.parametrize("tol", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_parity_awkward_shapes(shape, tol, opts, device, backend):
    temperature, ignore_frac, pad, entropy, lse = OPTIONS[opts]
    problem = make_problem(
        shape.n,
        shape.h,
        shape.v,
        dtype=tol.dtype,
        device=device,
        seed=shape.n + shape.v,
        ignore_frac=ignore_frac,
        padded_vocab=shape.v + pad if pad else None,
        temperature=temperature,
    )
    _check(problem, tol, entropy=entropy, lse=lse, backend=backend)


@pytest.mark.parametrize(
    "mix",
    ["entropy-only", "lse-only", "logprob+entropy"],
)
def test_any_mix_of_upstream_gradients(mix, device, backend):
    """Gradients from any subset of the outputs, each with its own per-row upstream gradient."""
    tol = DTYPES[0]
    p = make_problem(
        29, 24, 211, device=device, seed=3, ignore_frac=0.2, temperature=1.3
    ).with_grad()
    up = p.upstream()
    out = linear_logprob(
        p.hidden,
        p.weight,
        p.targets,
        return_entropy=True,
        return_lse=True,
        backend=backend,
        **p.op_kwargs(),
    )
    grads = {
        "entropy-only": {"grad_entropy": up["grad_entropy"]},
        "lse-only": {"grad_lse": up["grad_lse"]},
        "logprob+entropy": {"grad_logprob": up["grad_logprob"], "grad_entropy": up["grad_entropy"]},
    }[mix]
    field = {"grad_logprob": "logprob", "grad_entropy": "entropy", "grad_lse": "lse"}
    sum((getattr(out, field[k]) * g).sum() for k, g in grads.items()).backward()
    truth = reference_all(p.hidden, p.weight, p.targets, **grads, **p.op_kwargs())
    base = materialized_baseline(p.hidden, p.weight, p.targets, **grads, **p.op_kwargs())
    for name, got in (("grad_hidden", p.hidden.grad), ("grad_weight", p.weight.grad)):
        assert_close(got, truth[name], baseline=base[name], name=f"{name}[{mix}]", **tol.kwargs())


def test_per_token_upstream_gradient_is_not_a_scalar():
    """Two upstream gradients with the same sum but different rows give different gradients."""
    p = make_problem(8, 16, 97, seed=1)
    grads = []
    for g in (torch.ones(8), torch.arange(8.0) / 3.5):
        q = p.with_grad()
        linear_logprob(q.hidden, q.weight, q.targets).logprob.backward(g)
        truth = reference_all(q.hidden, q.weight, q.targets, grad_logprob=g)
        assert_close(q.hidden.grad, truth["grad_hidden"], rtol=1e-5, atol=1e-6, name="grad_hidden")
        grads.append(q.hidden.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_leading_dims_and_int32_targets(device, backend):
    p = make_problem((3, 5), 16, 101, device=device, seed=2, ignore_frac=0.2).with_grad()
    out = linear_logprob(p.hidden, p.weight, p.targets.int(), return_entropy=True, backend=backend)
    assert out.logprob.shape == (3, 5) and out.entropy.shape == (3, 5)
    truth = reference_all(
        p.hidden, p.weight, p.targets, grad_logprob=torch.ones(3, 5, device=device)
    )
    out.logprob.sum().backward()
    assert_close(out.logprob, truth["logprob"], rtol=1e-5, atol=1e-5, name="logprob")
    assert_close(p.hidden.grad, truth["grad_hidden"], rtol=1e-5, atol=1e-6, name="grad_hidden")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_empty_input(device, backend, deterministic):
    p = make_problem(0, 8, 31, device=device).with_grad()
    out = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic,
    )  # fmt: skip
    assert out.logprob.shape == (0,) and out.entropy.shape == (0,) and out.lse.shape == (0,)
    (out.logprob.sum() + out.entropy.sum()).backward()
    assert p.hidden.grad.shape == (0, 8)
    assert torch.equal(p.weight.grad, torch.zeros_like(p.weight))


def test_chunk_size_not_dividing_n(device, backend):
    p = make_problem(53, 16, 211, device=device, seed=7, ignore_frac=0.1, padded_vocab=224)
    for chunk in (1, 7, 52, 53, 1000):
        _check(p, DTYPES[0], entropy=True, lse=True, chunk_size=chunk, backend=backend)


def test_extreme_logits_stay_exact(backend):
    """|z| ~ 1e4: the entropy is built from z - max, so nothing cancels catastrophically."""
    p = make_problem(9, 8, 53, seed=4, scale=2e4)
    tol = DTYPES[0]
    _check(p, tol, entropy=True, lse=True, backend=backend)


def test_large_split_and_chunk_counts(device, backend):
    """V spanning several vocabulary splits and backward chunks of every backend config."""
    p = make_problem(
        40, 24, 5003, device=device, seed=8, ignore_frac=0.1, padded_vocab=5120, temperature=1.1
    )
    _check(p, DTYPES[0], entropy=True, lse=True, backend=backend)


@pytest.mark.parametrize("tol", DTYPES, ids=str)
def test_targets_in_few_tiles_and_no_ignored_rows(tol, device, backend):
    """Targets only among the first 37 columns and no ignored rows: most logit tiles hold
    no row's target and most row blocks no dead row (the triton backend's d_logits skips
    its one-hot add and its zeroing select there), while the rows past N and the last,
    partial vocabulary tile still need the select."""
    import dataclasses

    p = make_problem(
        133, 16, 1031, dtype=tol.dtype, device=device, seed=11, padded_vocab=1152,
        temperature=0.8,
    )  # fmt: skip
    p = dataclasses.replace(p, targets=p.targets % 37)
    _check(p, tol, entropy=True, lse=True, backend=backend)
