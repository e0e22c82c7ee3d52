"""linear_topk_divergence against fp64, over gloo ranks, and its error contract.

Truth: ``lp_testing.reference_topk_divergence`` (fp64, the student's logits materialized,
every formula over the whole vocabulary). Tolerances are relative to the same materialized
path in fp32 (lp no worse than k x its error, ``lp_testing.DTYPES``). Masked rows hold NaN
hidden states, garbage ids and NaN log-probs and get a nonzero upstream gradient: their
outputs and gradient rows must be exact zeros; padding weight rows get exact zero
gradients. The gloo ranks of one world size run once per module (every case of those tests
in one spawn), and each rank also runs the single-process call for the bitwise checks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from lp_kernels import TopkDivergenceOutput, linear_topk_divergence
from lp_testing import (
    DTYPES,
    assert_close,
    assert_zero,
    make_problem,
    random_upstream,
    reference_topk_divergence,
    run_ranks,
    split_vocab,
)

KINDS = ("forward_kl", "reverse_kl", "jsd", "mixed_kl")
TAILS = ("renormalize", "bucket", "none", "truncate")
FP32 = DTYPES[0]
TOL = dataclasses.replace(FP32, k=8.0)  # sums of k fp32 terms around a merged lse
ALL_OPTIONS = {"temperature": 0.7, "softcap": 6.0, "logit_scale": 1.3}
OUTPUTS = ("divergence", "student_mass", "teacher_mass")


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    h: int
    v: int
    k: int
    pad: int = 0
    masked: int = 0
    bias: bool = False
    options: dict = field(default_factory=dict)


CASES = {
    # one row, prime V and k, default options
    "N1-V53-k7": Case((1,), 8, 53, 7),
    # 2-D rows, prime V and k, padding rows, masked rows, a bias and every logit option
    "B2x7-V211-k11-all": Case((2, 7), 12, 211, 11, pad=5, masked=3, bias=True, options=ALL_OPTIONS),
}


def _payload(n: int, v: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids per row and a sampler's log-probs of them (a teacher over ``v``)."""
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    teacher = (torch.randn(n, v, generator=g) * 2.5).log_softmax(-1)
    top = teacher.topk(k, dim=-1).indices  # half the rows: the teacher's own top-k
    ids[: n // 2] = top[: n // 2]
    return ids, teacher.gather(-1, ids)


def _make(case: Case, seed: int = 0) -> dict:
    n = math.prod(case.lead)
    p = make_problem(case.lead, case.h, case.v, seed=seed, padded_vocab=case.v + case.pad)
    g = torch.Generator().manual_seed(seed + 1)
    ids, lq = _payload(n, case.v, case.k, g)
    mask = torch.ones(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=g)[: case.masked]] = False
    hidden = p.hidden.clone()
    hidden.view(n, -1)[~mask] = math.nan
    ids[~mask] = -1  # masked rows' payload is not read
    lq[~mask] = math.nan
    return {
        "hidden": hidden,
        "weight": p.weight,
        "ids": ids.view(*case.lead, case.k),
        "lq": lq.view(*case.lead, case.k),
        "mask": mask.view(case.lead) if case.masked else None,
        "bias": torch.randn(case.v + case.pad, generator=g) if case.bias else None,
        "vocab_size": case.v if case.pad else None,
        "upstream": random_upstream(case.lead, seed=seed),
    }


