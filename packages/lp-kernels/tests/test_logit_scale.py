"""``logit_scale``: a multiplier of the raw logits before the softcap and the temperature
(Granite's ``1 / logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's
``lm_head_multiplier``), ``z = c tanh(s (h W^T + b) / c) / T``, in every op and backend
against fp64, under tensor parallelism, and in the per-call rank contract.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob, linear_logprob_loss, vocab_parallel_logprob
from lp_kernels.losses import dapo
from lp_testing import (
    RankError,
    assert_bitwise_equal,
    assert_close,
    assert_zero,
    make_problem,
    reference_all,
    reference_from_logits,
    run_ranks,
)

OPTION_SETS = {
    "scale": {"logit_scale": 0.25},
    "scale-cap-bias": {"logit_scale": 2.5, "softcap": 5.0, "bias": True},
}


def _upstream(n: int):
    g = torch.linspace(-1, 1, n)
    return g, g.flip(0), torch.full((n,), 0.3)


def _bias(problem):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(problem.weight.shape[0], generator=gen).to(problem.weight.dtype)


def _run(problem, *, bias=None, device="cpu", **options):
    """Outputs and gradients of one call with every output used (fixed upstream)."""
    h = problem.hidden.detach().clone().to(device).requires_grad_()
    w = problem.weight.detach().clone().to(device).requires_grad_()
    targets = problem.targets.to(device)
    extra = {}
    if bias is not None:
        extra["bias"] = bias.detach().clone().to(device).requires_grad_()
    out = linear_logprob(h, w, targets, return_entropy=True, return_lse=True, **extra, **options)
    g_lp, g_ent, g_lse = (g.to(device) for g in _upstream(targets.numel()))
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    got = {"logprob": out.logprob, "entropy": out.entropy, "lse": out.lse}
    got |= {"grad_hidden": h.grad, "grad_weight": w.grad}
    if bias is not None:
        got["grad_bias"] = extra["bias"].grad
    return {name: value.cpu() for name, value in got.items()}


def _truth(problem, *, bias=None, **options):
    g_lp, g_ent, g_lse = _upstream(problem.n)
    return reference_all(
        problem.hidden, problem.weight, problem.targets, grad_logprob=g_lp, grad_entropy=g_ent,
        grad_lse=g_lse, bias=bias, **options, **problem.op_kwargs(),
    )  # fmt: skip


def _check(got, truth, tol, problem):
    for name, value in got.items():
        atol = tol * float(truth[name].abs().max()) + 1e-12
        assert_close(value, truth[name], rtol=tol, atol=atol, name=f"{name} vs fp64")
    for name in ("logprob", "entropy", "lse", "grad_hidden"):
        assert_zero(got[name], where=problem.ignored, name=f"{name} on ignored rows")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_matches_fp64(options, dtype, deterministic, device, backend):
    """Every output and gradient (bias included) against fp64 on a prime shape with padding,
    ignored rows and a temperature; and the scale changes the answer."""
    p = make_problem(
        37, 64, 1009, dtype=dtype, padded_vocab=1024, ignore_frac=0.2, temperature=0.7, seed=21
    )
    opts = dict(options)
    bias = _bias(p) if opts.pop("bias", False) else None
    got = _run(
        p, bias=bias, device=device, backend=backend, deterministic=deterministic,
        **opts, **p.op_kwargs(),
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    truth = _truth(p, bias=bias, **opts)
    _check(got, truth, tol, p)
    unscaled = _truth(p, bias=bias, **{k: v for k, v in opts.items() if k != "logit_scale"})
    assert float((unscaled["logprob"] - truth["logprob"]).abs().max()) > 10 * tol


def test_one_is_the_default_path(backend):
    """``logit_scale=1.0`` is no scale at all: bitwise the call without it."""
    p = make_problem(29, 32, 500, ignore_frac=0.2, temperature=0.9, seed=22)
    for deterministic in (False, True):
        base = _run(p, backend=backend, deterministic=deterministic, **p.op_kwargs())
        one = _run(
            p, backend=backend, deterministic=deterministic, logit_scale=1.0, **p.op_kwargs()
        )
        for name in base:
            assert_bitwise_equal(one[name], base[name], name)


def test_the_scale_multiplies_the_raw_logits_before_the_cap(backend):
    """``logit_scale=s`` with a bias and a cap equals the call on ``s W`` and ``s b`` (fp32,
    to rounding): the scale applies to the raw logits, before the cap."""
    p = make_problem(31, 48, 700, ignore_frac=0.1, temperature=0.8, seed=23)
    b, s = _bias(p), 0.375  # exact in binary: s W is the same products, scaled
    opts = {"backend": backend, "softcap": 4.0, **p.op_kwargs()}
    scaled = linear_logprob(p.hidden, p.weight, p.targets, bias=b, logit_scale=s, **opts)
    folded = linear_logprob(p.hidden, p.weight * s, p.targets, bias=b * s, **opts)
    assert_close(scaled.logprob, folded.logprob, rtol=1e-5, atol=1e-5, name="logprob")


def test_loss_op_matches_the_composed_path(backend):
    """``linear_logprob_loss`` (gradients finished in its forward, on the kept logits) equals
    ``linear_logprob`` + the same loss through autograd, with a scale, a cap and a bias."""
    p = make_problem(41, 64, 1009, ignore_frac=0.2, temperature=0.8, seed=24)
    b = _bias(p)
    loss_fn = dapo(kl_coef=0.04, entropy_coef=1e-3)
    old = -torch.rand(p.n) * 5
    per_token = {"old_logprob": old, "ref_logprob": old - 0.1, "advantages": torch.randn(p.n)}
    opts = {"backend": backend, "logit_scale": 1.75, "softcap": 6.0, **p.op_kwargs()}
    leaves = [x.detach().clone().requires_grad_() for x in (p.hidden, p.weight, b)]
    fused = linear_logprob_loss(*leaves[:2], p.targets, loss_fn, per_token=per_token,
                                bias=leaves[2], **opts)  # fmt: skip
    fused.loss.backward()
    plain = [x.detach().clone().requires_grad_() for x in (p.hidden, p.weight, b)]
    out = linear_logprob(*plain[:2], p.targets, bias=plain[2], return_entropy=True,
                         return_lse=True, **opts)  # fmt: skip
    keep = p.targets != p.ignore_index
    zero = {k: torch.where(keep, v, 0.0) for k, v in per_token.items()}
    token = loss_fn(out.logprob, out.entropy, out.lse, **zero)
    torch.where(keep, token, 0.0).sum().backward()
    assert_close(fused.logprob, out.logprob, rtol=1e-6, atol=1e-6, name="logprob")
    for name, x, y in zip(("hidden", "weight", "bias"), leaves, plain, strict=True):
        scale = float(y.grad.abs().max())
        assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-5 * scale, name=f"grad_{name}")


def test_vocab_parallel_logprob_matches_fp64():
    """Logits the caller holds: the scale, then the cap, against fp64 (every output and the
    logits' gradient); with entries masked to -inf, logprob and its gradient (the fp64
    entropy of a masked row is 0 x -inf), and a finite entropy and gradient."""
    gen = torch.Generator().manual_seed(25)
    logits = torch.randn(19, 301, generator=gen) * 4
    targets = torch.randint(0, 301, (19,), generator=gen)
    targets[0] = -100
    g = torch.linspace(-1, 1, 19)
    masked = logits.clone()
    masked[3, 7] = float("-inf")
    masked[5, :150] = float("-inf")
    targets[5] = 200
    for opts in ({"logit_scale": 0.5}, {"logit_scale": 3.0, "softcap": 10.0}):
        x = logits.clone().requires_grad_()
        out = vocab_parallel_logprob(x, targets, return_entropy=True, temperature=0.9, **opts)
        (out.logprob * g + out.entropy * g.flip(0)).sum().backward()
        truth = reference_from_logits(
            logits, targets, grad_logprob=g, grad_entropy=g.flip(0), temperature=0.9, **opts
        )
        for name in ("logprob", "entropy"):
            assert_close(getattr(out, name), truth[name], rtol=1e-5, atol=1e-5, name=name)
        assert_close(x.grad, truth["grad_logits"], rtol=1e-5, atol=1e-6, name="grad_logits")
        x = masked.clone().requires_grad_()
        out = vocab_parallel_logprob(x, targets, return_entropy=True, temperature=0.9, **opts)
        (out.logprob * g).sum().backward()
        truth = reference_from_logits(masked, targets, grad_logprob=g, temperature=0.9, **opts)
        assert_close(out.logprob, truth["logprob"], rtol=1e-5, atol=1e-5, name="masked logprob")
        assert_close(x.grad, truth["grad_logits"], rtol=1e-5, atol=1e-6, name="masked grad")
        assert torch.isfinite(out.entropy).all()


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0.0, ValueError, "logit_scale must be None or finite and > 0, got 0.0"),
        (-2.0, ValueError, "logit_scale must be None or finite and > 0, got -2.0"),
        (math.inf, ValueError, "logit_scale must be None or finite and > 0, got inf"),
        (math.nan, ValueError, "logit_scale must be None or finite and > 0, got nan"),
        ("2", TypeError, "logit_scale must be None or a Python float, got str"),
        (True, TypeError, "logit_scale must be None or a Python float, got bool"),
        (torch.tensor(2.0), TypeError, "logit_scale must be None or a Python float, got Tensor"),
    ],
    ids=["zero", "negative", "inf", "nan", "str", "bool", "tensor"],
)
def test_bad_logit_scale_names_the_argument(value, error, match):
    h, w, t = torch.randn(3, 8), torch.randn(20, 8), torch.tensor([1, 2, 3])
    with pytest.raises(error, match=match):
        linear_logprob(h, w, t, logit_scale=value)
    with pytest.raises(error, match=match):
        linear_logprob_loss(h, w, t, lambda lp, ent, lse: -lp, logit_scale=value)
    with pytest.raises(error, match=match):
        vocab_parallel_logprob(torch.randn(3, 20), t, logit_scale=value)


def _tp_rank(rank, world, problem, backend, deterministic, scales):
    """One rank's shard of the head; ``scales``: each rank's ``logit_scale``."""
    v_local = problem.weight.shape[0] // world
    start = rank * v_local
    sub = dataclasses.replace(problem, weight=problem.weight[start : start + v_local])
    return _run(
        sub, backend=backend, tp_group=dist.group.WORLD, vocab_start=start,
        deterministic=deterministic, logit_scale=scales[rank], **problem.op_kwargs(),
    )  # fmt: skip


def test_tensor_parallel(backend):
    """TP 2 over gloo: every rank's outputs and grad_hidden are those of one process
    (bitwise with ``deterministic=True``), and ranks that disagree on the scale all raise."""
    p = make_problem(23, 32, 1024, ignore_frac=0.2, temperature=0.9, seed=26)
    for det in (False, True):
        ranks = run_ranks(_tp_rank, 2, p, backend, det, (1.5, 1.5), timeout=300)
        one = _run(p, backend=backend, deterministic=det, logit_scale=1.5, **p.op_kwargs())
        for name in ("logprob", "entropy", "lse", "grad_hidden"):
            assert_bitwise_equal(ranks[1][name], ranks[0][name], f"{name}: rank 1 vs 0")
            if det:
                assert_bitwise_equal(ranks[0][name], one[name], f"{name}: tp2 vs tp1")
            else:  # the partials merge in another order: fp32 rounding apart
                assert_close(ranks[0][name], one[name], rtol=1e-4, atol=1e-5, name=name)
        grad_w = torch.cat([r["grad_weight"] for r in ranks])
        if det:
            assert_bitwise_equal(grad_w, one["grad_weight"], "grad_weight: tp2 vs tp1")
        else:
            assert_close(grad_w, one["grad_weight"], rtol=1e-4, atol=1e-5, name="grad_weight")
    with pytest.raises(RankError) as info:
        run_ranks(_tp_rank, 2, p, backend, False, (1.5, 2.0), timeout=300)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and "disagree on logit_scale" in text
