"""Vocabulary-parallel linear_logprob / vocab_parallel_logprob over real gloo ranks.

Each rank holds a contiguous shard (even or uneven, padded vocabulary in the last one);
outputs must match the single-process result on every rank, grad_weight must be the
rank's slice of the full gradient, and grad_hidden the full sum (or the rank's partial
with reduce_grad_hidden=False, which sums to it). Rank functions are module-level so
the forkserver children can import them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lp_kernels.distributed.layout as lp_layout
from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import RankError, assert_close, make_problem, run_ranks, split_vocab

CASES = [  # (split mode, reduce_grad_hidden)
    ("even", True),
    ("uneven", True),
    ("uneven", False),
]


def _problem():
    return make_problem(31, 24, 389, seed=13, ignore_frac=0.15, padded_vocab=400, temperature=0.85)


def _upstream(n):
    g = torch.Generator().manual_seed(4)
    return torch.randn(3, n, generator=g)


def _loss(out, g):
    return (out.logprob * g[0] + out.entropy * g[1] + out.lse * g[2]).sum()


def _linear_rank(rank, world, problem, cases, backend="torch"):
    results = []
    g = _upstream(problem.n)
    for mode, reduce in cases:
        bounds = split_vocab(problem.v_padded, world, mode=mode)
        start, size = bounds[rank]
        h = problem.hidden.clone().requires_grad_()
        w = problem.weight[start : start + size].clone().requires_grad_()
        out = linear_logprob(
            h,
            w,
            problem.targets,
            tp_group=dist.group.WORLD,
            # default vocab_start (rank * V_local) where shards are equal, explicit otherwise
            vocab_start=None if len({sz for _, sz in bounds}) == 1 else start,
            reduce_grad_hidden=reduce,
            return_entropy=True,
            return_lse=True,
            backend=backend,
            **problem.op_kwargs(),
        )
        _loss(out, g).backward()
        results.append((bounds, out.logprob, out.entropy, out.lse, h.grad, w.grad))
    return results


@pytest.mark.parametrize(
    ("world", "backend"),
    [(2, "torch"), (3, "torch"), (4, "torch"), (8, "torch"), (3, "triton"), (8, "triton")],
)
def test_linear_logprob_tp_matches_single_process(world, backend):
    problem = _problem()
    p = problem.with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, **p.op_kwargs()
    )
    _loss(ref, _upstream(p.n)).backward()
    per_rank = run_ranks(_linear_rank, world, problem, CASES, backend, timeout=240)
    for c, (mode, reduce) in enumerate(CASES):
        partial_sum = torch.zeros_like(p.hidden.grad)
        for rank in range(world):
            bounds, lp, ent, lse, gh, gw = per_rank[rank][c]
            start, size = bounds[rank]
            tag = f"[P={world} {mode} reduce={reduce} rank {rank}]"
            for name, got, want in (
                ("logprob", lp, ref.logprob),
                ("entropy", ent, ref.entropy),
                ("lse", lse, ref.lse),
            ):
                assert_close(got, want, rtol=1e-5, atol=1e-5, name=name + tag)
            assert_close(
                gw,
                p.weight.grad[start : start + size],
                rtol=1e-5,
                atol=1e-5,
                name="grad_weight" + tag,
            )
            if reduce:
                assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-5, name="grad_hidden" + tag)
            else:
                partial_sum += gh
        if not reduce:
            assert_close(
                partial_sum,
                p.hidden.grad,
                rtol=1e-5,
                atol=1e-5,
                name=f"sum of partials [P={world}]",
            )
        # Every rank returns bitwise the same outputs.
        for rank in range(1, world):
            for k in (1, 2, 3):
                assert torch.equal(per_rank[rank][c][k], per_rank[0][c][k])


def _logits_rank(rank, world, logits, targets, vocab_size):
    bounds = split_vocab(logits.shape[1], world, mode="uneven")
    start, size = bounds[rank]
    x = logits[:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_logprob(
        x,
        targets,
        tp_group=dist.group.WORLD,
        vocab_start=start,
        vocab_size=vocab_size,
        return_entropy=True,
        return_lse=True,
        temperature=1.5,
    )
    g = _upstream(targets.numel())
    _loss(out, g).backward()
    return bounds, out.logprob, out.entropy, out.lse, x.grad


def test_vocab_parallel_logprob_tp_matches_single_process():
    problem = _problem()
    logits = (problem.hidden @ problem.weight.T).detach()
    x = logits.clone().requires_grad_()
    ref = vocab_parallel_logprob(
        x,
        problem.targets,
        vocab_size=problem.vocab_size,
        return_entropy=True,
        return_lse=True,
        temperature=1.5,
    )
    _loss(ref, _upstream(problem.n)).backward()
    for rank, (bounds, lp, ent, lse, gx) in enumerate(
        run_ranks(_logits_rank, 3, logits, problem.targets, problem.vocab_size, timeout=120)
    ):
        start, size = bounds[rank]
        for name, got, want in (
            ("logprob", lp, ref.logprob),
            ("entropy", ent, ref.entropy),
            ("lse", lse, ref.lse),
        ):
            assert_close(got, want, rtol=1e-5, atol=1e-5, name=f"{name}[rank {rank}]")
        assert_close(
            gx,
            x.grad[:, start : start + size],
            rtol=1e-5,
            atol=1e-6,
            name=f"grad_logits[rank {rank}]",
        )


def _count_gathers_rank(rank, world, validate):
    """validate=True: one per-call record and the statistics, every call. validate=False:
    the layout table on the first call of a layout only, then the statistics."""
    calls = []
    real = lp_layout.dist.all_gather_into_tensor

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    lp_layout.dist.all_gather_into_tensor = counting
    try:
        p = make_problem(5, 8, 64, seed=1)
        w = p.weight[rank * 32 : (rank + 1) * 32]
        counts = []
        for _ in range(3):
            before = len(calls)
            linear_logprob(p.hidden, w, p.targets, tp_group=dist.group.WORLD, validate=validate)
            counts.append(len(calls) - before)
        return counts
    finally:
        lp_layout.dist.all_gather_into_tensor = real


def test_layout_is_validated_once_per_group_and_layout():
    for counts in run_ranks(_count_gathers_rank, 2, False, timeout=60):
        assert counts == [2, 1, 1]  # layout table + statistics, then statistics only
    for counts in run_ranks(_count_gathers_rank, 2, True, timeout=60):
        assert counts == [2, 2, 2]  # the per-call record (layout included) + statistics


def _bad_layout_rank(rank, world, case):
    p = make_problem(4, 8, 60, seed=0)
    if case == "gap":  # rank 1 starts past the end of rank 0's shard
        start, size = (0, 30) if rank == 0 else (31, 29)
        w, kw = p.weight[start : start + size], {"vocab_start": start}
    elif case == "uneven-without-start":
        size = 20 if rank == 0 else 40
        w, kw = p.weight[:size], {}
    elif case == "hidden-size":  # one rank's shard has the wrong H
        w = p.weight[:30] if rank == 0 else torch.randn(30, 9)
        kw = {}
    elif case == "deterministic-flag":
        w, kw = p.weight[rank * 30 : rank * 30 + 30], {"deterministic": rank == 0}
    elif case == "empty-shard":  # rank 1 holds no vocabulary row
        w = p.weight if rank == 0 else p.weight[:0]
        kw = {"vocab_start": 0 if rank == 0 else p.weight.shape[0]}
    elif case == "vocab-size":
        w, kw = p.weight[rank * 30 : rank * 30 + 30], {"vocab_size": 60 if rank == 0 else 59}
    else:
        raise AssertionError(case)
    linear_logprob(p.hidden, w, p.targets, tp_group=dist.group.WORLD, **kw)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("gap", "contiguous"),
        ("uneven-without-start", "explicit vocab_start"),
        ("hidden-size", "rank 1 does not fit hidden"),
        ("vocab-size", "disagree on the vocab_size"),
        ("deterministic-flag", "disagree on the deterministic flag"),
        ("empty-shard", "weight shard of rank 1 is empty (V_local = 0)"),
    ],
)
def test_bad_layout_raises_on_every_rank(case, message):
    with pytest.raises(RankError) as info:
        run_ranks(_bad_layout_rank, 2, case, timeout=60)
    text = str(info.value)
    assert text.count("ValueError") >= 2, text  # both ranks raised, none hung
    assert message in text


def _dtensor_rank(rank, world, arg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = make_problem(4, 8, 60, seed=0)
    if arg == "hidden":  # a DTensor hidden goes with a DTensor weight only (test_dtensor.py)
        hidden = distribute_tensor(p.hidden, mesh, [Replicate()])
        linear_logprob(
            hidden, p.weight[rank * 30 : (rank + 1) * 30], p.targets, tp_group=dist.group.WORLD
        )
    else:
        logits = distribute_tensor(p.hidden @ p.weight.T, mesh, [Shard(1)])
        vocab_parallel_logprob(logits, p.targets, tp_group=dist.group.WORLD)


@pytest.mark.parametrize(
    ("arg", "message", "remedy"),
    [
        (
            "hidden",
            "hidden is a DTensor (placements (Replicate(),)); lp takes local tensors here",
            "only with a DTensor weight",
        ),
        (
            "logits",
            "logits is a DTensor (placements (Shard(dim=1),)); lp takes local tensors here",
            "logits.to_local() with tp_group",
        ),
    ],
)
def test_dtensor_inputs_are_refused_on_every_rank(arg, message, remedy):
    """A DTensor reaching the checks (hidden with a plain weight, logits) gets lp's TypeError
    naming what to pass instead of DTensor's 'mixed torch.Tensor and DTensor' error from
    inside a backend. DTensor weights: test_dtensor.py."""
    with pytest.raises(RankError) as info:
        run_ranks(_dtensor_rank, 2, arg, timeout=60)
    text = str(info.value)
    assert text.count("TypeError") >= 2, text  # both ranks raised, none hung
    assert message in text
    assert remedy in text


def test_triton_tp_with_unequal_split_counts():
    """Uneven shards spanning different numbers of Triton vocabulary splits still exchange
    equal-sized statistics (a rank-dependent size would hang the all-gather)."""
    problem = make_problem(9, 16, 2600, seed=21, ignore_frac=0.2, padded_vocab=2688)
    p = problem.with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, **p.op_kwargs()
    )
    _loss(ref, _upstream(p.n)).backward()
    cases = [("uneven", True)]
    per_rank = run_ranks(_linear_rank, 2, problem, cases, "triton", timeout=240)
    for rank in range(2):
        bounds, lp, ent, _lse, gh, gw = per_rank[rank][0]
        start, size = bounds[rank]
        assert_close(lp, ref.logprob, rtol=1e-5, atol=1e-5, name=f"logprob[rank {rank}]")
        assert_close(ent, ref.entropy, rtol=1e-5, atol=1e-5, name=f"entropy[rank {rank}]")
        assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-5, name=f"grad_hidden[rank {rank}]")
        assert_close(
            gw,
            p.weight.grad[start : start + size],
            rtol=1e-5,
            atol=1e-5,
            name=f"grad_weight[rank {rank}]",
        )
    assert (
        split_vocab(problem.v_padded, 2, mode="uneven")[1][1] > 1024
    )  # spans 2+ interpreter splits


def _group_of_one_rank(rank, world, problem):
    h = problem.hidden.clone().requires_grad_()
    out = linear_logprob(h, problem.weight, problem.targets, tp_group=dist.group.WORLD)
    out.logprob.sum().backward()
    return out.logprob, h.grad


def test_group_of_size_one_equals_no_group():
    problem = make_problem(11, 8, 50, seed=2, ignore_frac=0.2)
    h = problem.hidden.clone().requires_grad_()
    ref = linear_logprob(h, problem.weight, problem.targets)
    ref.logprob.sum().backward()
    ((lp, gh),) = run_ranks(_group_of_one_rank, 1, problem, timeout=60)
    assert torch.equal(lp, ref.logprob) and torch.equal(gh, h.grad)


def _padding_shard_rank(rank, world, problem, deterministic):
    from lp_kernels.core.matmul import scratch

    scratch.poison = True  # every unwritten scratch element reads as NaN
    start, size = split_vocab(problem.v_padded, world, mode="even")[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    out = linear_logprob(
        h, w, problem.targets, tp_group=dist.group.WORLD, reduce_grad_hidden=False,
        return_entropy=True, return_lse=True, backend="triton", deterministic=deterministic,
        **problem.op_kwargs(),
    )  # fmt: skip
    _loss(out, _upstream(problem.n)).backward()
    return out.logprob, h.grad, w.grad


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_triton_shard_of_padding_only(deterministic):
    """A rank whose shard holds only padding columns (a small vocabulary padded to 128 x
    TP) runs no d_logits chunk: its partial grad_hidden and its grad_weight are exact zeros,
    not uninitialised scratch (NaN-poisoned here), and rank 0's partial is the whole sum."""
    problem = make_problem(9, 16, 100, seed=5, ignore_frac=0.2, padded_vocab=256)
    p = problem.with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, **p.op_kwargs()
    )
    _loss(ref, _upstream(p.n)).backward()
    (lp0, gh0, gw0), (lp1, gh1, gw1) = run_ranks(
        _padding_shard_rank, 2, problem, deterministic, timeout=240
    )
    assert split_vocab(problem.v_padded, 2, mode="even")[1][0] >= 100  # rank 1: padding only
    assert torch.equal(gh1, torch.zeros_like(gh1)) and torch.equal(gw1, torch.zeros_like(gw1))
    assert torch.equal(lp0, lp1)
    assert_close(lp0, ref.logprob, rtol=1e-5, atol=1e-5, name="logprob")
    assert_close(gh0, p.hidden.grad, rtol=1e-5, atol=1e-5, name="grad_hidden (rank 0)")
    assert_close(gw0, p.weight.grad[:128], rtol=1e-5, atol=1e-5, name="grad_weight (rank 0)")


