"""The triton forward's splits and merges: the split width, the merge of runs of partials
that makes one partial per rank (tensor parallel) or per tile (``deterministic=True``) before the
all-gather, and the final merge, against fp64 and bit for bit where the algebra is exact."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob
from lp_kernels.backends.triton import forward as fwd
from lp_kernels.backends.triton.config import INTERPRET_CONFIG, use_config
from lp_kernels.backends.triton.plan import split_width
from lp_testing import (
    assert_bitwise_equal,
    assert_close,
    make_problem,
    reference_outputs,
    run_ranks,
    split_vocab,
)

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="CPU tensors through Triton's interpreter (the GPU runs cover the CUDA launches)",
)


def _partials(n: int, splits: int, width: int, seed: int):
    """fp32 partials ``[splits, n, 4]`` of random logits, each computed in fp64 and
    rounded once, the targets' terms in the splits that hold them, and the fp64 truth."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, splits * width, generator=gen, dtype=torch.float64) * 3
    z[:, : width // 2] -= 40  # the first split's mass far below the others'
    targets = torch.randint(0, splits * width, (n,), generator=gen)
    stats = torch.zeros(splits, n, 4, dtype=torch.float64)
    for k in range(splits):
        zk = z[:, k * width : (k + 1) * width]
        m = zk.max(dim=1).values
        e = torch.exp(zk - m[:, None])
        stats[k, :, 0] = m
        stats[k, :, 1] = e.sum(1)
        stats[k, :, 2] = (e * (zk - m[:, None])).sum(1)
        mine = (targets >= k * width) & (targets < (k + 1) * width)
        stats[k, mine, 3] = z[mine, targets[mine]]
    lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    truth = {
        "lse": lse,
        "logprob": z.gather(1, targets[:, None])[:, 0] - lse,
        "entropy": -(p * torch.log_softmax(z, dim=1)).sum(1),
    }
    return stats.float(), targets, truth


def _outputs(stats, targets):
    _, _, (logprob, entropy, lse) = fwd.merge_outputs(
        stats, targets, -100, entropy=True, return_lse=True
    )
    return {"logprob": logprob, "entropy": entropy, "lse": lse}


@interpreter
@pytest.mark.parametrize(("n", "splits", "run"), [(1, 37, 5), (300, 37, 5), (300, 13, 13)])
def test_merged_runs_match_fp64(n, splits, run):
    """Runs of partials merged into one each (the last run shorter), then the runs' partials
    merged: the same outputs as one merge of every partial, to fp32 rounding, and both
    against fp64 (37 partials: more than one block of loads in flight, with a remainder)."""
    stats, targets, truth = _partials(n, splits, 16, seed=splits + n)
    flat = _outputs(stats, targets)
    merged = fwd.merge_runs(stats, run, entropy=True)
    assert merged.shape == (math.ceil(splits / run), n, 4)
    two_level = _outputs(merged, targets)
    for name in ("lse", "logprob", "entropy"):
        for got in (flat, two_level):
            assert_close(got[name], truth[name], atol=1e-5, rtol=2e-6, name=name)


@interpreter
def test_merge_of_one_partial_is_exact():
    """A run of one partial is that partial, bit for bit: the rescaling weight is
    e^0 = 1 (without entropy the run's third column is 0)."""
    stats, _, _ = _partials(77, 6, 16, seed=3)
    stats[2, :5] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0])  # a split with no mass
    assert_bitwise_equal(fwd.merge_runs(stats, 1, entropy=True), stats, "entropy")
    plain = fwd.merge_runs(stats, 1, entropy=False)
    assert_bitwise_equal(plain[..., [0, 1, 3]], stats[..., [0, 1, 3]], "no entropy")
    assert torch.equal(plain[..., 2], torch.zeros_like(plain[..., 2]))


