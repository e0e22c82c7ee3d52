"""Non-finite inputs and extreme logits.

The contract (docs/design.md, "Non-finite inputs"):

- a NaN or inf in a row's hidden state makes that row's outputs NaN (every field) and
  leaves every other row's outputs and grad_hidden rows bitwise unchanged;
- an ignored row is never read into an output or a grad_hidden row: it gives exact
  zeros even when its hidden state is NaN;
- a non-finite weight entry is in every row's softmax: every output is NaN;
- grad_weight sums over all rows, so a non-finite hidden row, ignored or not, makes it
  NaN, as in the materialized path (0 x NaN is NaN in any GEMM);
- logits that are all very negative (~ -1e4) stay exact.
"""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_logprob
from lp_testing import (
    assert_bitwise_equal,
    assert_close,
    make_problem,
    materialized_baseline,
    reference_all,
)

BAD = 3  # the row that receives a non-finite hidden value
IGN = 5  # an ignored row


def _run(p, hidden, *, backend, deterministic):
    h = hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    out = linear_logprob(
        h, w, p.targets, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic, **p.op_kwargs(),
    )  # fmt: skip
    g = torch.linspace(-1, 1, p.n, device=hidden.device)
    (out.logprob * g + out.entropy * g.flip(0) + 0.5 * out.lse).sum().backward()
    return out, h.grad, w.grad


def _problem(device="cpu"):
    p = make_problem(11, 16, 300, seed=5, padded_vocab=384, device=device)
    p.targets[IGN] = p.ignore_index
    return p


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_hidden_reaches_only_its_row(device, backend, deterministic, value):
    p = _problem(device)
    clean_out, clean_gh, _ = _run(p, p.hidden, backend=backend, deterministic=deterministic)
    hidden = p.hidden.clone()
    hidden[BAD, 2] = value
    out, gh, gw = _run(p, hidden, backend=backend, deterministic=deterministic)
    others = torch.tensor([i for i in range(p.n) if i != BAD], device=device)
    for name in ("logprob", "entropy", "lse"):
        got = getattr(out, name)
        assert torch.isnan(got[BAD]), f"{name}[{BAD}] = {float(got[BAD])}, expected NaN"
        assert_bitwise_equal(got[others], getattr(clean_out, name)[others], f"{name}, other rows")
    assert torch.isnan(gh[BAD]).all(), "grad_hidden of the non-finite row must be NaN"
    assert_bitwise_equal(gh[others], clean_gh[others], "grad_hidden, other rows")
    assert torch.isnan(gw).any(), "grad_weight sums over the non-finite row"


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_nan_in_an_ignored_row_stays_out_of_outputs_and_grad_hidden(device, backend, deterministic):
    p = _problem(device)
    clean_out, clean_gh, _ = _run(p, p.hidden, backend=backend, deterministic=deterministic)
    hidden = p.hidden.clone()
    hidden[IGN] = float("nan")
    out, gh, gw = _run(p, hidden, backend=backend, deterministic=deterministic)
    for name in ("logprob", "entropy", "lse"):
        assert_bitwise_equal(getattr(out, name), getattr(clean_out, name), name)
    assert_bitwise_equal(gh, clean_gh, "grad_hidden (ignored row exactly zero)")
    assert torch.equal(gh[IGN], torch.zeros_like(gh[IGN]))
    # documented: grad_weight = d_logits^T @ hidden meets the NaN (0 x NaN), as materialized
    assert torch.isnan(gw).any()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_non_finite_weight_makes_every_row_nan(device, backend, deterministic):
    p = _problem(device)
    weight = p.weight.clone()
    weight[17, 4] = float("nan")
    h = p.hidden.clone().requires_grad_()
    out = linear_logprob(
        h, weight, p.targets, return_entropy=True, backend=backend,
        deterministic=deterministic, **p.op_kwargs(),
    )  # fmt: skip
    live = p.targets != p.ignore_index
    assert torch.isnan(out.logprob[live]).all() and torch.isnan(out.entropy[live]).all()
    assert torch.equal(out.logprob[~live], torch.zeros_like(out.logprob[~live]))
    out.logprob.sum().backward()
    assert torch.isnan(h.grad[live]).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_all_logits_very_negative_stay_exact(device, backend, deterministic):
    """Every logit near -1e4 (a large shared offset): lse and entropy keep full accuracy."""
    p = make_problem(9, 16, 257, seed=6, device=device)
    p.hidden[:, 0] = 100.0
    p.weight[:, 0] = -100.0  # z = -1e4 + O(10) for every token and row
    g = torch.linspace(-1, 1, p.n, device=device)
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    out = linear_logprob(
        h, w, p.targets, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic,
    )  # fmt: skip
    assert float(out.lse.max()) < -9000
    (out.logprob * g + out.entropy + out.lse * g.flip(0)).sum().backward()
    upstream = {"grad_logprob": g, "grad_entropy": torch.ones_like(g), "grad_lse": g.flip(0)}
    truth = reference_all(p.hidden, p.weight, p.targets, **upstream)
    fp32 = materialized_baseline(p.hidden, p.weight, p.targets, **upstream)
    got = {
        "logprob": out.logprob, "entropy": out.entropy, "lse": out.lse,
        "grad_hidden": h.grad, "grad_weight": w.grad,
    }  # fmt: skip
    for name, x in got.items():
        # fp32 logits of magnitude 1e4 carry ~1e-3 absolute error whoever computes them, and
        # grad_hidden's column 0 (= -100 sum_v d l_v, which cancels to ~75) amplifies it:
        # lp stays within a small factor of the fp32 materialized path (measured 2.7x
        # there, from E being stored as an fp32 value near -1e4; 1x elsewhere)
        assert_close(x, truth[name], baseline=fp32[name], k=4.0, name=name)


