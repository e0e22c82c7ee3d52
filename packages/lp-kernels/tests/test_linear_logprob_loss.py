"""linear_logprob_loss: parity with fp64, with the composed path, bits, TP, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lp_kernels import linear_logprob, linear_logprob_loss
from lp_testing import (
    DTYPES,
    assert_bitwise_equal,
    assert_close,
    make_problem,
    run_ranks,
    split_vocab,
)


def smooth_loss(logprob, entropy, lse, *, adv, old, ref, w):
    """Every output and per-token tensor, no kinks (so fp64 and lp agree on every branch)."""
    out = -adv * torch.exp(logprob - old) + 0.5 * (logprob - ref) ** 2 + 0.01 * lse**2
    if entropy is not None:
        out = out - 0.1 * entropy
    return w * out


def per_token_for(p, seed=0):
    """Old/reference log-probs near the problem's own, advantages, weights; [*] fp32 on
    the problem's device."""
    gen = torch.Generator().manual_seed(seed)
    shape = p.targets.shape
    with torch.no_grad():
        truth = reference(p, smooth_loss, None, entropy=False)[2].cpu()
    noise = torch.randn((2, *shape), generator=gen)
    values = {
        "adv": torch.randn(shape, generator=gen),
        "old": (truth + 0.1 * noise[0]).float(),
        "ref": (truth + 0.1 * noise[1]).float(),
        "w": torch.rand(shape, generator=gen) + 0.5,
    }
    return {k: v.to(p.targets.device) for k, v in values.items()}


def reference(p, loss_fn, per_token, *, entropy, bias=None, softcap=None, dtype=torch.float64):
    """The loss from materialized logits in ``dtype``: (loss, token_loss, logprob, entropy,
    lse), differentiable with respect to p.hidden / p.weight / bias in that dtype."""
    h, w = p.hidden, p.weight
    if dtype == torch.float64:
        h, w = h.double(), w.double()
        logits = h @ w.T
    else:
        logits = F.linear(h, w).float()
    if bias is not None:
        logits = logits + (bias.double() if dtype == torch.float64 else bias.float())
    logits = logits[..., : p.vocab_size]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / p.temperature
    logp = torch.log_softmax(z, dim=-1)
    ignored = p.targets == p.ignore_index
    t = torch.where(ignored, 0, p.targets)
    lp = torch.where(ignored, 0.0, logp.gather(-1, t.unsqueeze(-1)).squeeze(-1))
    lse = torch.where(ignored, 0.0, torch.logsumexp(z, dim=-1))
    ent = torch.where(ignored, 0.0, -(logp.exp() * logp).sum(-1)) if entropy else None
    if per_token is None:
        return None, None, lp, ent, lse
    values = {k: torch.where(ignored, 0.0, v.to(lp.dtype)) for k, v in per_token.items()}
    token = torch.where(ignored, 0.0, loss_fn(lp, ent, lse, **values))
    return token.sum(), token, lp, ent, lse


CASES = [  # (n, h, v, v_pad, options)
    (1, 33, 97, None, {}),
    (37, 64, 1009, 1024, {"temperature": 0.7}),
    (53, 48, 4099, None, {"softcap": 5.0, "bias": True}),
    (130, 32, 613, None, {"softcap": 3.0, "temperature": 1.3, "chunk_size": 16}),
]


