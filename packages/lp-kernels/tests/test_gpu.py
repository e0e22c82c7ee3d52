"""CUDA-only checks: NCCL tensor parallelism, no host sync with validate=False.

Parity, determinism and batch invariance on CUDA run in the other modules through the
``device`` fixture (``cuda`` parameter, marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_logprob
from lp_testing import assert_close, make_problem, run_ranks, split_vocab


def _nccl_rank(rank, world, problem, mode, reduce, backend):
    dev = torch.device("cuda", rank)
    bounds = split_vocab(problem.v_padded, world, mode=mode)
    start, size = bounds[rank]
    h = problem.hidden.to(dev).requires_grad_()
    w = problem.weight[start : start + size].to(dev).requires_grad_()
    out = linear_logprob(
        h,
        w,
        problem.targets.to(dev),
        tp_group=dist.group.WORLD,
        vocab_start=start,
        reduce_grad_hidden=reduce,
        return_entropy=True,
        return_lse=True,
        backend=backend,
        **problem.op_kwargs(),
    )
    g = torch.linspace(-1, 1, problem.n, device=dev)
    (out.logprob * g + out.entropy * g.flip(0) + out.lse * 0.5).sum().backward()
    return bounds, out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("mode", "reduce"), [("even", True), ("uneven", True), ("uneven", False)])
def test_nccl_tp2_matches_single_gpu(dtype, mode, reduce, backend):
    world = 2
    problem = make_problem(
        1031, 256, 20011, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=20096, temperature=0.9
    )
    p = problem.to("cuda").with_grad()
    ref = linear_logprob(
        p.hidden,
        p.weight,
        p.targets,
        return_entropy=True,
        return_lse=True,
        backend=backend,
        **p.op_kwargs(),
    )
    g = torch.linspace(-1, 1, p.n, device="cuda")
    (ref.logprob * g + ref.entropy * g.flip(0) + ref.lse * 0.5).sum().backward()
    results = run_ranks(
        _nccl_rank, world, problem, mode, reduce, backend, backend="nccl", timeout=90
    )
    eps = 1e-5 if dtype == torch.float32 else 1e-2
    partial = torch.zeros_like(p.hidden.grad, dtype=torch.float32)
    for rank, (bounds, lp, ent, lse, gh, gw) in enumerate(results):
        start, size = bounds[rank]
        tag = f"[{dtype} {mode} reduce={reduce} rank {rank}]"
        for name, got, want in (
            ("logprob", lp, ref.logprob),
            ("entropy", ent, ref.entropy),
            ("lse", lse, ref.lse),
        ):
            assert_close(got, want.cpu(), rtol=1e-5, atol=1e-4, name=name + tag)
        assert_close(
            gw,
            p.weight.grad[start : start + size].cpu(),
            rtol=eps,
            atol=eps,
            name="grad_weight" + tag,
        )
        if reduce:
            assert_close(gh, p.hidden.grad.cpu(), rtol=eps, atol=eps, name="grad_hidden" + tag)
        else:
            partial += gh.cuda().float()
        assert torch.equal(lp, results[0][1]) and torch.equal(ent, results[0][2])
    if not reduce:
        assert_close(partial, p.hidden.grad.float(), rtol=eps, atol=eps, name="sum of partials")


@pytest.mark.gpu
def test_no_host_sync_with_validate_false():
    p = make_problem(
        512, 128, 5003, dtype=torch.bfloat16, device="cuda", seed=1, ignore_frac=0.1
    ).with_grad()
    kw = {"return_entropy": True, "return_lse": True, "validate": False, **p.op_kwargs()}
    linear_logprob(p.hidden, p.weight, p.targets, **kw).logprob.sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = linear_logprob(p.hidden, p.weight, p.targets, **kw)
        (out.logprob + out.entropy + out.lse).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