def _run(data: dict, kind: str, tail: str, options: dict, **extra):
    """The op on fresh leaves, backward with the upstream; ``(outputs, grads)``."""
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    b = None if data["bias"] is None else data["bias"].clone().requires_grad_()
    out = linear_topk_divergence(
        h, w, data["ids"], data["lq"], kind=kind, tail=tail, beta=0.3, mask=data["mask"],
        bias=b, vocab_size=data["vocab_size"], **options, **extra,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return out, {
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
        "grad_bias": None if b is None else b.grad,
    }


def _truth(data: dict, kind: str, tail: str, options: dict, dtype=torch.float64) -> dict:
    return reference_topk_divergence(
        data["hidden"], data["weight"], data["ids"], data["lq"], kind=kind, tail=tail,
        beta=0.3, mask=data["mask"], bias=data["bias"], vocab_size=data["vocab_size"],
        upstream=data["upstream"], dtype=dtype, **options,
    )  # fmt: skip


def _check(out, grads, data, kind, tail, options, tag, tol=TOL):
    truth = _truth(data, kind, tail, options)
    base = _truth(data, kind, tail, options, dtype=torch.float32)
    keep = None if data["mask"] is None else data["mask"]
    for name, got in zip(OUTPUTS, out, strict=True):
        if got is None:
            assert name == "student_mass" and tail == "renormalize", name
            continue
        assert got.dtype == torch.float32 and got.shape == data["upstream"].shape
        assert_close(got, truth[name], baseline=base[name], name=name + tag, **tol.kwargs())
        if keep is not None:
            assert_zero(got, where=~keep, name=f"{name} on masked rows{tag}")
    for name, got in grads.items():
        if got is None:
            continue
        assert_close(got, truth[name], baseline=base[name], name=name + tag, **tol.kwargs())
    if keep is not None:
        assert_zero(grads["grad_hidden"], where=~keep, name=f"grad_hidden masked rows{tag}")
    if data["vocab_size"] is not None:
        assert_zero(grads["grad_weight"][data["vocab_size"] :], name=f"padding rows{tag}")


@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_fp64(case, tail, kind):
    data = _make(CASES[case])
    options = CASES[case].options
    out, grads = _run(data, kind, tail, options, backend="torch")
    assert isinstance(out, TopkDivergenceOutput)
    _check(out, grads, data, kind, tail, options, f"[{case} {kind} {tail}]")


@pytest.mark.parametrize("tail", TAILS)
def test_deterministic_matches_fp64_and_repeats(tail):
    data = _make(CASES["B2x7-V211-k11-all"], seed=3)
    options = ALL_OPTIONS
    out, grads = _run(data, "jsd", tail, options, backend="torch", deterministic=True)
    _check(out, grads, data, "jsd", tail, options, f"[deterministic {tail}]")
    again, grads2 = _run(data, "jsd", tail, options, backend="torch", deterministic=True)
    assert torch.equal(out.divergence, again.divergence)
    for name, got in grads.items():
        assert got is None or torch.equal(got, grads2[name]), name


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("tail", ("bucket", "truncate"))
def test_backends_on_cpu_match_fp64(backend, tail, deterministic):
    """Both backends of the log-sum-exp pass (triton under Triton's CPU interpreter)."""
    data = _make(CASES["B2x7-V211-k11-all"], seed=5)
    extra = {"backend": backend, "deterministic": deterministic}
    out, grads = _run(data, "reverse_kl", tail, ALL_OPTIONS, **extra)
    _check(out, grads, data, "reverse_kl", tail, ALL_OPTIONS, f"[{backend} {tail}]")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("tail", ("bucket", "truncate"))
def test_triton_backend_matches_fp64(tail, deterministic):
    data = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in _make(CASES["B2x7-V211-k11-all"]).items()
    }
    extra = {"backend": "triton", "deterministic": deterministic}
    out, grads = _run(data, "reverse_kl", tail, ALL_OPTIONS, **extra)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    out = TopkDivergenceOutput(*(None if x is None else x.cpu() for x in out))
    grads = {k: None if v is None else v.cpu() for k, v in grads.items()}
    _check(out, grads, cpu, "reverse_kl", tail, ALL_OPTIONS, f"[triton {tail}]")