@pytest.mark.parametrize("entropy", [False, True], ids=["lp", "ent"])
@pytest.mark.parametrize("tol", DTYPES[:2], ids=str)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"N{c[0]}-V{c[2]}-{'-'.join(c[4]) or 'plain'}"
)
def test_matches_fp64(case, tol, entropy, device, backend):
    n, h, v, v_pad, options = case
    options = dict(options)
    p = make_problem(
        n, h, v, dtype=tol.dtype, seed=n, ignore_frac=0.2, padded_vocab=v_pad,
        temperature=options.pop("temperature", 1.0),
    ).to(device).with_grad()  # fmt: skip
    bias = None
    if options.pop("bias", False):
        gen = torch.Generator().manual_seed(1)
        bias = torch.randn(p.v_padded, generator=gen).to(device, tol.dtype).requires_grad_()
    softcap = options.get("softcap")
    per_token = per_token_for(p)
    out = linear_logprob_loss(
        p.hidden, p.weight, p.targets, smooth_loss, per_token=per_token,
        return_entropy=entropy, bias=bias, backend=backend, **options, **p.op_kwargs(),
    )  # fmt: skip
    out.loss.backward()
    mine = [out.loss, out.token_loss, out.logprob, out.lse, p.hidden.grad, p.weight.grad]
    mine += [out.entropy] if entropy else []
    mine += [bias.grad] if bias is not None else []
    leaves = [x for x in (p.hidden, p.weight, bias) if x is not None]
    results = []
    for dtype in (torch.float64, tol.dtype):
        for x in leaves:
            x.grad = None
        loss, token, lp, ent, lse = reference(
            p, smooth_loss, per_token, entropy=entropy, bias=bias, softcap=softcap, dtype=dtype
        )
        loss.backward()
        got = [loss, token, lp, lse, p.hidden.grad, p.weight.grad]
        got += [ent] if entropy else []
        got += [bias.grad] if bias is not None else []
        results.append([x.detach() for x in got])
    names = ["loss", "token_loss", "logprob", "lse", "grad_hidden", "grad_weight"]
    names += ["entropy"] if entropy else []
    names += ["grad_bias"] if bias is not None else []
    for name, a, truth, base in zip(names, mine, *results, strict=True):
        assert a.dtype == (base.dtype if name.startswith("grad") else torch.float32), name
        assert_close(a, truth, baseline=base, **tol.kwargs(), name=f"{name}[{backend}]")
    assert not out.token_loss.requires_grad and out.loss.requires_grad
    if out.logprob.numel():  # ignored rows: zeros everywhere
        ign = p.targets == p.ignore_index
        for x in (out.token_loss, out.logprob, out.lse):
            assert torch.all(x[ign] == 0)


def test_matches_linear_logprob_composed(device, backend):
    """The fused loss against loss_fn on linear_logprob's outputs + backward (same backend)."""
    p = make_problem(75, 40, 2003, seed=4, ignore_frac=0.1, temperature=0.9)
    p = p.to(device).with_grad()
    per_token = per_token_for(p, seed=2)
    out = linear_logprob_loss(
        p.hidden, p.weight, p.targets, smooth_loss, per_token=per_token,
        return_entropy=True, backend=backend, **p.op_kwargs(),
    )  # fmt: skip
    out.loss.backward()
    gh, gw = p.hidden.grad, p.weight.grad
    p.hidden.grad = p.weight.grad = None
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, backend=backend,
        **p.op_kwargs(),
    )  # fmt: skip
    ign = p.targets == p.ignore_index
    values = {k: torch.where(ign, 0.0, v) for k, v in per_token.items()}
    token = torch.where(ign, 0.0, smooth_loss(ref.logprob, ref.entropy, ref.lse, **values))
    token.sum().backward()
    # the statistics are the forward's own: the same bits
    assert_bitwise_equal(out.logprob, ref.logprob.detach(), "logprob")
    assert_bitwise_equal(out.entropy, ref.entropy.detach(), "entropy")
    assert_bitwise_equal(out.lse, ref.lse.detach(), "lse")
    assert_bitwise_equal(out.token_loss, token.detach(), "token_loss")
    torch.testing.assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, p.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_bitwise_run_to_run_and_upstream_scale(device, backend, deterministic):
    p = make_problem(67, 32, 1500, dtype=torch.bfloat16, seed=5, ignore_frac=0.1).to(device)
    per_token = per_token_for(p, seed=3)
    runs = []
    for scale in (1.0, 1.0, 2.0):
        q = p.with_grad()
        out = linear_logprob_loss(
            q.hidden, q.weight, q.targets, smooth_loss, per_token=per_token, backend=backend,
            deterministic=deterministic, chunk_size=16, **p.op_kwargs(),
        )  # fmt: skip
        (scale * out.loss).backward()
        runs.append((out.loss, out.logprob, q.hidden.grad, q.weight.grad))
    for a, b in zip(runs[0], runs[1], strict=True):
        assert_bitwise_equal(a, b)
    # the upstream gradient scales the finished gradients (bf16: 2 x is exact)
    assert_bitwise_equal(runs[2][2], 2 * runs[0][2], "grad_hidden x 2")
    assert_bitwise_equal(runs[2][3], 2 * runs[0][3], "grad_weight x 2")


