"""Masked vocabularies: logits with ``-inf`` entries (top-k / top-p masks, a vocabulary
restricted per row) through ``vocab_parallel_logprob``.

The contract (docs/design.md, "Masked vocabularies"): a masked entry has probability
exactly 0 and drops out of every sum, so logprob, entropy, lse and the logits gradient
are exact and finite, in the default mode and with ``deterministic=True``, on one process
and under tensor parallelism (a shard, or a deterministic tile, whose whole row is
masked included). A masked target has logprob ``-inf`` (its true value) and a finite
gradient (``d log p_t / d z = onehot_t - p``). A row whose every entry is ``-inf`` has no
distribution: NaN in every output and in its gradient row, never a finite stand-in.
Checked against fp64 and ``torch.distributions.Categorical``.
"""

from __future__ import annotations

import pytest
import torch

from lp_kernels import vocab_parallel_logprob
from lp_testing import assert_close, run_ranks

N, V, T = 23, 300, 0.7
TILE = 128
IGN = 4  # an ignored row
MASKED_TARGET = 7  # a row whose target is masked out
ONE_LEFT = 9  # a row with a single entry left (entropy 0, logprob 0)
SHARD0_MASKED = (10, 11)  # rows whose columns [0, 150) are all masked (rank 0's shard)
SHARD1_MASKED = (12, 13)  # rows whose columns [150, 300) are all masked (rank 1's shard)
TILE1_MASKED = (14,)  # a row whose deterministic tile [128, 256) is all masked
ALL_MASKED = 20  # a row with no entry left


def _problem(device="cpu"):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    keep = torch.ones(N, V, dtype=torch.bool)
    for r in range(0, 7):  # top-k, k per row
        k = (3, 1, 17, 60, 150, 2, 299)[r]
        keep[r] = False
        keep[r, logits[r].topk(k).indices] = True
        targets[r] = logits[r].topk(k).indices[-1]
    for r in range(15, N):  # top-p-like random masks of varied density
        keep[r] = torch.rand(V, generator=g) < (0.05 + 0.1 * (r - 15))
        keep[r, targets[r]] = True
    keep[MASKED_TARGET, targets[MASKED_TARGET]] = False
    keep[ONE_LEFT] = False
    keep[ONE_LEFT, targets[ONE_LEFT]] = True
    for r in SHARD0_MASKED:
        keep[r, :150] = False
        targets[r] = 200 + r
    for r in SHARD1_MASKED:
        keep[r, 150:] = False
        targets[r] = r
    for r in TILE1_MASKED:
        keep[r, 128:256] = False
        targets[r] = 5
    keep[ALL_MASKED] = False
    targets[IGN] = -100
    logits = logits.masked_fill(~keep, float("-inf"))
    return logits.float().to(device), targets.to(device)


def _upstream(device):
    g = torch.Generator().manual_seed(2)
    return torch.randn(3, N, generator=g).to(device)


def _reference(logits, targets, up):
    """fp64 outputs and the logits gradient, with 0 x log 0 = 0 (the limit)."""
    z = (logits.double() / T).detach().requires_grad_()
    logz = torch.log_softmax(z, dim=1)
    p = logz.exp()
    ent = -(p * torch.where(p > 0, logz, 0.0)).sum(1)
    lse = torch.logsumexp(z, dim=1)
    ignored = targets == -100
    lp = torch.where(ignored, 0.0, logz.gather(1, targets.clamp(min=0)[:, None])[:, 0])
    ent, lse = torch.where(ignored, 0.0, ent), torch.where(ignored, 0.0, lse)
    torch.autograd.backward([lp, ent, lse], [g.double() for g in up])
    return {"logprob": lp, "entropy": ent, "lse": lse, "grad": z.grad / T}


def _run(logits, targets, up, **kw):
    x = logits.detach().clone().requires_grad_()
    out = vocab_parallel_logprob(
        x, targets, temperature=T, return_entropy=True, return_lse=True, **kw
    )
    torch.autograd.backward(list(out), list(up))  # per-row upstream gradients
    return out, x.grad


