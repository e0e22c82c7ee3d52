"""Vocabulary-parallel linear_divergence / vocab_parallel_divergence over real gloo ranks.

Each rank holds a contiguous shard of both heads (even or uneven; the padded vocabulary in
the last rank). Outputs must be bitwise equal on every rank and match fp64; the ranks'
grad_weight / grad_bias shards, concatenated, must match the fp64 gradient (zero on
padding rows), grad_hidden the full sum, and with reduce_grad_hidden=False the ranks'
partials must sum to it. deterministic=True: outputs and gradients torch.equal for TP 1,
2 and 4 on shard bounds that are multiples of 128; other bounds are refused by every rank
(none hangs). The ranks of one world size run once per module (a module-scoped fixture)
for the default path: every case of those tests is computed in that one call.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_divergence, vocab_parallel_divergence
from lp_testing import (
    DIVERGENCE_OUTPUTS,
    DTYPES,
    assert_close,
    assert_zero,
    make_problem,
    materialized_divergence_baseline,
    materialized_divergence_baseline_from_logits,
    random_upstream,
    reference_divergence,
    reference_divergence_from_logits,
    run_ranks,
    split_vocab,
)

N, H, H_T, V, V_PAD = 23, 24, 40, 389, 400
OPTIONS = {"temperature": 0.8, "teacher_temperature": 1.2, "logit_scale": 1.1}
OPTIONS |= {"teacher_softcap": 6.0, "beta": 0.3}
CASES = [  # (split mode, reduce_grad_hidden, kind, chunk_size, backend)
    ("even", True, "reverse_kl", None, "torch"),
    ("uneven", True, "jsd", 8, "torch"),
    ("uneven", False, "forward_kl", 5, "torch"),
    ("uneven", False, "jsd", 16, "triton"),  # Triton's interpreter without a GPU
]
LOGIT_KINDS = ("forward_kl", "jsd")  # vocab_parallel_divergence, top-k teacher
DETERMINISTIC_ERROR = "deterministic=True needs shard bounds on multiples of 128"
# fp32, relative to the materialized fp32 baseline as in test_divergence.py, with k = 8
# instead of 4: a row's sums are a sum of per-rank partials (merged lse, summed shard
# terms), and reverse_kl's gradient p (lp - lq - D) carries D's rounding into every column
# of the row coherently. Measured: TP4 even reverse_kl grad_weight 7.7x the baseline's error
# (the single process: 1.75x; D's error itself 1.6e-5 at P = 4 vs 0.5-1.2e-5 at P = 1 across
# option sets, so fp32 noise, not a layout bug).
TOL = dataclasses.replace(DTYPES[0], k=8.0)


def _data() -> dict:
    """The global problem: both full heads (biases included), NaN in masked hidden rows."""
    s = make_problem(N, H, V, seed=7, padded_vocab=V_PAD)
    t = make_problem(N, H_T, V, seed=8, padded_vocab=V_PAD)
    g = torch.Generator().manual_seed(9)
    mask = torch.ones(N, dtype=torch.bool)
    mask[[0, 5, 17]] = False
    hidden, teacher_hidden = s.hidden.clone(), t.hidden.clone()
    hidden[~mask] = math.nan
    teacher_hidden[~mask] = math.nan
    logits = torch.randn(N, V_PAD, generator=g) * 3
    teacher = (torch.randn(N, V_PAD, generator=g) * 2).log_softmax(-1)
    top = teacher[:, :V].topk(5, dim=-1).indices  # few columns: most shards hold none
    topk = torch.full_like(teacher, -math.inf).scatter(-1, top, teacher.gather(-1, top))
    return {
        "hidden": hidden,
        "weight": s.weight,
        "bias": torch.randn(V_PAD, generator=g),
        "teacher_hidden": teacher_hidden,
        "teacher_weight": t.weight,
        "teacher_bias": torch.randn(V_PAD, generator=g),
        "mask": mask,
        "upstream": random_upstream((N,), seed=3),
        "logits": logits,
        "teacher_logprobs": topk,
    }


def _linear_case(rank, world, data, mode, reduce, kind, chunk, backend, **extra):
    bounds = split_vocab(V_PAD, world, mode=mode)
    start, size = bounds[rank]
    rows = slice(start, start + size)
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"][rows].clone().requires_grad_()
    b = data["bias"][rows].clone().requires_grad_()
    out = linear_divergence(
        h, w, data["teacher_hidden"], data["teacher_weight"][rows], kind=kind,
        mask=extra.pop("mask", data["mask"]), bias=b, teacher_bias=data["teacher_bias"][rows],
        tp_group=dist.group.WORLD,
        # default vocab_start (rank * V_local) where shards are equal, explicit otherwise
        vocab_start=None if mode == "even" else start, vocab_size=V,
        reduce_grad_hidden=reduce, chunk_size=chunk, backend=backend, **(OPTIONS | extra),
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return bounds, tuple(out), h.grad, w.grad, b.grad


def _logits_case(rank, world, data, kind):
    bounds = split_vocab(V_PAD, world, mode="uneven")
    start, size = bounds[rank]
    x = data["logits"][:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_divergence(
        x, data["teacher_logprobs"][:, start : start + size], kind=kind, beta=0.3,
        temperature=1.3, mask=data["mask"], tp_group=dist.group.WORLD, vocab_start=start,
        vocab_size=V, chunk_size=7,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return bounds, tuple(out), x.grad


def _rank(rank, world, data):
    """Every case on this rank: linear CASES, the logits op per LOGIT_KINDS, and a
    deterministic=True call on shards of 100 or 200 rows (its ValueError message, or None
    if it ran)."""
    linear = [_linear_case(rank, world, data, *case) for case in CASES]
    logits = [_logits_case(rank, world, data, kind) for kind in LOGIT_KINDS]
    try:
        _linear_case(rank, world, data, "even", True, "jsd", None, "torch", deterministic=True)
        det = None
    except ValueError as exc:
        det = str(exc)
    return linear, logits, det, _disagreements(rank, world, data)


def _disagreements(rank, world, data) -> list:
    """The messages of calls where the last rank differs from the others: in ``kind``, in
    the teacher's temperature, in the mask (None where a call did not raise)."""
    last = rank == world - 1
    mask = data["mask"].clone()
    mask[0] ^= last
    calls = [
        ("jsd" if last else "reverse_kl", {}),
        ("reverse_kl", {"teacher_temperature": 1.0 + last}),
    ]
    calls.append(("reverse_kl", {"mask": mask}))
    out = []
    for kind, extra in calls:
        try:
            _linear_case(rank, world, data, "even", True, kind, None, "torch", **extra)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request):
    """``(world, data, per-rank results)`` of one run_ranks call per world size."""
    data = _data()
    return request.param, data, run_ranks(_rank, request.param, data, timeout=240)


