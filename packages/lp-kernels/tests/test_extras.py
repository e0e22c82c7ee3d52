"""``extras=``: log_sum_sq_probs, mean_logit and is_top1 against fp64, on both backends.

The truth is computed from the fp64 materialized softmax arguments ``z`` (the inputs as
the op reads them, upcast; ``lp_testing.reference.reference_extras``). ``is_top1`` is
compared with ``torch.argmax`` where the row's two largest ``z`` are apart; exact ties are
built from duplicated weight rows (within one shard and across two). Under tensor
parallel (gloo) every rank must return what one process returns; with
``deterministic=True`` the extras must be bitwise identical across TP 1 / 2 / 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import RankError, assert_bitwise_equal, run_ranks
from lp_testing.reference import reference_extras

EXTRAS = ("log_sum_sq_probs", "mean_logit", "is_top1")
OPTIONS = {  # id -> the logit transform's options (and a bias)
    "plain": {},
    "all": {"temperature": 0.8, "softcap": 5.0, "logit_scale": 0.7, "bias": True},
}
SHAPES = {  # id -> (N, H, V, V_pad, option set)
    "n1": (1, 16, 37, 37, "plain"),
    "prime-v": (9, 24, 131, 131, "all"),
    "awkward-v": (13, 32, 300, 300, "all"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(n, h, v, v_pad, dtype, opts, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v_pad, h, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        targets[1] = -100
    kwargs = {k: val for k, val in opts.items() if k != "bias"}
    if opts.get("bias"):
        kwargs["bias"] = torch.randn(v_pad, generator=g).to(dtype)
    return hidden, weight, targets, kwargs


def _z64(hidden, weight, v, kwargs):
    """fp64 ``z [N, V]`` over the real vocabulary, as the op's transform makes it."""
    z = hidden.double() @ weight[:v].double().T
    if kwargs.get("bias") is not None:
        z = z + kwargs["bias"][:v].double()
    z = z * kwargs.get("logit_scale", 1.0)
    if kwargs.get("softcap") is not None:
        c = kwargs["softcap"]
        z = c * torch.tanh(z / c)
    return z / kwargs.get("temperature", 1.0)


def _check(out, z, targets, where=""):
    """Every extra within fp32 tolerances of fp64; is_top1 exact where there is no near-tie."""
    truth = reference_extras(z, targets)
    scale = float(z.abs().max())
    err = (out.log_sum_sq_probs.double() - truth["log_sum_sq_probs"]).abs()
    tol = 2e-5 * (1 + truth["log_sum_sq_probs"].abs()) + 1e-6 * scale
    assert bool((err <= tol).all()), f"{where} log_sum_sq_probs: worst {float(err.max()):.3g}"
    err = (out.mean_logit.double() - truth["mean_logit"]).abs()
    assert float(err.max()) <= 1e-5 * scale + 1e-6, f"{where} mean_logit: {float(err.max())}"
    top2 = z.topk(min(2, z.shape[1]), dim=-1).values
    clear = (top2[:, 0] - top2[:, -1] > 1e-3 * (1 + scale)) | (z.shape[1] == 1)
    assert out.is_top1.dtype == torch.bool
    assert torch.equal(out.is_top1[clear], truth["is_top1"][clear]), f"{where} is_top1"
    ignored = targets == -100
    assert bool((out.log_sum_sq_probs[ignored] == 0).all())
    assert bool((out.mean_logit[ignored] == 0).all())
    assert not bool(out.is_top1[ignored].any())


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_extras_match_fp64(shape, dtype, deterministic, backend):
    n, h, v, v_pad, opts = shape
    hidden, weight, targets, kwargs = _inputs(n, h, v, v_pad, dtype, OPTIONS[opts])
    out = linear_logprob(
        hidden,
        weight,
        targets,
        extras=EXTRAS,
        backend=backend,
        deterministic=deterministic,
        **kwargs,
    )
    _check(out, _z64(hidden, weight, v, kwargs), targets, f"{backend} {dtype}")