def _check(out, grad, truth, what):
    rows = torch.ones(N, dtype=torch.bool, device=grad.device)
    rows[ALL_MASKED] = False
    for name in ("logprob", "entropy", "lse"):
        got = getattr(out, name)
        assert bool(torch.isnan(got[ALL_MASKED])), f"{what}: {name} of an all -inf row"
        assert_close(
            got[rows], truth[name][rows].float(), rtol=2e-6, atol=2e-5, name=f"{what} {name}"
        )
    assert out.logprob[MASKED_TARGET] == float("-inf"), what
    assert bool(torch.isnan(grad[ALL_MASKED]).all()), f"{what}: grad of an all -inf row"
    assert bool(torch.isfinite(grad[rows]).all()), f"{what}: a non-finite gradient"
    scale = float(truth["grad"][rows].abs().max())
    assert_close(
        grad[rows], truth["grad"][rows].float(), rtol=1e-5, atol=1e-6 * scale, name=f"{what} grad"
    )


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_masked_logits_exact_and_finite(device, deterministic):
    logits, targets = _problem(device)
    up = _upstream(device)
    truth = _reference(logits, targets, up)
    kw = {"deterministic": deterministic, "deterministic_tile": TILE}
    out, grad = _run(logits, targets, up, **kw)
    _check(out, grad, truth, "deterministic" if deterministic else "default")
    # chunked: a masked row's results do not depend on the chunk
    out2, grad2 = _run(logits, targets, up, chunk_size=16, **kw)
    for a, b in zip(out, out2, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.equal(grad.nan_to_num(), grad2.nan_to_num())


def test_masked_logits_both_modes_agree(device):
    logits, targets = _problem(device)
    up = _upstream(device)
    a, ga = _run(logits, targets, up)
    b, gb = _run(logits, targets, up, deterministic=True, deterministic_tile=TILE)
    for name, x, y in zip(("logprob", "entropy", "lse"), a, b, strict=True):
        assert_close(x.nan_to_num(), y.nan_to_num(), rtol=1e-6, atol=1e-5, name=name)
    assert_close(ga.nan_to_num(), gb.nan_to_num(), rtol=1e-5, atol=1e-6, name="grad")


def test_masked_logits_match_categorical(device):
    logits, targets = _problem(device)
    out = vocab_parallel_logprob(logits, targets, temperature=T, return_entropy=True)
    rows = [r for r in range(N) if r not in (IGN, ALL_MASKED)]
    dist = torch.distributions.Categorical(logits=logits[rows].double() / T)
    assert_close(out.entropy[rows], dist.entropy().float(), rtol=1e-5, atol=1e-5, name="entropy")
    assert_close(
        out.logprob[rows].nan_to_num(neginf=-1e30),
        dist.log_prob(targets[rows]).float().nan_to_num(neginf=-1e30),
        rtol=1e-5,
        atol=1e-5,
        name="logprob",
    )


def _tp_rank(rank, world, logits, targets, up, deterministic):
    import torch.distributed as dist

    bounds = (0, TILE, V) if deterministic else (0, 150, V)
    lo, hi = bounds[rank], bounds[rank + 1]
    x = logits[:, lo:hi].clone().requires_grad_()
    out = vocab_parallel_logprob(
        x, targets, temperature=T, return_entropy=True, return_lse=True,
        tp_group=dist.group.WORLD, vocab_start=lo, vocab_size=V,
        deterministic=deterministic, deterministic_tile=TILE,
    )  # fmt: skip
    torch.autograd.backward(list(out), list(up))
    return tuple(out), x.grad


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_masked_logits_tensor_parallel(deterministic):
    """gloo TP 2: rows where one rank's whole shard is masked; every rank gets the
    single-process result (bitwise with deterministic=True)."""
    logits, targets = _problem()
    up = _upstream("cpu")
    truth = _reference(logits, targets, up)
    kw = {"deterministic": deterministic, "deterministic_tile": TILE}
    single, g_single = _run(logits, targets, up, **kw)
    results = run_ranks(_tp_rank, 2, logits, targets, up, deterministic, timeout=300)
    grad = torch.cat([g for _, g in results], dim=1)
    for rank, (outs, _) in enumerate(results):
        out = type(single)(*outs)
        _check(out, grad, truth, f"TP rank {rank}")
        if deterministic:
            for a, b in zip(out, single, strict=True):
                assert torch.equal(a.nan_to_num(), b.nan_to_num())
    if deterministic:
        assert torch.equal(grad.nan_to_num(), g_single.nan_to_num())
