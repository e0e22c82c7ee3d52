"""``lp_kernels.losses``: values and gradients against formulas written here in float64.

The references below are written from the papers' formulas (the min/clip form of PPO, the
definition of each KL estimator, the aggregation modes as explicit loops), not from the
module's algebra, so a slip in either shows up as a mismatch.
"""

from __future__ import annotations

import doctest
import math
import typing

import pytest
import torch

from lp_kernels import losses
from lp_kernels.losses import (
    PolicyLoss,
    clipped_surrogate,
    dapo,
    dr_grpo,
    grpo,
    kl_k1,
    kl_k2,
    kl_k3,
    ppo,
    token_weights,
)

F64 = torch.float64
MODES = typing.get_args(losses.AggregationMode)


def _log_ratios(n: int, seed: int) -> torch.Tensor:
    """``[n]`` float64 log-ratios: mostly near 0, some past the clip bounds, some extreme."""
    g = torch.Generator().manual_seed(seed)
    x = 0.3 * torch.randn(n, generator=g, dtype=F64)
    extreme = torch.tensor([-50.0, -25.0, -20.5, -3.0, 3.0, 20.5, 25.0, 50.0], dtype=F64)
    x[: len(extreme)] = extreme
    return x


def _advantages(n: int, seed: int) -> torch.Tensor:
    """``[n]`` float64 advantages of both signs, with some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g, dtype=F64)
    a[::7] = 0.0
    a[1::2] = -a[1::2].abs()  # both signs at every magnitude, including on the extremes
    a[::2] = a[::2].abs()
    return a


# ---------------------------------------------------------------------------- references
def _ref_k3(lp, ref, max_log_ratio=20.0, max_kl=10.0):
    d = ref - lp
    if max_log_ratio is not None:
        d = torch.clamp(d, -max_log_ratio, max_log_ratio)
    v = torch.exp(d) - d - 1
    return v if max_kl is None else torch.clamp(v, -max_kl, max_kl)


def _ref_surrogate(lp, old, adv, lo, hi, dual=None, max_log_ratio=20.0):
    """``-min(r A, clip(r) A)``, then ``min(., -c A)`` where ``A < 0``: the papers' form."""
    lr = lp - old
    if max_log_ratio is not None:
        lr = torch.clamp(lr, -max_log_ratio, max_log_ratio)
    r = torch.exp(lr)
    loss = -torch.minimum(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv)
    if dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual * adv), loss)
    return loss


def _ref_surrogate_grad(lp, old, adv, lo, hi, dual=None, max_log_ratio=20.0):
    """``-A r`` where the unclipped branch is the one taken (bounds inclusive), else 0."""
    lr = lp - old
    r = torch.exp(lr)
    unclipped = r * adv <= torch.clamp(r, 1 - lo, 1 + hi) * adv  # min picks r A
    if dual is not None:
        unclipped &= ~((adv < 0) & (r > dual))
    if max_log_ratio is not None:
        unclipped &= lr.abs() < max_log_ratio  # clamp: no gradient at or past the limit
    return torch.where(unclipped, -adv * r, 0.0)


def _central_difference(f, x, h=1e-6):
    """Elementwise d f / d x of an elementwise ``f`` (one evaluation per side for all rows)."""
    return (f(x + h) - f(x - h)) / (2 * h)


# ------------------------------------------------------------------------- building blocks
def test_kl_estimators_match_their_definitions():
    n = 301
    ref = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(1)) - 2.0
    lp = ref + _log_ratios(n, 2)
    assert torch.equal(kl_k1(lp, ref), lp - ref)
    torch.testing.assert_close(kl_k2(lp, ref), (lp - ref) ** 2 / 2, rtol=1e-15, atol=0)
    torch.testing.assert_close(kl_k3(lp, ref), _ref_k3(lp, ref), rtol=1e-12, atol=1e-15)
    unclamped = kl_k3(lp, ref, max_log_ratio=None, max_kl=None)
    torch.testing.assert_close(unclamped, _ref_k3(lp, ref, None, None), rtol=1e-12, atol=1e-15)
    assert unclamped.max() > 1e20 and (unclamped >= 0).all()  # exp(50): the clamps matter
    assert kl_k3(lp, ref).max() == 10.0
    # the clamps' inputs: d = 25 and -25 are evaluated at +-20
    d = torch.tensor([25.0, -25.0], dtype=F64)
    assert torch.equal(
        kl_k3(-d, torch.zeros(2, dtype=F64), max_kl=None), _ref_k3(-d, 0 * d, 20.0, None)
    )


