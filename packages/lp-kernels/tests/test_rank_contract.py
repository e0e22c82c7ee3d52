"""The per-call rank contract (docs/design.md, "The per-call rank contract").

With ``validate=True`` and a ``tp_group`` of several ranks, the ranks exchange one small
record of each call before any size-dependent collective, so that ranks that disagree
within a call, or one rank with a bad input, all raise the same ``ValueError`` (naming
the field and the ranks) and none is left waiting in a collective: each rank below goes on
to a barrier after the error, which must complete. Rank functions are module-level
(spawned ranks import them); every run has a timeout, so a hang is a failure.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob, linear_logprob_loss, vocab_parallel_logprob
from lp_testing import make_problem, run_ranks

N, H, V = 8, 16, 64

CASES = {  # case -> what every rank's message must contain
    "targets": "disagree on the targets in this call (an order-sensitive checksum",
    "targets-swapped": "disagree on the targets in this call",
    "temperature": "disagree on temperature in this call (rank 0: 1.0, rank 1: 0.7)",
    "rows": "disagree on the number of rows N in this call (rank 0: 8, rank 1: 6)",
    "layout-changed": "explicit vocab_start",
    "requires-grad": "disagree on whether hidden requires grad in this call (rank 0: True, "
    "rank 1: False)",
    "bad-target": "targets outside [0, 64) and not ignore_index=-100 on rank(s) [1] "
    "(rank 1: smallest 0, largest 1000)",
    "entropy-flag": "disagree on return_entropy in this call",
    "ignore-index": "disagree on ignore_index in this call (rank 0: -100, rank 1: -1)",
    "logits-targets": "disagree on the targets in this call",
    "softcap": "disagree on softcap in this call (rank 0: None, rank 1: 30.0)",
    "bias": "disagree on whether a bias is passed (and requires grad) in this call (rank 0: "
    "no bias, rank 1: a bias)",
    "hint": "disagree on the targets in this call (an order-sensitive checksum of their "
    "values: rank 0: ",
    "loss-chunk": "disagree on chunk_size (the loss and divergence ops exchange statistics "
    "per block) in this call (rank 0: None, rank 1: 16)",
    "loss-op": "disagree on the op in this call (rank 0: linear_logprob_loss, rank 1: "
    "linear_logprob)",
}


def _pg_loss(logprob, entropy, lse):
    return -logprob


def _call(rank, case, device):
    p = make_problem(N, H, V, seed=3, device=device)
    hidden, targets = p.hidden.clone(), p.targets.clone()
    weight = p.weight[rank * 32 : (rank + 1) * 32]
    kw = {"tp_group": dist.group.WORLD}
    if case == "logits-targets":
        logits = hidden @ weight.T
        if rank == 1:
            targets[0] = (targets[0] + 1) % V
        return vocab_parallel_logprob(logits, targets, **kw)
    if case in ("loss-chunk", "loss-op"):  # linear_logprob_loss's blocks and op
        if case == "loss-op" and rank == 1:
            return linear_logprob(hidden, weight, targets, **kw)
        chunk = 16 if case == "loss-chunk" and rank == 1 else None
        return linear_logprob_loss(hidden, weight, targets, _pg_loss, chunk_size=chunk, **kw)
    if case == "layout-changed":  # a first call agrees; then rank 1's shard loses a row
        linear_logprob(hidden, weight, targets, **kw)
        if rank == 1:
            weight = weight[:31]
    if rank == 1:
        if case in ("targets", "hint"):
            targets[3] = (targets[3] + 1) % V
        elif case == "targets-swapped":
            targets[[2, 5]] = targets[[5, 2]]
            assert targets[2] != targets[5]
        elif case == "temperature":
            kw["temperature"] = 0.7
        elif case == "rows":
            hidden, targets = hidden[:6], targets[:6]
        elif case == "bad-target":
            targets[0], targets[1] = 1000, 0
        elif case == "entropy-flag":
            kw["return_entropy"] = True
        elif case == "ignore-index":
            kw["ignore_index"] = -1
        elif case == "softcap":
            kw["softcap"] = 30.0
        elif case == "bias":
            kw["bias"] = torch.zeros(weight.shape[0], device=weight.device)
    if case == "requires-grad" and rank == 0:
        hidden.requires_grad_()
    if case == "hint":
        from lp_kernels._prepare import prepare  # the hook a wrapping caller uses
        from lp_kernels.core.transform import LogitTransform

        hint = "HINT: a data-parallel shard?"
        return prepare(hidden, weight, targets, LogitTransform(), hint=hint, **kw)
    return linear_logprob(hidden, weight, targets, **kw)


def _rank(rank, world, cases, device="cpu"):
    if device == "cuda":
        device = f"cuda:{rank}"
    messages = {}
    for case in cases:
        try:
            _call(rank, case, device)
        except ValueError as exc:
            messages[case] = str(exc)
        else:
            messages[case] = None
        dist.barrier()  # every rank got here: none is waiting in a collective
    return messages


def test_mismatched_and_bad_calls_raise_the_same_error_on_every_rank():
    results = run_ranks(_rank, 2, list(CASES), timeout=120)
    for case, expected in CASES.items():
        got = [r[case] for r in results]
        assert got[0] is not None and got[0] == got[1], (case, got)
        assert expected in got[0], (case, got[0])
    assert results[0]["hint"].endswith(". HINT: a data-parallel shard?")


def _agreeing_rank(rank, world):
    """Agreeing ranks pass, also with an all-ignored or empty batch and int32 targets."""
    p = make_problem(N, H, V, seed=3)
    w = p.weight[rank * 32 : (rank + 1) * 32]
    out = linear_logprob(p.hidden, w, p.targets, tp_group=dist.group.WORLD)
    ignored = torch.full((N,), -100, dtype=torch.long)
    linear_logprob(p.hidden, w, ignored, tp_group=dist.group.WORLD)
    linear_logprob(p.hidden[:0], w, p.targets[:0], tp_group=dist.group.WORLD)
    linear_logprob(p.hidden, w, p.targets.int(), tp_group=dist.group.WORLD)
    return out.logprob


def test_agreeing_ranks_pass():
    a, b = run_ranks(_agreeing_rank, 2, timeout=60)
    assert torch.equal(a, b)


def test_targets_checksum_is_order_sensitive_and_exact():
    from lp_kernels.distributed.contract import targets_summary

    t = torch.tensor([5, 7, -100, 3, 2**40, -(2**50)])
    a = targets_summary(t, -100)
    assert a.tolist()[1:] == [-(2**50), 2**40]
    assert not torch.equal(a, targets_summary(t[[1, 0, 2, 3, 4, 5]], -100))
    assert torch.equal(a, targets_summary(t.clone(), -100))
    empty = targets_summary(t[:0], -100).tolist()
    assert empty[1] > empty[2]  # no real target: no range to check


@pytest.mark.multigpu
def test_nccl_mismatched_calls_raise_on_every_rank():
    cases = ["targets", "bad-target"]
    results = run_ranks(_rank, 2, cases, "cuda", backend="nccl", timeout=120)
    for case in cases:
        got = [r[case] for r in results]
        assert got[0] is not None and got[0] == got[1], (case, got)
        assert CASES[case] in got[0], (case, got[0])