def _block_sums_rank(rank, world, problem, deterministic, backend):
    """Rank of the test below: 16-row triton token chunks, torch chunks of 16 x (rank + 1)
    rows (ranks may chunk differently: the default follows the shard), 24-row sum blocks
    for torch; every dist.all_reduce is recorded."""
    import lp_kernels.distributed.collectives as lp_collectives
    from lp_kernels.backends.triton.config import config_for, use_config

    base = config_for(problem.hidden.device, problem.hidden.dtype)
    cfg = base.replace(backward={"token_chunk": 16})
    lp_collectives.SUM_ROWS = 24
    calls, all_reduce = [], dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((str(tensor.dtype), tuple(tensor.shape), async_op))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    start, size = split_vocab(problem.v_padded, world, mode="even")[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    dist.all_reduce = spy
    try:
        with use_config(cfg):  # the backward keeps the forward's config
            out = linear_logprob(
                h, w, problem.targets, tp_group=dist.group.WORLD, return_entropy=True,
                return_lse=True, backend=backend, deterministic=deterministic,
                chunk_size=16 * (rank + 1), **problem.op_kwargs(),
            )  # fmt: skip
        calls.clear()  # the backward's collectives only
        _loss(out, _upstream(problem.n)).backward()
    finally:
        dist.all_reduce = all_reduce
    return [c for c in calls if c[1][1:] == (problem.h,)], h.grad, w.grad


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grad_hidden_sum_starts_per_token_block(backend, deterministic):
    """grad_hidden's all-reduce starts per block of rows as soon as the block's rows are
    final, asynchronously, to run beside the GEMMs that follow: triton's 16-row token
    chunks of its last vocabulary chunk; for torch, whose ranks chunk their rows
    differently here (16, 32 and 48 rows), blocks of SUM_ROWS = 24 rows, started when a
    chunk completes them. Every rank makes the same calls, so the collectives match,
    including a rank with no vocabulary chunk (rank 2: padding only; synchronously with
    triton and in deterministic mode); the sum is the single process's gradient (bitwise
    in deterministic mode)."""
    from lp_kernels.backends.triton.config import config_for, use_config

    problem = make_problem(37, 24, 250, seed=6, ignore_frac=0.2, padded_vocab=384)
    p = problem.with_grad()
    base = config_for(p.hidden.device, p.hidden.dtype)
    with use_config(base.replace(backward={"token_chunk": 16})):  # as in the ranks
        ref = linear_logprob(
            p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True,
            backend=backend, deterministic=deterministic, chunk_size=16, **p.op_kwargs(),
        )  # fmt: skip
    _loss(ref, _upstream(p.n)).backward()
    ranks = run_ranks(_block_sums_rank, 3, problem, deterministic, backend, timeout=240)
    dtype = "torch.int64" if deterministic else "torch.float32"
    sizes = (16, 16, 5) if backend == "triton" else (24, 13)
    blocks = [(dtype, (rows, problem.h)) for rows in sizes]
    for rank, (calls, gh, gw) in enumerate(ranks):
        assert [c[:2] for c in calls] == blocks, f"rank {rank}: {calls}"
        # the default torch path runs rank 2's chunks too; with deterministic=True rank 2
        # owns no tile and sums at the end
        started = rank < 2 or (backend == "torch" and not deterministic)
        assert {c[2] for c in calls} == {started}, f"rank {rank}: {calls}"
        start, size = split_vocab(problem.v_padded, 3, mode="even")[rank]
        want_w = p.weight.grad[start : start + size]
        if deterministic:
            assert torch.equal(gh, p.hidden.grad), f"grad_hidden (rank {rank})"
        else:
            assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-5, name=f"grad_hidden {rank}")
        if deterministic and backend == "triton":  # (torch: grad_W sums its own chunks)
            assert torch.equal(gw, want_w), f"grad_weight (rank {rank})"
        else:
            assert_close(gw, want_w, rtol=1e-5, atol=1e-5, name=f"grad_weight {rank}")
    assert split_vocab(problem.v_padded, 3, mode="even")[2][0] >= 250  # rank 2: padding only