def test_kl_k3_keeps_relative_accuracy_near_zero_in_fp32():
    """``exp(d) - d - 1`` cancels near 0; ours stays within a few ulp (value and gradient)."""
    d = torch.cat([torch.logspace(-8, 1, 300, dtype=F64), -torch.logspace(-8, 1, 300, dtype=F64)])
    d = d.float().double()  # the fp32 inputs, exactly
    truth = torch.expm1(d) - d  # fp64: relative error ~1e-16 / d, far below fp32 rounding
    truth[d.abs() < 1e-5] = (d**2 / 2 + d**3 / 6)[d.abs() < 1e-5]
    lp = torch.zeros_like(d, dtype=torch.float32, requires_grad=True)
    ours = kl_k3(lp, d.float(), max_log_ratio=None, max_kl=None)
    ours.sum().backward()
    naive = (torch.exp(d.float()) - d.float() - 1).double()
    rel = ((ours.double() - truth) / truth).abs()
    assert rel.max() < 1e-6, f"worst at d={d[rel.argmax()].item()}: {rel.max().item()}"
    assert ((naive - truth) / truth).abs().max() > 0.5  # the baseline this guards against
    grad_truth = -torch.expm1(d)
    grad_rel = ((lp.grad.double() - grad_truth) / grad_truth).abs()
    assert grad_rel.max() < 1e-6, f"worst at d={d[grad_rel.argmax()].item()}"


SURROGATE_CASES = {
    "symmetric": (0.2, 0.2, None, 20.0),
    "clip-higher": (0.2, 0.28, None, 20.0),
    "dual-clip": (0.1, 0.3, 3.0, 20.0),
    "zero-clip": (0.0, 0.0, None, 20.0),
    "dual-and-no-log-clamp": (0.2, 0.2, 1.5, None),
}


@pytest.mark.parametrize("case", SURROGATE_CASES.values(), ids=SURROGATE_CASES.keys())
def test_clipped_surrogate_matches_min_clip_form(case):
    lo, hi, dual, mlr = case
    n = 257
    old = -torch.rand(n, dtype=F64, generator=torch.Generator().manual_seed(3)) * 5
    lp, adv = old + _log_ratios(n, 4), _advantages(n, 5)
    ours = clipped_surrogate(lp, old, adv, lo, hi, dual, max_log_ratio=mlr)
    torch.testing.assert_close(ours, _ref_surrogate(lp, old, adv, lo, hi, dual, mlr))
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("case", SURROGATE_CASES.values(), ids=SURROGATE_CASES.keys())
def test_clipped_surrogate_gradient(case):
    """``-A r`` inside the trust region, 0 where clipped: closed form and finite differences."""
    lo, hi, dual, mlr = case
    n = 257
    old = -torch.rand(n, dtype=F64, generator=torch.Generator().manual_seed(6)) * 5
    lr, adv = _log_ratios(n, 7), _advantages(n, 8)
    lp = (old + lr).requires_grad_()
    clipped_surrogate(lp, old, adv, lo, hi, dual, max_log_ratio=mlr).sum().backward()
    closed = _ref_surrogate_grad(lp.detach(), old, adv, lo, hi, dual, mlr)
    torch.testing.assert_close(lp.grad, closed, rtol=1e-12, atol=0)
    assert (closed == 0).any() and (closed != 0).any()  # both regimes are exercised
    # finite differences, away from the kinks (a clip bound or the log-ratio clamp)
    r = lr.exp()
    kinks = torch.tensor([1 - lo, 1 + hi] + ([dual] if dual else []), dtype=F64)
    smooth = ((r[:, None] - kinks).abs().min(dim=1).values > 1e-4) & (lr.abs() < 19)
    fd = _central_difference(lambda x: clipped_surrogate(x, old, adv, lo, hi, dual), lp.detach())
    torch.testing.assert_close(lp.grad[smooth], fd[smooth], rtol=1e-6, atol=1e-8)


