"""``lp bench``'s ``trl`` provider (TRL's fused head; in distill mode its chunked divergence)
against the materialized path, on CPU, where TRL folds its tiles in torch. Runs in the
``adapters`` nox session, which installs TRL; skipped where TRL is not installed."""

from __future__ import annotations

import pytest
import torch

from lp_bench.distill import KINDS, DistillProblem, make_distill_provider, make_teacher
from lp_bench.protocol import loss_per_token, make_bias, make_inputs, policy_loss
from lp_bench.providers import LossProblem, make_provider, provider_available
from lp_testing.trainers import import_trainer

N, H, V = 37, 16, 1031  # V above no power of two: TRL's last vocabulary chunk is partial


def _leaves(dtype=torch.float32, bias=False):
    hidden, weight, targets, grad_out = make_inputs(N, H, V, device="cpu", dtype=dtype)
    b = make_bias(V, device="cpu", dtype=dtype) if bias else None
    leaves = [
        x.detach().clone().requires_grad_() for x in (hidden, weight) + ((b,) if bias else ())
    ]
    return leaves, targets, grad_out


def _run(name, mode, leaves, targets, grad_out, **options):
    prep = make_provider(name, mode=mode, entropy=True, **options)
    grad_entropy = torch.linspace(-0.5, 0.5, N)
    bias = leaves[2] if len(leaves) == 3 else None
    out = prep.step(*leaves[:2], targets, grad_out, grad_entropy, bias=bias)
    return out, [x.grad for x in leaves]


@pytest.mark.parametrize("options", [{}, {"softcap": 3.0, "bias": True, "temperature": 0.7}])
def test_trl_train_step_matches_the_materialized_path(options):
    import_trainer("trl")
    assert provider_available("trl", "cpu") is None
    got = _run("trl", "train", *_leaves(bias=options.get("bias", False)), **options)
    want = _run("materialized", "train", *_leaves(bias=options.get("bias", False)), **options)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_trl_loss_step_runs_the_loss_on_its_logprobs():
    import_trainer("trl")
    leaves, targets, _ = _leaves()
    per_token = loss_per_token(torch.randn(N) - 3.0)
    problem = LossProblem(policy_loss(False), per_token, N)
    got = make_provider("trl", mode="loss", loss=problem).step(*leaves, targets)
    ref_leaves, _, _ = _leaves()
    want = make_provider("materialized", mode="loss", loss=problem).step(*ref_leaves, targets)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for a, b in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-5, atol=2e-6)


def _distill_step(name: str, kind: str):
    """One distill step of provider ``name`` (teacher twice as wide, fp32):
    (divergence, grad_hidden, grad_weight)."""
    hidden, weight, _, grad_out = make_inputs(N, H, V, device="cpu", dtype=torch.float32)
    problem = DistillProblem(*make_teacher(hidden, weight, 2), kind=kind, beta=0.5)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    div, _ = make_distill_provider(name, problem).step(h, w, grad_out)
    return div, h.grad, w.grad


@pytest.mark.parametrize("kind", KINDS)
def test_trl_chunked_divergence_matches_the_materialized_path(kind):
    """TRL's ``ChunkedDivergenceFunction`` with the provider's beta mapping (0: forward KL,
    1: reverse KL, jsd: its beta) computes the materialized path's divergence and
    gradients."""
    import_trainer("trl")
    got, want = _distill_step("trl", kind), _distill_step("materialized", kind)
    assert float(want[0].min()) > 0.0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