@interpreter
def test_run_without_mass_is_an_empty_partial_and_keeps_nan():
    """A run whose maximum is -inf merges to (-inf, 0, 0, T), as an empty split (not the
    NaN of e^(-inf + inf)), so the final merge adds exact zeros for it; a NaN it carries
    still reaches the outputs."""
    stats, targets, _ = _partials(9, 4, 16, seed=5)
    empty = torch.tensor([float("-inf"), 0.0, 0.0, 0.0])
    padded = torch.cat([stats, empty.expand(2, 9, 4)])  # two empty partials: one run
    merged = fwd.merge_runs(padded, 4, entropy=True)
    assert_bitwise_equal(merged[1], empty.expand(9, 4), "empty run")
    only_real = _outputs(fwd.merge_runs(stats, 4, entropy=True), targets)
    for name, x in _outputs(merged, targets).items():
        assert_bitwise_equal(x, only_real[name], name)
    padded[4, 3, 1] = float("nan")  # a NaN sum in a run without mass
    bad = _outputs(fwd.merge_runs(padded, 4, entropy=True), targets)
    assert torch.isnan(bad["lse"][3]) and not torch.isnan(bad["lse"][:3]).any()


def _narrow_config():
    # 2053 columns: 3 splits of 1024 < 8, so splits of 256 (9 of them)
    return INTERPRET_CONFIG.replace(forward={"narrow_split": 256, "min_splits": 8})


@interpreter
def test_narrow_splits_exact_and_batch_invariant():
    """The narrow split width in the default path: parity with fp64 and each row's bits
    whatever else shares the call."""
    cfg = _narrow_config()
    assert split_width(2053, cfg) == 256
    p = make_problem(70, 40, 2053, dtype=torch.float32, seed=21, ignore_frac=0.1)
    kw = {"return_entropy": True, "return_lse": True}
    kw["backend"] = "triton"
    with use_config(cfg):
        full = linear_logprob(p.hidden, p.weight, p.targets, **kw)
    truth = reference_outputs(p.hidden, p.weight, p.targets)
    for name in ("logprob", "entropy", "lse"):
        assert_close(getattr(full, name), truth[name], atol=2e-5, rtol=2e-6, name=name)
    for rows in (torch.tensor([5]), torch.arange(1, 70, 3)):
        with use_config(cfg):
            sub = linear_logprob(p.hidden[rows], p.weight, p.targets[rows], **kw)
        for name in ("logprob", "entropy", "lse"):
            assert_bitwise_equal(getattr(sub, name), getattr(full, name)[rows], name)


def _tp_rank(rank, world, problem, v_split):
    cfg = INTERPRET_CONFIG.replace(forward={"v_split": v_split})
    calls = []
    merge_runs = fwd.merge_runs

    def counted(stats, run, entropy):
        calls.append((stats.shape[0], run))
        return merge_runs(stats, run, entropy)

    fwd.merge_runs = counted
    try:
        bounds = split_vocab(problem.v, world, mode="uneven")
        start, size = bounds[rank]
        with use_config(cfg):
            out = linear_logprob(
                problem.hidden, problem.weight[start : start + size], problem.targets,
                tp_group=dist.group.WORLD, vocab_start=start, return_entropy=True,
                return_lse=True, backend="triton",
            )  # fmt: skip
    finally:
        fwd.merge_runs = merge_runs
    return calls, out.logprob, out.entropy, out.lse


@interpreter
def test_tensor_parallel_merges_each_ranks_splits_before_the_gather():
    """Default path, TP 2 on gloo: each rank's several splits merge into one partial before
    the all-gather (one run of all of them), and the outputs match fp64 on every rank."""
    p = make_problem(23, 24, 1500, dtype=torch.float32, seed=8, ignore_frac=0.1)
    truth = reference_outputs(p.hidden, p.weight, p.targets)
    per_rank = run_ranks(_tp_rank, 2, p, 256, timeout=240)
    for rank, (calls, *outs) in enumerate(per_rank):
        assert len(calls) == 1 and calls[0][0] > 1 and calls[0][0] == calls[0][1], calls
        for name, x in zip(("logprob", "entropy", "lse"), outs, strict=True):
            assert_close(x, truth[name], atol=2e-5, rtol=2e-6, name=f"{name} rank {rank}")