def test_clipped_surrogate_at_exact_bounds_is_unclipped():
    """Ratios exactly on ``1 - lo``, ``1 + hi`` and the dual clip: inclusive bounds."""
    r = torch.tensor([1.25, 0.75, 3.5], dtype=F64)
    lr = torch.log(r)
    exact = torch.exp(lr)  # the ratios the function will see, bit for bit
    hi, lo, dual = exact[0].item() - 1, 1 - exact[1].item(), exact[2].item()  # Sterbenz: exact
    assert 1 + hi == exact[0].item() and 1 - lo == exact[1].item()
    adv = torch.tensor([2.0, -2.0, -2.0], dtype=F64)
    lp = lr.clone().requires_grad_()
    loss = clipped_surrogate(lp, torch.zeros(3, dtype=F64), adv, lo, hi, dual)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), -adv * exact, rtol=0, atol=0)
    torch.testing.assert_close(lp.grad, -adv * exact, rtol=0, atol=0)
    # clip 0: log-ratio 0 sits on both bounds at once; the gradient is the policy gradient
    z = torch.zeros(2, dtype=F64, requires_grad=True)
    a = torch.tensor([1.5, -1.5], dtype=F64)
    clipped_surrogate(z, torch.zeros(2, dtype=F64), a, 0.0, 0.0).sum().backward()
    assert torch.equal(z.grad, -a)


# ------------------------------------------------------------------------------ PolicyLoss
def _policy_inputs(n: int, seed: int, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, dtype=F64, generator=g) * 5
    lp = old + _log_ratios(n, seed + 1)
    ref = lp + torch.randn(n, dtype=F64, generator=g)  # some |d| > 2.4: k3 clamped at 10
    ref[:4] = lp[:4] + torch.tensor([30.0, -30.0, 0.0, 1e-9], dtype=F64)
    per_token = {
        "old_logprob": old,
        "advantages": _advantages(n, seed + 2),
        "weights": torch.rand(n, dtype=F64, generator=g),
        "ref_logprob": ref,
    }
    entropy = torch.rand(n, dtype=F64, generator=g) * 3
    lse = torch.randn(n, dtype=F64, generator=g) * 4
    cast = lambda t: t.to(dtype)
    return cast(lp), cast(entropy), cast(lse), {k: cast(v) for k, v in per_token.items()}


LOSS_CASES = {
    "k1": PolicyLoss(kl_coef=0.1, kl_estimator="k1"),
    "k2": PolicyLoss(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01),
    "k3": PolicyLoss(kl_coef=0.04, kl_estimator="k3", z_loss_coef=1e-3),
    "every-option": PolicyLoss(
        clip_low=0.1,
        clip_high=0.3,
        dual_clip=2.5,
        kl_coef=0.2,
        kl_estimator="k3",
        entropy_coef=-0.02,
        z_loss_coef=1e-2,
        max_log_ratio=15.0,
        max_kl=5.0,
    ),
}