def _truth(data, kind, fn):
    tensors = [data[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
    keys = ("bias", "teacher_bias", "mask", "upstream")
    return fn(*tensors, kind=kind, vocab_size=V, **OPTIONS, **{k: data[k] for k in keys})


def test_linear_outputs_and_gradients_match_fp64(ranks):
    world, data, per_rank = ranks
    for c, (mode, reduce, kind, _, backend) in enumerate(CASES):
        truth = _truth(data, kind, reference_divergence)
        base = _truth(data, kind, materialized_divergence_baseline)
        tag = f"[P={world} {mode} reduce={reduce} {kind} {backend}]"
        first = per_rank[0][0][c][1]
        for rank in range(world):
            _, outs, *_ = per_rank[rank][0][c]
            for name, got, want in zip(DIVERGENCE_OUTPUTS, outs, first, strict=True):
                assert torch.equal(got, want), f"{name}{tag}: rank {rank} differs from rank 0"
        for name, got in zip(DIVERGENCE_OUTPUTS, first, strict=True):
            assert_close(got, truth[name], baseline=base[name], name=name + tag, **TOL.kwargs())
            assert_zero(got, where=~data["mask"], name=f"{name} on masked rows{tag}")
        for key, j in (("grad_weight", 3), ("grad_bias", 4)):
            got = torch.cat([per_rank[r][0][c][j] for r in range(world)])
            assert_close(got, truth[key], baseline=base[key], name=key + tag, **TOL.kwargs())
            assert_zero(got[V:], name=f"{key} on padding rows{tag}")
        grads = [per_rank[r][0][c][2] for r in range(world)]
        if reduce:
            for rank, gh in enumerate(grads):
                assert_close(
                    gh, truth["grad_hidden"], baseline=base["grad_hidden"],
                    name=f"grad_hidden{tag} rank {rank}", **TOL.kwargs(),
                )  # fmt: skip
        else:
            gh = torch.stack(grads).sum(0)
            assert_close(
                gh, truth["grad_hidden"], baseline=base["grad_hidden"],
                name=f"sum of grad_hidden partials{tag}", **TOL.kwargs(),
            )  # fmt: skip
        for rank, gh in enumerate(grads):
            assert_zero(gh, where=~data["mask"], name=f"grad_hidden masked rows{tag} {rank}")


def test_uneven_layout_puts_padding_on_the_last_rank(ranks):
    _, _, per_rank = ranks
    bounds = per_rank[0][0][1][0]
    assert len({size for _, size in bounds}) > 1 and bounds[-1][0] < V < V_PAD


def test_vocab_parallel_top_k_matches_fp64(ranks):
    world, data, per_rank = ranks
    for k, kind in enumerate(LOGIT_KINDS):
        kw = {"kind": kind, "beta": 0.3, "temperature": 1.3, "mask": data["mask"]}
        kw |= {"vocab_size": V, "upstream": data["upstream"]}
        truth = reference_divergence_from_logits(data["logits"], data["teacher_logprobs"], **kw)
        base = materialized_divergence_baseline_from_logits(
            data["logits"], data["teacher_logprobs"], **kw
        )
        tag = f"[P={world} top-k {kind}]"
        first = per_rank[0][1][k][1]
        for rank in range(world):
            for name, got, want in zip(
                DIVERGENCE_OUTPUTS, per_rank[rank][1][k][1], first, strict=True
            ):
                assert torch.equal(got, want), f"{name}{tag}: rank {rank} differs from rank 0"
        for name, got in zip(DIVERGENCE_OUTPUTS, first, strict=True):
            assert_close(got, truth[name], baseline=base[name], name=name + tag, **TOL.kwargs())
        grad = torch.cat([per_rank[r][1][k][2] for r in range(world)], dim=1)
        assert_close(
            grad, truth["grad_logits"], baseline=base["grad_logits"], name="grad_logits" + tag,
            **TOL.kwargs(),
        )  # fmt: skip
        assert_zero(grad[:, V:], name=f"grad_logits padding columns{tag}")


def test_deterministic_refuses_bounds_off_the_grid_on_every_rank(ranks):
    """deterministic=True on shard bounds that are not multiples of 128 (400 rows over 2 or
    4 ranks): every rank raises the documented ValueError; none hangs or falls back."""
    world, _, per_rank = ranks
    for rank in range(world):
        det = per_rank[rank][2]
        assert det is not None, f"rank {rank}: deterministic=True ran on bounds off the grid"
        assert DETERMINISTIC_ERROR in det, det


def test_ranks_that_disagree_all_raise(ranks):
    """A rank with another kind or teacher temperature raises on every rank, naming the
    divergence's options; another mask, naming the targets (the mask's carrier); none
    hangs."""
    world, _, per_rank = ranks
    expected = ["disagree on the divergence's options"] * 2 + ["disagree on the targets"]
    for rank in range(world):
        for got, want in zip(per_rank[rank][3], expected, strict=True):
            assert got is not None and want in got, (rank, got)


DET_LAYOUTS = {  # shard bounds over 1024 rows (V = 1000), on multiples of 128
    "tp2": [(0, 512), (512, 512)],
    "tp4-uneven": [(0, 384), (384, 128), (512, 384), (896, 128)],
}


def _det_data() -> dict:
    """The default path's problem on a head of 1024 rows (V = 1000) for the 128-grid."""
    s = make_problem(N, H, 1000, seed=7, padded_vocab=1024)
    t = make_problem(N, H_T, 1000, seed=8, padded_vocab=1024)
    g = torch.Generator().manual_seed(10)
    biases = {k: torch.randn(1024, generator=g) for k in ("bias", "teacher_bias")}
    return _data() | {"weight": s.weight, "teacher_weight": t.weight} | biases


def _det_call(data, rows, tp_group, start, backend):
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"][rows].clone().requires_grad_()
    b = data["bias"][rows].clone().requires_grad_()
    out = linear_divergence(
        h, w, data["teacher_hidden"], data["teacher_weight"][rows], kind="jsd",
        mask=data["mask"], bias=b, teacher_bias=data["teacher_bias"][rows], tp_group=tp_group,
        vocab_start=start, vocab_size=1000, deterministic=True, backend=backend, **OPTIONS,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return (*out, h.grad, w.grad, b.grad)


def _det_rank(rank, world, data, bounds, backend):
    start, size = bounds[rank]
    return _det_call(data, slice(start, start + size), dist.group.WORLD, start, backend)


NAMES = (*DIVERGENCE_OUTPUTS, "grad_hidden", "grad_weight", "grad_bias")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_bitwise_identical_across_tp(backend):
    """deterministic=True: outputs and gradients torch.equal for TP 1 (no group), 2 and 4
    (bounds on multiples of 128, uneven included, padding on the last rank), and TP 1 as
    accurate as the default path against fp64."""
    data = _det_data()
    layouts = DET_LAYOUTS
    if backend == "triton":  # Triton's interpreter: 8 rows and one (uneven) layout, CI time
        layouts = {"tp4-uneven": DET_LAYOUTS["tp4-uneven"]}
        for key in ("hidden", "teacher_hidden", "mask", "upstream"):
            data[key] = data[key][:8]
    one = _det_call(data, slice(0, 1024), None, None, backend)
    kw = {k: data[k] for k in ("bias", "teacher_bias", "mask", "upstream")}
    tensors = [data[k] for k in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
    truth = reference_divergence(*tensors, kind="jsd", vocab_size=1000, **OPTIONS, **kw)
    base = materialized_divergence_baseline(*tensors, kind="jsd", vocab_size=1000, **OPTIONS, **kw)
    for name, got in zip(NAMES, one, strict=True):
        assert_close(
            got, truth[name], baseline=base[name], name=f"{name} [TP 1, det]", **TOL.kwargs()
        )
    for layout, bounds in layouts.items():
        per_rank = run_ranks(_det_rank, len(bounds), data, bounds, backend, timeout=240)
        for rank, got in enumerate(per_rank):
            for name, a, b in zip(NAMES[:4], got[:4], one[:4], strict=True):
                assert torch.equal(a, b), f"{name}: {layout} rank {rank} vs TP 1"
        for j in (4, 5):
            shards = torch.cat([r[j] for r in per_rank])
            assert torch.equal(shards, one[j]), f"{NAMES[j]}: {layout} vs TP 1"