def test_extras_are_off_by_default_and_change_no_other_output(backend):
    hidden, weight, targets, kwargs = _inputs(9, 24, 131, 131, torch.float32, OPTIONS["all"])
    h = hidden.clone().requires_grad_()
    base = linear_logprob(h, weight, targets, return_entropy=True, backend=backend, **kwargs)
    assert base.log_sum_sq_probs is None and base.mean_logit is None and base.is_top1 is None
    base.logprob.sum().backward()
    grad = h.grad
    h.grad = None
    out = linear_logprob(
        h, weight, targets, return_entropy=True, backend=backend, extras=["is_top1"], **kwargs
    )
    assert out.log_sum_sq_probs is None and out.mean_logit is None
    assert out.is_top1 is not None and not out.is_top1.requires_grad
    logprob, entropy, _ = out  # still unpacks as a triple
    assert_bitwise_equal(logprob, base.logprob, "logprob")
    assert_bitwise_equal(entropy, base.entropy, "entropy")
    logprob.sum().backward()
    assert_bitwise_equal(h.grad, grad, "grad_hidden")


def _tied(n=6, h=16, v=50, dtype=torch.float32):
    """Rows whose largest logit is an exact tie between columns 7 and 31 (duplicated weight
    rows, made the largest): targets 7 (the first: True) and 31 (False)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    weight[31] = weight[7] = hidden[0] * 2.0  # row 0's largest logit, twice
    targets = torch.tensor([7, 31, 7, 31, -100, 7])[:n]
    hidden[1:4] = hidden[0]
    return hidden, weight, targets


def test_exact_ties_pick_the_first_column(backend):
    hidden, weight, targets = _tied()
    for det in (False, True):
        out = linear_logprob(
            hidden, weight, targets, extras=("is_top1",), backend=backend, deterministic=det
        )
        assert out.is_top1[:4].tolist() == [True, False, True, False], (det, out.is_top1)
        assert not bool(out.is_top1[4])


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_vocab_parallel_logprob_extras(deterministic):
    hidden, weight, targets, kwargs = _inputs(13, 32, 300, 300, torch.float32, OPTIONS["all"])
    bias = kwargs.pop("bias")
    logits = hidden @ weight.T + bias
    out = vocab_parallel_logprob(
        logits, targets, extras=list(EXTRAS), deterministic=deterministic, **kwargs
    )
    z = _z64(logits.double(), torch.eye(300, dtype=torch.float64), 300, kwargs)
    _check(out, z, targets, "vocab_parallel_logprob")


# ----------------------------------------------------------------- tensor parallel (gloo)


V_TP, V_PAD = 450, 512


def _tp_inputs():
    """V = 450 real columns of V_pad = 512 rows; padding rows that would win every argmax;
    rows 0-3 tie exactly between column 90 and column 300 (on another shard in every
    layout below)."""
    hidden, weight, targets, kwargs = _inputs(10, 24, V_TP, V_PAD, torch.float32, OPTIONS["all"])
    weight[V_TP:] = hidden.mean(0) * 50.0  # padding: the largest logits, never counted
    weight[90] = weight[300] = hidden[0] * 3.0
    hidden[1:4] = hidden[0]
    targets[:4] = torch.tensor([90, 300, 90, 300])
    return hidden, weight, targets, kwargs


def _tp_rank(rank, world, bounds, backend, deterministic):
    hidden, weight, targets, kwargs = _tp_inputs()
    start, size = bounds[rank]
    if kwargs.get("bias") is not None:
        kwargs["bias"] = kwargs["bias"][start : start + size]
    out = linear_logprob(
        hidden,
        weight[start : start + size],
        targets,
        extras=EXTRAS,
        tp_group=dist.group.WORLD,
        vocab_start=start,
        vocab_size=V_TP,
        backend=backend,
        deterministic=deterministic,
        **kwargs,
    )
    return out.log_sum_sq_probs, out.mean_logit, out.is_top1


def _logits_rank(rank, world, bounds):
    """``vocab_parallel_logprob(deterministic=True)``'s extras on this rank's columns of one
    global fp32 logits tensor (the real vocabulary's padding columns included)."""
    hidden, weight, targets, kwargs = _tp_inputs()
    logits = hidden @ weight.T + kwargs.pop("bias")
    start, size = bounds[rank]
    out = vocab_parallel_logprob(
        logits[:, start : start + size],
        targets,
        extras=EXTRAS,
        tp_group=dist.group.WORLD,
        vocab_start=start,
        vocab_size=V_TP,
        deterministic=True,
        **kwargs,
    )
    return out.log_sum_sq_probs, out.mean_logit, out.is_top1


def _single(backend, deterministic):
    hidden, weight, targets, kwargs = _tp_inputs()
    out = linear_logprob(
        hidden,
        weight,
        targets,
        extras=EXTRAS,
        vocab_size=V_TP,
        backend=backend,
        deterministic=deterministic,
        **kwargs,
    )
    return out, hidden, weight, targets, kwargs


def test_tp2_padded_vocabulary_matches_one_process(backend):
    out, hidden, weight, targets, kwargs = _single(backend, False)
    _check(out, _z64(hidden, weight, V_TP, kwargs), targets, "one process")
    assert out.is_top1[:4].tolist() == [True, False, True, False]
    for bounds in ([(0, 256), (256, 256)], [(0, 100), (100, 412)]):
        per_rank = run_ranks(_tp_rank, 2, bounds, backend, False, timeout=180)
        for rank, got in enumerate(per_rank):
            where = f"{bounds} rank {rank}"
            assert torch.equal(got[2], out.is_top1), where
            torch.testing.assert_close(got[0], out.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1], out.mean_logit, rtol=1e-5, atol=1e-5)