@pytest.mark.parametrize("loss_fn", LOSS_CASES.values(), ids=LOSS_CASES.keys())
def test_policy_loss_value_and_gradients(loss_fn):
    lp, entropy, lse, pt = _policy_inputs(193, 10)
    lp, entropy, lse = (t.requires_grad_() for t in (lp, entropy, lse))
    out = loss_fn(lp, entropy, lse, **pt)
    out.sum().backward()
    c = loss_fn
    w, adv, old, ref = pt["weights"], pt["advantages"], pt["old_logprob"], pt["ref_logprob"]
    x, d = lp.detach(), ref - lp.detach()
    dcl = torch.clamp(d, -c.max_log_ratio, c.max_log_ratio)
    kl, dkl = {
        "k1": (x - ref, torch.ones_like(x)),
        "k2": ((x - ref) ** 2 / 2, x - ref),
        "k3": (
            torch.clamp(torch.exp(dcl) - dcl - 1, -c.max_kl, c.max_kl),
            torch.where(
                (d.abs() < c.max_log_ratio) & (torch.exp(dcl) - dcl - 1 < c.max_kl),
                1 - torch.exp(d),
                0.0,
            ),
        ),
    }[c.kl_estimator]
    surrogate = _ref_surrogate(x, old, adv, c.clip_low, c.clip_high, c.dual_clip, c.max_log_ratio)
    value = w * (
        surrogate + c.kl_coef * kl - c.entropy_coef * entropy.detach() + c.z_loss_coef * lse**2
    )
    torch.testing.assert_close(out.detach(), value, rtol=1e-12, atol=1e-14)
    args = (x, old, adv, c.clip_low, c.clip_high, c.dual_clip, c.max_log_ratio)
    d_lp = w * (_ref_surrogate_grad(*args) + c.kl_coef * dkl)
    torch.testing.assert_close(lp.grad, d_lp, rtol=1e-10, atol=1e-14)
    # an input the loss does not use gets no gradient at all (None), not zeros
    assert (entropy.grad is None) == (c.entropy_coef == 0)
    assert (lse.grad is None) == (c.z_loss_coef == 0)
    if c.entropy_coef:
        torch.testing.assert_close(entropy.grad, -c.entropy_coef * w, rtol=1e-15, atol=0)
    if c.z_loss_coef:
        d_lse = 2 * c.z_loss_coef * w * lse.detach()
        torch.testing.assert_close(lse.grad, d_lse, rtol=1e-14, atol=0)


def test_policy_loss_gradcheck_in_the_smooth_region():
    """torch.autograd.gradcheck (finite differences) where no clip or clamp is near."""
    g = torch.Generator().manual_seed(20)
    n = 24
    old = -torch.rand(n, dtype=F64, generator=g) * 3
    lp = (old + 0.05 * torch.randn(n, dtype=F64, generator=g)).requires_grad_()
    ent = torch.rand(n, dtype=F64, generator=g).requires_grad_()
    lse = torch.randn(n, dtype=F64, generator=g).requires_grad_()
    pt = {"old_logprob": old, "advantages": torch.randn(n, dtype=F64, generator=g)}
    pt |= {"weights": torch.rand(n, dtype=F64, generator=g), "ref_logprob": old + 0.1}
    loss_fn = PolicyLoss(kl_coef=0.3, entropy_coef=0.05, z_loss_coef=0.01)
    assert torch.autograd.gradcheck(lambda a, b, c: loss_fn(a, b, c, **pt), (lp, ent, lse))


def test_on_policy_old_logprob_none_is_the_policy_gradient():
    lp, entropy, lse, pt = _policy_inputs(64, 30)
    adv, w = pt["advantages"], pt["weights"]
    lp.requires_grad_()
    out = dapo()(lp, entropy, lse, advantages=adv, weights=w)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), -adv * w, rtol=0, atol=0)  # ratio exactly 1
    torch.testing.assert_close(lp.grad, -adv * w, rtol=0, atol=0)
    same = dapo()(lp, entropy, lse, old_logprob=lp.detach(), advantages=adv, weights=w)
    assert torch.equal(out, same)


def test_unweighted_loss_is_the_bare_token_loss():
    lp, entropy, lse, pt = _policy_inputs(32, 40)
    pt.pop("weights")
    unweighted = grpo()(lp, entropy, lse, **pt)
    ones = grpo()(lp, entropy, lse, weights=torch.ones_like(lp), **pt)
    assert torch.equal(unweighted, ones)