@pytest.mark.parametrize("entropy", [False, True], ids=["logprob", "entropy"])
def test_merge_kernel_masks_its_outputs_like_masked_outputs(entropy, device):
    """The triton merge makes the op's outputs in its launch (``merge_outputs``): ignored
    rows exact +0.0 in every output, rows whose log-sum-exp is not finite NaN, the rest
    ``t - lse``, entropy and lse as the torch merge and ``masked_outputs`` give them.
    Partials with an empty split (m = -inf), a NaN sum, an infinite maximum, and those
    rows ignored too."""
    import os

    from lp_kernels.core.stats import masked_outputs, merge_stats

    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1 (set when no GPU is present)")
    from lp_kernels.backends.triton.forward import merge_outputs

    g = torch.Generator().manual_seed(0)
    k, n = 3, 10
    m = torch.randn(k, n, generator=g) * 4
    s = torch.rand(k, n, generator=g) * 30 + 1
    a = torch.randn(k, n, generator=g)
    t = torch.randn(k, n, generator=g)
    m[:, 2] = float("-inf")  # every split empty: lse = -inf
    s[:, 2] = 0.0
    s[1, 3] = float("nan")
    m[0, 4] = float("inf")
    m[:, 7] = float("-inf")
    s[:, 7] = 0.0
    m[1, 8] = float("nan")
    m[2, 6] = float("-inf")  # one empty split in a finite row
    s[2, 6] = 0.0
    a[2, 6] = 0.0
    t[2, 6] = 0.0
    stats = torch.stack([m, s, a, t], dim=2).to(device)
    # raw ids (int32 with entropy, else int64), ignore_index a real id
    targets = torch.arange(n, dtype=torch.int32 if entropy else torch.int64) + 40
    targets[[1, 7, 8]] = 42  # a plain row, an empty one, one with a NaN maximum
    targets[2] = 41
    ignored = (targets == 42).to(device)
    targets = targets.to(device)
    lse, mean, (lp, ent, lse_out) = merge_outputs(
        stats, targets, 42, entropy=entropy, return_lse=True
    )
    r_lse, r_mean, r_zt, r_ent = merge_stats(stats, entropy=entropy)  # the torch merge
    want = masked_outputs(ignored, r_zt, r_lse, r_ent, return_lse=True)
    for name, got, ref in zip(("logprob", "entropy", "lse"), (lp, ent, lse_out), want, strict=True):
        if ref is None:
            assert got is None, name
            continue
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN rows differ"
        assert bool(torch.isnan(got)[[2, 3, 4]].all()), f"{name}: non-finite rows must be NaN"
        dead = got[ignored]
        assert bool((dead == 0).all()) and not bool(torch.signbit(dead).any()), name
        live = ~ignored & ~torch.isnan(ref)
        assert_close(got[live], ref[live], rtol=1e-6, atol=1e-6, name=name)
    assert_close(
        lse[~torch.isnan(r_lse)], r_lse[~torch.isnan(r_lse)], rtol=1e-6, atol=1e-6, name="raw lse"
    )
    if entropy:
        ok = torch.isfinite(r_mean)
        assert_close(mean[ok], r_mean[ok], rtol=1e-6, atol=1e-6, name="E")