def test_metrics_batch_invariant(device, backend):
    """A row's per-token outputs and loss do not depend on the other rows or on N (the
    torch backend on CUDA is not batch-invariant: cuBLAS picks kernels by shape)."""
    if device == "cuda" and backend == "torch":
        pytest.skip("the torch backend on CUDA is not batch-invariant (documented)")
    p = make_problem(90, 32, 777, seed=6).to(device)
    per_token = per_token_for(p, seed=4)
    full = linear_logprob_loss(
        p.hidden, p.weight, p.targets, smooth_loss, per_token=per_token, backend=backend,
        return_entropy=True,
    )  # fmt: skip
    k = 23
    part = linear_logprob_loss(
        p.hidden[:k], p.weight, p.targets[:k], smooth_loss, backend=backend, return_entropy=True,
        per_token={key: v[:k] for key, v in per_token.items()},
    )  # fmt: skip
    for name in ("token_loss", "logprob", "entropy", "lse"):
        assert_bitwise_equal(getattr(part, name), getattr(full, name)[:k], name)


def test_no_grad_and_partial_grads(backend):
    p = make_problem(40, 24, 500, seed=7)
    per_token = per_token_for(p)
    with torch.no_grad():
        out = linear_logprob_loss(
            p.hidden.requires_grad_(), p.weight, p.targets, smooth_loss, per_token=per_token,
            backend=backend,
        )  # fmt: skip
    assert not out.loss.requires_grad
    q = p.with_grad()
    q.weight.requires_grad_(False)
    out2 = linear_logprob_loss(
        q.hidden, q.weight, q.targets, smooth_loss, per_token=per_token, backend=backend
    )
    out2.loss.backward()
    assert q.weight.grad is None and q.hidden.grad is not None
    assert_bitwise_equal(out.loss, out2.loss.detach(), "loss under no_grad")


def test_losses_that_skip_outputs(backend):
    """A loss of logprob alone (no lse, no entropy gradient) and a constant loss."""
    p = make_problem(30, 16, 300, seed=8, ignore_frac=0.2).with_grad()

    def pg(logprob, entropy, lse, *, adv):
        return -adv * logprob

    adv = torch.randn(30, generator=torch.Generator().manual_seed(0))
    out = linear_logprob_loss(
        p.hidden, p.weight, p.targets, pg, per_token={"adv": adv}, backend=backend
    )
    out.loss.backward()
    q = p.with_grad()
    reference(q, pg, {"adv": adv}, entropy=False)[0].backward()  # fp64 math, fp32 grads
    torch.testing.assert_close(p.hidden.grad, q.hidden.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.weight.grad, q.weight.grad, rtol=1e-4, atol=1e-6)
    assert out.entropy is None
    r = p.with_grad()

    def constant(logprob, entropy, lse):
        return torch.ones_like(logprob)

    out = linear_logprob_loss(r.hidden, r.weight, r.targets, constant, backend=backend)
    out.loss.backward()
    assert out.loss.item() == float((r.targets != r.ignore_index).sum())
    assert torch.all(r.hidden.grad == 0) and torch.all(r.weight.grad == 0)