def test_named_constructors_defaults_and_overrides():
    assert grpo() == PolicyLoss(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_estimator="k3")
    assert dapo() == PolicyLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    assert dr_grpo() == PolicyLoss(clip_low=0.2, clip_high=0.2, kl_coef=0.0)
    assert ppo() == PolicyLoss(clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0)
    assert ppo(0.1, dual_clip=3.0) == PolicyLoss(clip_low=0.1, clip_high=0.1, dual_clip=3.0)
    assert grpo(clip=0.3, clip_high=0.4, kl_estimator="k2") == PolicyLoss(
        clip_low=0.3, clip_high=0.4, kl_coef=0.04, kl_estimator="k2"
    )
    assert dapo(entropy_coef=0.01).needs_entropy and not dapo().needs_entropy
    assert dr_grpo(z_loss_coef=1e-4).z_loss_coef == 1e-4
    assert all(f().max_log_ratio == 20.0 and f().max_kl == 10.0 for f in (grpo, dapo, ppo))
    with pytest.raises(AttributeError):
        grpo().kl_coef = 0.0  # frozen


# --------------------------------------------------------------------------- token_weights
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],  # empty: weight 0, counted nowhere
        [1, 0, 0, 0, 0],
        [1, 1, 0, 1, 1],  # a hole inside the completion
    ]
)


def _aggregate_by_loops(x, mask, mode, max_tokens=None):
    """The modes' definitions, as nested Python loops over plain floats."""
    rows = [
        [(float(x[b, t]), bool(mask[b, t])) for t in range(mask.shape[1])]
        for b in range(mask.shape[0])
    ]
    sums = [sum(v for v, m in row if m) for row in rows]
    lens = [sum(1 for _, m in row if m) for row in rows]
    nonempty = [b for b in range(len(rows)) if lens[b] > 0]
    if mode == "token-mean":
        return sum(sums) / sum(lens)
    if mode == "seq-mean-token-mean":
        return sum(sums[b] / lens[b] for b in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sums[b] for b in nonempty) / len(nonempty)
    return sum(sums) / ((max_tokens or mask.shape[1]) * len(rows))


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool, torch.float32])
def test_token_weights_by_hand(mask_dtype):
    m = MASK.to(mask_dtype)
    third = 1 / 3
    expected = {
        "token-mean": MASK / 8,
        "seq-mean-token-mean": torch.tensor(
            [[third] * 3 + [0, 0], [0] * 5, [1, 0, 0, 0, 0], [0.25, 0.25, 0, 0.25, 0.25]]
        )
        / 3,
        "seq-mean-token-sum": MASK / 3,
        "seq-mean-token-sum-norm": MASK / (5 * 4),
    }
    for mode, want in expected.items():
        w = token_weights(m, mode)
        assert w.dtype == torch.float32 and w.shape == MASK.shape
        torch.testing.assert_close(w, want.float(), rtol=1e-7, atol=0, msg=mode)
    w = token_weights(m, "seq-mean-token-sum-norm", max_tokens=8)
    torch.testing.assert_close(w, MASK / 32.0)


