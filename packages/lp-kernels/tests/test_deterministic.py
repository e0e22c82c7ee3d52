"""deterministic=True: bitwise tensor-parallel invariance on CPU over gloo ranks.

For one global problem, outputs and both gradients must be bitwise identical for
TP = 1, 2, 3, 4, 8 and any shard layout whose bounds are multiples of 128 (uneven ones
included), on the torch backend and on the triton backend (under Triton's interpreter);
and still match fp64 like the default path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _parity import check_against_fp64

from lp_kernels import linear_logprob
from lp_testing import (
    AWKWARD_SHAPES,
    DTYPES,
    RankError,
    assert_bitwise_equal,
    assert_close,
    make_problem,
    reference_all,
    reference_from_logits,
    run_ranks,
)

LAYOUTS = {  # shard bounds over V_pad = 1024 rows, all on multiples of 128
    "tp1": [(0, 1024)],
    "tp2": [(0, 512), (512, 512)],
    "tp2-uneven": [(0, 896), (896, 128)],
    "tp3-uneven": [(0, 128), (128, 640), (768, 256)],
    "tp4": [(0, 256), (256, 256), (512, 256), (768, 256)],
    "tp4-uneven": [(0, 384), (384, 128), (512, 384), (896, 128)],
    "tp8": [(128 * r, 128) for r in range(8)],
}


def _problem(dtype):
    return make_problem(
        37, 24, 1000, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=1024, temperature=0.8
    )


def _upstream(n):
    g = torch.linspace(-1, 1, n)
    return g, g.flip(0), torch.full((n,), 0.3)


def _rank(rank, world, problem, bounds, backend):
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
        backend=backend,
        **problem.op_kwargs(),
    )
    g_lp, g_ent, g_lse = _upstream(problem.n)
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    return out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_identical_across_tp_degrees_and_layouts(dtype, backend):
    problem = _problem(dtype)
    results = {}
    for name, bounds in LAYOUTS.items():
        per_rank = run_ranks(_rank, len(bounds), problem, bounds, backend, timeout=180)
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


@pytest.mark.parametrize("tol", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_deterministic_parity_awkward_shapes(shape, tol, device, backend):
    """deterministic=True is as accurate as the default path: every dtype, all options."""
    if backend == "torch" and device == "cuda":
        pytest.skip("deterministic=True with the torch backend is CPU-only (NotImplementedError)")
    if backend == "triton" and device == "cpu" and shape.v > 2000:
        pytest.skip("Triton's interpreter only at tiny sizes in CI; the GPU run covers it")
    problem = make_problem(
        shape.n, shape.h, shape.v, dtype=tol.dtype, device=device, seed=shape.n + shape.v,
        ignore_frac=0.25, padded_vocab=shape.v + 13, temperature=0.7,
    )  # fmt: skip
    check_against_fp64(problem, tol, entropy=True, lse=True, backend=backend, deterministic=True)


def test_deterministic_single_process_batch_invariant_and_reproducible(backend):
    p = _problem(torch.float32)

    def run(rows):
        h = p.hidden[rows].clone().requires_grad_()
        out = linear_logprob(
            h, p.weight, p.targets[rows], deterministic=True, return_entropy=True,
            backend=backend, **p.op_kwargs(),
        )  # fmt: skip
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


def _logits_rank(rank, world, logits, targets, bounds):
    from lp_kernels import vocab_parallel_logprob

    start, size = bounds[rank]
    x = logits[:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_logprob(
        x, targets, tp_group=dist.group.WORLD, vocab_start=start, vocab_size=1000,
        return_entropy=True, return_lse=True, temperature=0.8, deterministic=True,
    )  # fmt: skip
    g_lp, g_ent, g_lse = _upstream(targets.shape[0])
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    return out.logprob, out.entropy, out.lse, x.grad


def test_vocab_parallel_logprob_bitwise_identical_across_tp():
    p = _problem(torch.bfloat16)
    logits = (p.hidden.float() @ p.weight.float().T).to(torch.bfloat16)  # [37, 1024]
    results = {}
    for name in ("tp1", "tp2-uneven", "tp3-uneven", "tp8"):
        bounds = LAYOUTS[name]
        per_rank = run_ranks(_logits_rank, len(bounds), logits, p.targets, bounds, timeout=120)
        for rank in range(1, len(bounds)):
            for k in range(3):
                assert_bitwise_equal(per_rank[rank][k], per_rank[0][k], f"{name} rank {rank}")
        results[name] = (*per_rank[0][:3], torch.cat([r[3] for r in per_rank], dim=1))
    for layout, got in results.items():
        for name, a, b in zip(
            ("logprob", "entropy", "lse", "grad"), got, results["tp1"], strict=True
        ):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1")
    g_lp, g_ent, g_lse = _upstream(p.n)
    truth = reference_from_logits(
        logits, p.targets, temperature=0.8, vocab_size=1000, ignore_index=p.ignore_index,
        grad_logprob=g_lp, grad_entropy=g_ent, grad_lse=g_lse,
    )  # fmt: skip
    for name, got in zip(("logprob", "entropy", "lse", "grad_logits"), results["tp1"], strict=True):
        tol = 1e-5 if name != "grad_logits" else 1e-2  # the gradient is stored in bf16
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=tol, atol=tol * scale, name=name)