def test_bucket_tail_stays_finite_when_the_ids_hold_all_the_mass():
    """A student whose top id has probability 1 in fp32 and a teacher whose payload sums
    to 1: the tail buckets' log top-k mass is clamped, the outputs and gradients finite."""
    hidden = torch.tensor([[40.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], requires_grad=True)
    ids = torch.tensor([[0, 1]])
    lq = torch.tensor([[math.log(0.75), math.log(0.25)]])
    for kind in KINDS:
        out = linear_topk_divergence(hidden, weight, ids, lq, kind=kind, tail="bucket")
        out.divergence.sum().backward()
        assert torch.isfinite(out.divergence).all(), kind
        assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all(), kind


def test_inf_teacher_logprobs_drop_out():
    """A padded payload (``-inf`` log-probs) gives the forward KL without those entries
    where the student is not renormalized over the ids (``none``, ``truncate``)."""
    data = _make(CASES["N1-V53-k7"])
    padded = dict(data, lq=data["lq"].clone())
    padded["lq"][..., -2:] = -math.inf
    short = dict(data, ids=data["ids"][..., :-2], lq=data["lq"][..., :-2])
    for tail in ("none", "truncate"):
        a, _ = _run(padded, "forward_kl", tail, {})
        b, _ = _run(short, "forward_kl", tail, {})
        assert_close(a.divergence, b.divergence.double(), name=f"-inf entries [{tail}]")


# ---------------------------------------------------------------------------- errors


def _args():
    data = _make(CASES["N1-V53-k7"])
    return data["hidden"], data["weight"], data["ids"], data["lq"]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"kind": "kl"}, ValueError, "kind must be one of"),
        ({"tail": "bucketed"}, ValueError, "tail must be one of"),
        ({"kind": "jsd", "beta": 1.0}, ValueError, "beta must be in"),
        ({"kind": "mixed_kl", "beta": 1.5}, ValueError, "beta must be in"),
        ({"beta": "0.5"}, TypeError, "beta must be a Python float"),
        ({"outside_logprob": 1.0}, ValueError, "outside_logprob must be"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"mask": torch.ones(1)}, TypeError, "mask must be None or a bool"),
        ({"mask": torch.ones(2, dtype=torch.bool)}, ValueError, "mask must have"),
    ],
    ids=str,
)
def test_bad_options_raise(change, error, match):
    with pytest.raises(error, match=match):
        linear_topk_divergence(*_args(), **change)