@pytest.mark.parametrize("mode", MODES)
def test_token_weights_realize_each_mode(mode):
    x = torch.randn(MASK.shape, dtype=F64, generator=torch.Generator().manual_seed(50))
    x[MASK == 0] = 1e6  # tokens that do not count must not leak in
    max_tokens = 7 if mode == "seq-mean-token-sum-norm" else None
    w = token_weights(MASK, mode, max_tokens=max_tokens).double()
    want = _aggregate_by_loops(x, MASK, mode, max_tokens)
    assert math.isclose((w * x).sum().item(), want, rel_tol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_token_weights_global_counts_split_a_batch(mode):
    """Two micro-batches weighted by the whole batch's counts sum to the whole batch's value
    (for seq-mean-token-mean, each sequence keeps its own length)."""
    x = torch.randn(MASK.shape, dtype=F64, generator=torch.Generator().manual_seed(51))
    whole = (token_weights(MASK, mode).double() * x).sum()
    if mode == "token-mean":
        kw = {"global_tokens": int(MASK.sum())}
    elif mode == "seq-mean-token-sum-norm":
        kw = {"global_sequences": MASK.shape[0]}
    else:
        kw = {"global_sequences": torch.tensor(3)}  # a tensor count (e.g. an all_reduce)
    parts = sum(
        (token_weights(MASK[s], mode, **kw).double() * x[s]).sum()
        for s in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=0)


def test_token_weights_of_an_empty_batch_are_zero():
    for mode in MODES:
        w = token_weights(torch.zeros(3, 4, dtype=torch.bool), mode)
        assert torch.equal(w, torch.zeros(3, 4)), mode
        assert torch.equal(token_weights(torch.ones(0, 0), mode), torch.zeros(0, 0)), mode


# ---------------------------------------------------------------------------------- errors
BAD_OPTIONS = [
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_low": -0.1}, "clip_low"),
    ({"clip_low": True}, "clip_low"),
    ({"clip_high": -0.01}, "clip_high"),
    ({"clip_high": float("inf")}, "clip_high"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"dual_clip": 0.5}, "dual_clip"),
    ({"kl_coef": -0.1}, "kl_coef"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"entropy_coef": float("nan")}, "entropy_coef"),
    ({"z_loss_coef": -1e-3}, "z_loss_coef"),
    ({"max_log_ratio": 0.0}, "max_log_ratio"),
    ({"max_kl": -1.0}, "max_kl"),
]


@pytest.mark.parametrize("kw,field", BAD_OPTIONS, ids=[f"{f}={kw[f]}" for kw, f in BAD_OPTIONS])
def test_bad_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        PolicyLoss(**kw)


def test_missing_inputs_at_call_time():
    lp, entropy, lse, pt = _policy_inputs(8, 60, torch.float32)
    adv = pt["advantages"]
    with pytest.raises(ValueError, match="ref_logprob"):
        grpo()(lp, entropy, lse, advantages=adv)
    with pytest.raises(ValueError, match="return_entropy=True"):
        dapo(entropy_coef=0.01)(lp, None, lse, advantages=adv)
    with pytest.raises(ValueError, match="lse"):
        dapo(z_loss_coef=0.01)(lp, entropy, None, advantages=adv)
    with pytest.raises(ValueError, match="advantages has shape"):
        dapo()(lp, entropy, lse, advantages=adv[:4])
    dapo()(lp, None, None, advantages=adv)  # nothing optional needed: entropy, lse unused


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"mode": "token-sum"}, "mode"),
        ({"mode": "token-mean", "max_tokens": 4}, "max_tokens"),
        ({"mode": "seq-mean-token-sum-norm", "max_tokens": 0}, "max_tokens"),
        ({"mode": "seq-mean-token-mean", "global_tokens": 10}, "global_tokens"),
        ({"mode": "token-mean", "global_sequences": 2}, "global_sequences"),
        ({"mode": "token-mean", "global_tokens": -1}, "global_tokens"),
        ({"mode": "seq-mean-token-sum", "global_sequences": 2.5}, "global_sequences"),
    ],
)
def test_token_weights_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        token_weights(MASK, **kw)


def test_token_weights_needs_a_2d_mask():
    with pytest.raises(ValueError, match="mask"):
        token_weights(MASK.flatten(), "token-mean")


# ------------------------------------------------------------------- the op's contract
EVERY_LOSS = {
    "grpo": grpo(entropy_coef=0.01, z_loss_coef=1e-4),
    "dapo": dapo(),
    "dr_grpo": dr_grpo(),
    "ppo-dual": ppo(dual_clip=3.0, kl_coef=0.1, kl_estimator="k2"),
    "every-option": LOSS_CASES["every-option"],
}


@pytest.mark.parametrize("loss_fn", EVERY_LOSS.values(), ids=EVERY_LOSS.keys())
def test_finite_at_all_zero_inputs(loss_fn):
    """Ignored rows: logprob = entropy = lse = 0 and every per-token value 0."""
    lp, ent, lse = (torch.zeros(5, requires_grad=True) for _ in range(3))
    pt = {k: torch.zeros(5) for k in ("old_logprob", "advantages", "weights", "ref_logprob")}
    out = loss_fn(lp, ent, lse, **pt)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(5))
    assert lp.grad is not None
    for t in (lp, ent, lse):
        assert t.grad is None or torch.isfinite(t.grad).all()