def test_deterministic_extras_bitwise_across_tp_degrees(backend):
    layouts = {
        "tp1": [(0, V_PAD)],
        "tp2-uneven": [(0, 384), (384, 128)],
        "tp4": [(128 * r, 128) for r in range(4)],
    }
    single, hidden, weight, targets, kwargs = _single(backend, True)
    _check(single, _z64(hidden, weight, V_TP, kwargs), targets, "deterministic")
    assert single.is_top1[:4].tolist() == [True, False, True, False]
    want = (single.log_sum_sq_probs, single.mean_logit, single.is_top1)
    for name, bounds in layouts.items():
        per_rank = run_ranks(_tp_rank, len(bounds), bounds, backend, True, timeout=180)
        for rank, got in enumerate(per_rank):
            for a, b, what in zip(got, want, EXTRAS, strict=True):
                assert_bitwise_equal(a, b, f"{what}: {name} rank {rank} vs one process")
    if backend != "torch":  # vocab_parallel_logprob has one implementation
        return
    logits_want = run_ranks(_logits_rank, 1, layouts["tp1"], timeout=180)[0]
    assert logits_want[2][:4].tolist() == [True, False, True, False]
    for name, bounds in layouts.items():
        for rank, got in enumerate(run_ranks(_logits_rank, len(bounds), bounds, timeout=180)):
            for a, b, what in zip(got, logits_want, EXTRAS, strict=True):
                assert_bitwise_equal(a, b, f"vocab_parallel_logprob {what}: {name} rank {rank}")


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("extras", "error", "message"),
    [
        ("is_top1", TypeError, "extras must be a sequence"),
        (None, TypeError, "extras must be a sequence"),
        ([1], TypeError, "extras must hold str names"),
        (["top1"], ValueError, "unknown name 'top1'"),
        (["is_top1", "is_top1"], ValueError, "twice"),
    ],
    ids=["str", "none", "int", "unknown", "duplicate"],
)
def test_bad_extras_raise(extras, error, message):
    hidden, weight, targets, _ = _inputs(3, 8, 11, 11, torch.float32, {})
    for call in (
        lambda: linear_logprob(hidden, weight, targets, extras=extras),
        lambda: vocab_parallel_logprob(hidden @ weight.T, targets, extras=extras),
    ):
        with pytest.raises(error, match=message) as info:
            call()
        assert "'log_sum_sq_probs', 'mean_logit', 'is_top1'" in str(info.value)


def _disagree_rank(rank, world):
    hidden, weight, targets, _ = _inputs(3, 8, 16, 16, torch.float32, {})
    extras = ("is_top1",) if rank == 0 else ()
    linear_logprob(
        hidden, weight[rank * 8 : rank * 8 + 8], targets, extras=extras, tp_group=dist.group.WORLD
    )


def test_ranks_disagreeing_on_extras_raise_on_every_rank():
    with pytest.raises(RankError, match="extras"):
        run_ranks(_disagree_rank, 2, timeout=60)
