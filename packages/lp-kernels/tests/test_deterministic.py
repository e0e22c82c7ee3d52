"""deterministic=True: bitwise tensor-parallel invariance (torch backend, CPU, gloo ranks).

For one global problem, outputs and both gradients must be bitwise identical for
TP = 1, 2, 3, 4 and any shard layout whose bounds are multiples of 128 (uneven ones
included); and still match fp64 like the default path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob
from lp_testing import (
    RankError,
    assert_bitwise_equal,
    assert_close,
    make_problem,
    reference_all,
    run_ranks,
)

LAYOUTS = {  # shard bounds over V_pad = 1024 rows, all on multiples of 128
    "tp1": [(0, 1024)],
    "tp2": [(0, 512), (512, 512)],
    "tp2-uneven": [(0, 896), (896, 128)],
    "tp3-uneven": [(0, 128), (128, 640), (768, 256)],
    "tp4": [(0, 256), (256, 256), (512, 256), (768, 256)],
}


def _problem(dtype):
    return make_problem(
        37, 24, 1000, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=1024, temperature=0.8
    )


def _upstream(n):
    g = torch.linspace(-1, 1, n)
    return g, g.flip(0), torch.full((n,), 0.3)


def _rank(rank, world, problem, bounds):
    start, size = bounds[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    out = linear_logprob(
        h,
        w,
        problem.targets,
        tp_group=dist.group.WORLD,
        vocab_start=start,
        deterministic=True,
        return_entropy=True,
        return_lse=True,
        **problem.op_kwargs(),
    )
    g_lp, g_ent, g_lse = _upstream(problem.n)
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    return out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_identical_across_tp_degrees_and_layouts(dtype):
    problem = _problem(dtype)
    results = {}
    for name, bounds in LAYOUTS.items():
        per_rank = run_ranks(_rank, len(bounds), problem, bounds, timeout=120)
        for rank in range(1, len(bounds)):  # every rank returns the same outputs
            for k in range(4):
                assert_bitwise_equal(per_rank[rank][k], per_rank[0][k], f"{name} rank {rank}")
        grad_w = torch.cat([r[4] for r in per_rank])
        results[name] = (*per_rank[0][:4], grad_w)
    names = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")
    for layout, got in results.items():
        for name, a, b in zip(names, got, results["tp1"], strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1")
    g_lp, g_ent, g_lse = _upstream(problem.n)
    truth = reference_all(
        problem.hidden,
        problem.weight,
        problem.targets,
        grad_logprob=g_lp,
        grad_entropy=g_ent,
        grad_lse=g_lse,
        **problem.op_kwargs(),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got in zip(names, results["tp1"], strict=True):
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=tol, atol=tol * scale, name=f"{name} vs fp64")


def test_deterministic_single_process_batch_invariant_and_reproducible():
    p = _problem(torch.float32)

    def run(rows):
        h = p.hidden[rows].clone().requires_grad_()
        out = linear_logprob(
            h, p.weight, p.targets[rows], deterministic=True, return_entropy=True, **p.op_kwargs()
        )
        (out.logprob + out.entropy).sum().backward()
        return out.logprob, out.entropy, h.grad

    full = run(torch.arange(p.n))
    again = run(torch.arange(p.n))
    for a, b in zip(full, again, strict=True):
        assert_bitwise_equal(a, b, "run to run")
    rows = torch.tensor([4, 17, 30])
    for a, b in zip(run(rows), full, strict=True):
        assert_bitwise_equal(a, b[rows], "rows alone vs in the batch")


def _misaligned_rank(rank, world):
    p = make_problem(4, 8, 300, seed=0)
    start, size = (0, 100) if rank == 0 else (100, 200)  # 100 is not a multiple of 128
    linear_logprob(
        p.hidden, p.weight[start : start + size], p.targets, tp_group=dist.group.WORLD,
        vocab_start=start, deterministic=True,
    )  # fmt: skip


def test_misaligned_layout_raises_on_every_rank():
    with pytest.raises(RankError) as info:
        run_ranks(_misaligned_rank, 2, timeout=60)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and "multiples of 128" in text