@pytest.mark.parametrize("loss_fn", EVERY_LOSS.values(), ids=EVERY_LOSS.keys())
def test_elementwise_halves_concatenate(loss_fn):
    """Rows do not see each other: the op may cut the rows into any chunks (fp32, as the op
    calls it; values and gradients bitwise)."""
    lp, ent, lse, pt = _policy_inputs(203, 70, torch.float32)
    pt["advantages"] = pt["advantages"].bfloat16()  # per-token tensors may be any dtype

    def run(rows):
        leaves = [t[rows].clone().requires_grad_() for t in (lp, ent, lse)]
        out = loss_fn(*leaves, **{k: v[rows] for k, v in pt.items()})
        out.sum().backward()
        return [out.detach()] + [t.grad for t in leaves if t.grad is not None]

    whole = run(slice(None))
    halves = [run(slice(0, 77)), run(slice(77, None))]
    for i, got in enumerate(whole):
        assert torch.equal(got, torch.cat([h[i] for h in halves])), i
    assert whole[0].dtype == torch.float32


CLOSED_FORM = EVERY_LOSS | {
    "k1": LOSS_CASES["k1"],
    "k2-no-clamps": PolicyLoss(kl_coef=0.1, kl_estimator="k2", max_log_ratio=None, max_kl=None),
    "k3-no-clamps": grpo(max_log_ratio=None, max_kl=None, entropy_coef=0.3),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("loss_fn", CLOSED_FORM.values(), ids=CLOSED_FORM.keys())
def test_value_and_grad_is_autograd_through_the_call(loss_fn, weighted, on_policy, dtype):
    """The closed form that linear_logprob_loss uses instead of autograd: the same loss
    bits, and autograd's derivatives (None where autograd gives None) up to rounding, on
    inputs that cross every clip and clamp (some rows sit exactly on a ratio bound)."""
    lp, ent, lse, pt = _policy_inputs(257, 80, dtype)
    if on_policy:
        pt.pop("old_logprob")
    else:  # ratios exactly on 1 + clip_high and 1 - clip_low (where dual clip allows)
        bounds = (1 + loss_fn.clip_high, 1 - loss_fn.clip_low)
        pt["old_logprob"][4:6] = lp[4:6] - torch.log(torch.tensor(bounds, dtype=dtype))
        pt["advantages"][4:6] = torch.tensor([1.0, -1.0], dtype=dtype)
    if not weighted:
        pt.pop("weights")
    leaves = [t.clone().requires_grad_() for t in (lp, ent, lse)]
    out = loss_fn(*leaves, **pt)
    auto = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    value, grads = loss_fn.value_and_grad(lp, ent, lse, **pt)
    assert torch.equal(value, out.detach())
    tol = {"rtol": 1e-12, "atol": 1e-14} if dtype == F64 else {"rtol": 2e-6, "atol": 1e-7}
    for name, a, g in zip(("logprob", "entropy", "lse"), auto, grads, strict=True):
        assert (a is None) == (g is None), name
        if a is not None:
            assert g.dtype == dtype
            torch.testing.assert_close(g, a, **tol, msg=name)


def test_value_and_grad_at_all_zero_inputs_is_finite():
    """Ignored rows reach value_and_grad as zeros too."""
    for loss_fn in CLOSED_FORM.values():
        z = torch.zeros(5)
        pt = {k: torch.zeros(5) for k in ("old_logprob", "advantages", "weights", "ref_logprob")}
        value, grads = loss_fn.value_and_grad(z, z, z, **pt)
        assert torch.equal(value, torch.zeros(5))
        assert all(g is None or torch.isfinite(g).all() for g in grads)


def test_module_docstring_example_runs():
    result = doctest.testmod(losses, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