def test_needs_entropy_and_constants(backend):
    class Bonus:
        needs_entropy = True

        def __call__(self, logprob, entropy, lse, *, coef, scale):
            return -coef * entropy * scale - logprob

    p = make_problem(20, 16, 211, seed=9).with_grad()
    out = linear_logprob_loss(
        p.hidden, p.weight, p.targets, Bonus(), backend=backend,
        per_token={"coef": 0.5, "scale": torch.tensor(2.0)},
    )  # fmt: skip
    assert out.entropy is not None
    torch.testing.assert_close(out.token_loss, -out.entropy - out.logprob)


def test_nonfinite_hidden_on_ignored_rows(backend):
    p = make_problem(24, 16, 257, seed=10, ignore_frac=0.25)
    h = p.hidden.clone()
    ign = p.targets == p.ignore_index
    h[ign] = float("nan")
    h.requires_grad_()
    w = p.weight.clone().requires_grad_()
    out = linear_logprob_loss(h, w, p.targets, smooth_loss, per_token=per_token_for(p))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.all(torch.isfinite(h.grad[~ign]))
    assert torch.all(h.grad[ign] == 0)


def test_errors():
    p = make_problem(8, 16, 100, seed=11).with_grad()
    args = (p.hidden, p.weight, p.targets)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        linear_logprob_loss(*args, None)
    with pytest.raises(ValueError, match="one loss per row"):
        linear_logprob_loss(*args, lambda lp, e, lse: lp.sum())
    with pytest.raises(TypeError, match="floating-point"):
        linear_logprob_loss(*args, lambda lp, e, lse: 3)
    with pytest.raises(ValueError, match=r"per_token\['adv'\] must have the targets' shape"):
        linear_logprob_loss(*args, smooth_loss, per_token={"adv": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"per_token\['adv'\] requires grad"):
        linear_logprob_loss(*args, smooth_loss, per_token={"adv": torch.zeros(8).requires_grad_()})
    with pytest.raises(ValueError, match="'lse' is the op's own"):
        linear_logprob_loss(*args, smooth_loss, per_token={"lse": torch.zeros(8)})
    with pytest.raises(TypeError, match="per_token must be a mapping"):
        linear_logprob_loss(*args, smooth_loss, per_token=[1, 2])
    with pytest.raises(TypeError, match=r"per_token\['adv'\] must be a torch.Tensor"):
        linear_logprob_loss(*args, smooth_loss, per_token={"adv": "x"})

    def pg(logprob, entropy, lse):
        return -logprob

    out = linear_logprob_loss(*args, pg)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(out.loss, p.hidden, create_graph=True)
    out = linear_logprob_loss(*args, pg)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


# ----------------------------------------------------------------------------- tensor parallel


def _tp_rank(rank, world, problem, per_token, backend, deterministic):
    import torch.distributed as dist

    bounds = split_vocab(problem.v_padded, world, mode="uneven")
    start, size = bounds[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    out = linear_logprob_loss(
        h, w, problem.targets, smooth_loss, per_token=per_token, return_entropy=True,
        tp_group=dist.group.WORLD, vocab_start=start, backend=backend,
        deterministic=deterministic, **problem.op_kwargs(),
    )  # fmt: skip
    out.loss.backward()
    return start, out.loss, out.logprob, out.entropy, h.grad, w.grad


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_tensor_parallel(backend, deterministic):
    problem = make_problem(
        45, 32, 1100, seed=12, ignore_frac=0.1, padded_vocab=1152, temperature=0.8
    )  # fmt: skip
    per_token = per_token_for(problem, seed=5)
    single = _tp_single(problem, per_token, backend, deterministic)
    ranks = run_ranks(_tp_rank, 2, problem, per_token, backend, deterministic, timeout=240)
    grad_w = torch.cat([r[5] for r in ranks])
    for rank in ranks:
        assert_bitwise_equal(rank[1], ranks[0][1], "loss on every rank")
        assert_bitwise_equal(rank[4], ranks[0][4], "grad_hidden on every rank")
    if deterministic:  # TP-invariant bits
        for name, a, b in zip(
            ("loss", "logprob", "entropy", "grad_hidden"), ranks[0][1:5], single[:4], strict=True
        ):
            assert_bitwise_equal(a, b, name)
        assert_bitwise_equal(grad_w, single[4], "grad_weight")
    else:
        for a, b in zip((*ranks[0][1:5], grad_w), single, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def _tp_single(problem, per_token, backend, deterministic):
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight.clone().requires_grad_()
    out = linear_logprob_loss(
        h, w, problem.targets, smooth_loss, per_token=per_token, return_entropy=True,
        backend=backend, deterministic=deterministic, **problem.op_kwargs(),
    )  # fmt: skip
    out.loss.backward()
    return out.loss, out.logprob, out.entropy, h.grad, w.grad


# ----------------------------------------------------------------------------- ready-made losses


def _ready_made(name):
    from lp_kernels import losses

    return {
        "grpo": (losses.grpo(), "seq-mean-token-mean"),
        "dapo": (losses.dapo(), "token-mean"),
        "dr_grpo": (losses.dr_grpo(), "seq-mean-token-sum-norm"),
        "ppo-dual-clip": (losses.ppo(dual_clip=3.0), "token-mean"),
        "kl-k2-entropy-zloss": (
            losses.PolicyLoss(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01, z_loss_coef=1e-3),
            "seq-mean-token-sum",
        ),
    }[name]


@pytest.mark.parametrize(
    "name", ["grpo", "dapo", "dr_grpo", "ppo-dual-clip", "kl-k2-entropy-zloss"]
)
def test_ready_made_losses_match_their_formula_on_lp_logprobs(name, backend):
    """Each ready-made loss through the fused op against the same loss on linear_logprob's
    outputs (the formula on lp's log-probs) + backward: same per-token values and loss,
    gradients within lp's parity bounds. The old log-probs are off by enough that some
    rows are clipped, on both sides."""
    from lp_kernels.losses import token_weights

    loss_fn, mode = _ready_made(name)
    p = make_problem((4, 9), 32, 517, seed=13, ignore_frac=0.15, temperature=0.9).with_grad()
    live = p.targets != p.ignore_index
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        own = linear_logprob(p.hidden, p.weight, p.targets, **p.op_kwargs()).logprob
    per_token = {
        "old_logprob": own + 0.3 * torch.randn(own.shape, generator=gen),
        "ref_logprob": own + 0.3 * torch.randn(own.shape, generator=gen),
        "advantages": torch.randn(4, 1, generator=gen).expand(4, 9).contiguous(),
        "weights": token_weights(live, mode),
    }
    out = linear_logprob_loss(
        p.hidden, p.weight, p.targets, loss_fn, per_token=per_token, backend=backend,
        **p.op_kwargs(),
    )  # fmt: skip
    out.loss.backward()
    assert (out.entropy is not None) == loss_fn.needs_entropy
    gh, gw = p.hidden.grad, p.weight.grad
    p.hidden.grad = p.weight.grad = None
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=loss_fn.needs_entropy, return_lse=True,
        backend=backend, **p.op_kwargs(),
    )  # fmt: skip
    values = {k: torch.where(live, v, 0.0) for k, v in per_token.items()}
    token = torch.where(live, loss_fn(ref.logprob, ref.entropy, ref.lse, **values), 0.0)
    token.sum().backward()
    assert_bitwise_equal(out.token_loss, token.detach(), "token_loss")
    torch.testing.assert_close(out.loss, token.detach().sum(), rtol=1e-6, atol=1e-7)
    ratio = torch.exp(own - per_token["old_logprob"])[live]
    assert bool((ratio > 1.28).any()) and bool((ratio < 0.8).any())  # both clips in play
    torch.testing.assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, p.weight.grad, rtol=1e-5, atol=1e-7)
    assert gh.abs().max() > 0


def test_closed_form_gradients_match_autograd_per_block(backend):
    """A loss with ``value_and_grad`` (PolicyLoss) against the same loss behind a plain
    function (differentiated by autograd per block): the same loss bits, gradients within
    rounding of the per-row derivatives."""
    from lp_kernels.losses import grpo

    loss_fn = grpo(entropy_coef=0.01, z_loss_coef=1e-3)
    p = make_problem(61, 32, 700, seed=21, ignore_frac=0.1)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        own = linear_logprob(p.hidden, p.weight, p.targets, **p.op_kwargs()).logprob
    per_token = {
        "old_logprob": own + 0.3 * torch.randn(own.shape, generator=gen),
        "ref_logprob": own + 0.3 * torch.randn(own.shape, generator=gen),
        "advantages": torch.randn(own.shape, generator=gen),
    }

    def run(fn):
        q = p.with_grad()
        out = linear_logprob_loss(
            q.hidden, q.weight, q.targets, fn, per_token=per_token, backend=backend,
            return_entropy=True, chunk_size=16, **p.op_kwargs(),
        )  # fmt: skip
        out.loss.backward()
        return out, q.hidden.grad, q.weight.grad

    fused, gh, gw = run(loss_fn)
    auto, gh_a, gw_a = run(lambda *args, **kw: loss_fn(*args, **kw))
    assert_bitwise_equal(fused.token_loss, auto.token_loss, "token_loss")
    torch.testing.assert_close(gh, gh_a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, gw_a, rtol=1e-5, atol=1e-7)


class _BadClosedForm:
    def __init__(self, grads):
        self.grads = grads

    def __call__(self, logprob, entropy, lse):
        return -logprob

    def value_and_grad(self, logprob, entropy, lse):
        return -logprob, self.grads(logprob)


@pytest.mark.parametrize(
    "grads,match",
    [
        (lambda lp: -torch.ones_like(lp), "must return"),
        (lambda lp: (torch.ones(3), None, None), "shape"),
        (lambda lp: (-torch.ones_like(lp), torch.ones_like(lp), None), "entropy, which is None"),
    ],
    ids=["not-a-triple", "wrong-shape", "grad-of-none"],
)
def test_bad_value_and_grad_is_named(grads, match):
    p = make_problem(9, 16, 50, seed=3).with_grad()
    with pytest.raises((TypeError, ValueError), match=match):
        linear_logprob_loss(p.hidden, p.weight, p.targets, _BadClosedForm(grads))


def test_fitted_logits_chunks_keep_every_bit(monkeypatch):
    """Cutting a gradient chunk into other logits chunks changes no output and no gradient
    bit (the interpreter has no waves: an SM count is patched in to make it cut)."""
    from lp_kernels.backends.triton import loss as triton_loss
    from lp_kernels.backends.triton.config import INTERPRET_CONFIG, use_config

    # 64-row blocks, logits chunks of <= 256 rows, gradient chunks of 512, 3 splits
    cfg = INTERPRET_CONFIG.replace(loss={"rows": 256, "grad_rows": 512})
    p = make_problem(600, 16, 3000, seed=23, ignore_frac=0.1)
    per_token = per_token_for(p, seed=5)

    def run():
        q = p.with_grad()
        with use_config(cfg):
            out = linear_logprob_loss(
                q.hidden, q.weight, q.targets, smooth_loss, per_token=per_token,
                return_entropy=True, backend="triton", **p.op_kwargs(),
            )  # fmt: skip
        out.loss.backward()
        return out.token_loss, out.logprob, out.entropy, q.hidden.grad, q.weight.grad

    plain = run()
    cuts = []
    fit = triton_loss.logits_chunks
    monkeypatch.setattr(triton_loss, "sm_count", lambda device: 9)
    monkeypatch.setattr(triton_loss, "logits_chunks", lambda *a: cuts.append(fit(*a)) or cuts[-1])
    fitted = run()
    assert cuts[0] == [192, 192, 128], cuts  # 3 waves of 9 programs, not 2 x 2
    for a, b in zip(plain, fitted, strict=True):
        assert_bitwise_equal(a, b)