def test_bad_payloads_raise():
    hidden, weight, ids, lq = _args()
    cases = [
        ((hidden, weight, ids.float(), lq), TypeError, "teacher_ids must be int64"),
        ((hidden, weight, ids, lq.long()), TypeError, "teacher_logprobs must be float32"),
        ((hidden, weight, ids, lq.clone().requires_grad_()), ValueError, "requires grad"),
        ((hidden, weight, ids[:, :3], lq), ValueError, "teacher_logprobs must have"),
        ((hidden, weight, ids[0], lq[0]), ValueError, "teacher_ids must be \\[\\*, k\\]"),
        ((hidden, weight, ids[:, :0], lq[:, :0]), ValueError, "k >= 1"),
        ((hidden, weight, ids + 53, lq), ValueError, "teacher_ids must be in \\[0, 53\\)"),
        ((hidden, weight, ids - 60, lq), ValueError, "teacher_ids must be in"),
        ((hidden, weight, ids[:, [0, 1, 0]], lq[:, :3]), ValueError, "repeats an id"),
        ((hidden, weight, ids, lq * math.nan), ValueError, "NaN or \\+inf"),
        ((hidden, weight[:, :3], ids, lq), ValueError, "weight"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            linear_topk_divergence(*args)
    # validate=False takes the caller's word (no host sync): no error for a repeat
    linear_topk_divergence(hidden, weight, ids[:, [0, 1, 0]], lq[:, :3], validate=False)


# ---------------------------------------------------------------------------- gloo ranks

N, H, V, V_PAD, K = 11, 10, 389, 512, 13
TP_CASES = [  # (split mode, tail, kind, reduce_grad_hidden, deterministic)
    ("uneven", "renormalize", "forward_kl", True, False),
    ("uneven", "bucket", "reverse_kl", False, False),
    ("even", "none", "jsd", True, False),
    ("even", "truncate", "mixed_kl", True, True),
    ("even", "bucket", "jsd", True, True),
]


def _tp_data() -> dict:
    case = Case((N,), H, V, K, pad=V_PAD - V, masked=2, bias=True, options=ALL_OPTIONS)
    return _make(case, seed=11)


def _tp_case(rank, world, data, mode, tail, kind, reduce, det, group=True, **extra):
    start, size = split_vocab(V_PAD, world, mode=mode)[rank] if group else (0, V_PAD)
    rows = slice(start, start + size)
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"][rows].clone().requires_grad_()
    b = data["bias"][rows].clone().requires_grad_()
    out = linear_topk_divergence(
        h, w, extra.pop("ids", data["ids"]), data["lq"], kind=kind, tail=tail, beta=0.3,
        mask=data["mask"], bias=b, tp_group=dist.group.WORLD if group else None,
        vocab_start=start, vocab_size=V, reduce_grad_hidden=reduce, deterministic=det,
        backend="torch", **ALL_OPTIONS, **extra,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return tuple(out), h.grad, w.grad, b.grad


def _errors(rank, world, data) -> list:
    """The messages of calls where the last rank passes other ids, or an id out of range."""
    last = rank == world - 1
    other = data["ids"].clone()
    other[3, 0] = other[3, 1] if last else other[3, 0]  # a repeat on the last rank only
    wild = data["ids"].clone()
    wild[5, 2] = V + 7 if last else wild[5, 2]
    out = []
    for ids in (other, wild):
        try:
            _tp_case(rank, world, data, "even", "bucket", "forward_kl", True, False, ids=ids)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def _rank(rank, world, data):
    tp = [_tp_case(rank, world, data, *c) for c in TP_CASES]
    single = [_tp_case(rank, world, data, *c, group=False) if c[4] else None for c in TP_CASES]
    return tp, single, _errors(rank, world, data)


# TP 4 passes too (run with WORLDS = (2, 4)) but doubles the module's time: a gloo spawn
# is most of it, and the module must stay well under a minute on two cores
WORLDS = (2,)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"tp{w}")
def ranks(request):
    data = _tp_data()
    return request.param, data, run_ranks(_rank, request.param, data, timeout=240)


def test_tp_matches_fp64(ranks):
    world, data, per_rank = ranks
    for c, (mode, tail, kind, reduce, _) in enumerate(TP_CASES):
        tag = f"[P={world} {mode} {tail} {kind} reduce={reduce}]"
        outs = [per_rank[r][0][c] for r in range(world)]
        for r in range(1, world):
            for got, want in zip(outs[r][0], outs[0][0], strict=True):
                assert (got is None and want is None) or torch.equal(got, want), tag
        grad_hidden = outs[0][1] if reduce else torch.stack([o[1] for o in outs]).sum(0)
        grads = {
            "grad_hidden": grad_hidden,
            "grad_weight": torch.cat([o[2] for o in outs]),
            "grad_bias": torch.cat([o[3] for o in outs]),
        }
        data_v = dict(data, vocab_size=V)
        _check(TopkDivergenceOutput(*outs[0][0]), grads, data_v, kind, tail, ALL_OPTIONS, tag)


def test_tp_deterministic_is_bitwise_the_single_process(ranks):
    world, _, per_rank = ranks
    for c, case in enumerate(TP_CASES):
        if not case[4]:
            continue
        tp = [per_rank[r][0][c] for r in range(world)]
        one = per_rank[0][1][c]
        tag = f"[P={world} {case}]"
        for got, want in zip(tp[0][0], one[0], strict=True):
            assert (got is None and want is None) or torch.equal(got, want), f"outputs{tag}"
        for r in range(world):
            assert torch.equal(tp[r][1], one[1]), f"grad_hidden rank {r}{tag}"
        assert torch.equal(torch.cat([o[2] for o in tp]), one[2]), f"grad_weight{tag}"
        assert torch.equal(torch.cat([o[3] for o in tp]), one[3]), f"grad_bias{tag}"


def test_tp_disagreement_raises_on_every_rank(ranks):
    world, _, per_rank = ranks
    for j, what in enumerate(("a repeated id", "an id out of range")):
        messages = [per_rank[r][2][j] for r in range(world)]
        assert all(m is not None for m in messages), f"{what}: {messages}"
        assert len(set(messages)) == 1, f"{what}: the ranks raised different errors"
        assert "teacher_ids" in messages[0], messages[0]
