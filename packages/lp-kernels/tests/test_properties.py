"""Property tests: random shapes, dtypes, temperatures, ignore patterns, options, shard layouts.

Every output and gradient is compared with the fp64 reference, with tolerances relative to
the materialized-logits path in the same dtype (see ``_parity``). The default profile is
bounded and derandomized (CI); ``LP_HYPOTHESIS_PROFILE=long`` runs more examples.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

hypothesis = pytest.importorskip("hypothesis")
from _parity import check_against_fp64  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lp_kernels import linear_logprob  # noqa: E402
from lp_testing import DTYPES, assert_close, make_problem, run_ranks  # noqa: E402

pytestmark = pytest.mark.property

_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# On a CUDA host the single-process properties run on the GPU (both backends, compiled);
# on CPU, triton runs under the interpreter. The gloo layout test always runs on CPU.
DEVICE = "cuda" if torch.cuda.is_available() and not _INTERPRETING else "cpu"
BACKENDS = ["torch", "triton"] if (_INTERPRETING or DEVICE == "cuda") else ["torch"]
CPU_BACKENDS = ["torch", "triton"] if _INTERPRETING else ["torch"]


@st.composite
def problems(draw):
    n = draw(st.integers(1, 24))
    h = draw(st.integers(1, 40))
    v = draw(st.integers(2, 300))
    pad = draw(st.integers(0, 17))
    tol = draw(st.sampled_from(DTYPES))
    temperature = draw(st.sampled_from([1.0, 0.5, 2.0]) | st.floats(0.25, 4.0))
    ignore_frac = draw(st.sampled_from([0.0, 0.3]) | st.floats(0.0, 0.9))
    seed = draw(st.integers(0, 2**16))
    problem = make_problem(
        n,
        h,
        v,
        dtype=tol.dtype,
        seed=seed,
        ignore_frac=ignore_frac,
        padded_vocab=v + pad if pad else None,
        temperature=temperature,
        device=DEVICE,
    )
    return problem, tol


@given(
    case=problems(),
    entropy=st.booleans(),
    lse=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    chunk=st.sampled_from([None, 16, 5]),
    deterministic=st.booleans(),
)
def test_random_problems_match_fp64(case, entropy, lse, backend, chunk, deterministic):
    problem, tol = case
    check_against_fp64(
        problem, tol, entropy=entropy, lse=lse, chunk_size=chunk, backend=backend,
        deterministic=deterministic,
    )  # fmt: skip


def _layout_rank(rank, world, problem, bounds, reduce, backend):
    start, size = bounds[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    out = linear_logprob(
        h,
        w,
        problem.targets,
        tp_group=dist.group.WORLD,
        vocab_start=start,
        reduce_grad_hidden=reduce,
        return_entropy=True,
        backend=backend,
        **problem.op_kwargs(),
    )
    (out.logprob + 0.5 * out.entropy).sum().backward()
    return out.logprob, out.entropy, h.grad, w.grad


@settings(max_examples=4)
@given(
    world=st.integers(2, 4),
    cuts=st.lists(st.integers(1, 9), min_size=3, max_size=3),
    reduce=st.booleans(),
    backend=st.sampled_from(CPU_BACKENDS),
    seed=st.integers(0, 1000),
)
def test_random_shard_layouts_match_one_process(world, cuts, reduce, backend, seed):
    """Uneven layouts drawn at random (every shard non-empty) over 1-4 gloo ranks."""
    problem = make_problem(7, 12, 90, seed=seed, ignore_frac=0.2, padded_vocab=100)
    weights = [*cuts[: world - 1], 10]
    total = sum(weights)
    bounds, start = [], 0
    for r, wgt in enumerate(weights):
        size = 100 - start if r == world - 1 else max(1, 100 * wgt // total)
        bounds.append((start, size))
        start += size
    p = problem.with_grad()
    ref = linear_logprob(p.hidden, p.weight, p.targets, return_entropy=True, **p.op_kwargs())
    (ref.logprob + 0.5 * ref.entropy).sum().backward()
    results = run_ranks(_layout_rank, world, problem, bounds, reduce, backend, timeout=120)
    partial = torch.zeros_like(p.hidden.grad)
    for rank, (lp, ent, gh, gw) in enumerate(results):
        start, size = bounds[rank]
        assert_close(lp, ref.logprob, rtol=1e-5, atol=1e-5, name=f"logprob {bounds}")
        assert_close(ent, ref.entropy, rtol=1e-5, atol=1e-5, name=f"entropy {bounds}")
        assert_close(gw, p.weight.grad[start : start + size], rtol=1e-5, atol=1e-5, name="grad_w")
        if reduce:
            assert_close(gh, p.hidden.grad, rtol=1e-5, atol=1e-5, name=f"grad_hidden {bounds}")
        else:
            partial += gh
    if not reduce:
        assert_close(partial, p.hidden.grad, rtol=1e-5, atol=1e-5, name="sum of partials")


def _det_layout_rank(rank, world, problem, bounds, backend):
    start, size = bounds[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    out = linear_logprob(
        h, w, problem.targets, tp_group=dist.group.WORLD, vocab_start=start,
        return_entropy=True, return_lse=True, deterministic=True, backend=backend,
        **problem.op_kwargs(),
    )  # fmt: skip
    (out.logprob + 0.5 * out.entropy - 0.25 * out.lse).sum().backward()
    return out.logprob, out.entropy, out.lse, h.grad, w.grad


@settings(max_examples=3)
@given(
    world=st.integers(2, 4),
    tiles=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    backend=st.sampled_from(CPU_BACKENDS),
    seed=st.integers(0, 1000),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_random_aligned_layouts_are_bitwise_tp_invariant(world, tiles, backend, seed, temperature):
    """deterministic=True: random 128-aligned uneven layouts over 2-4 gloo ranks give the bits
    of one process (the vocabulary ends mid-tile on the last rank)."""
    sizes = [128 * t for t in tiles[:world]]
    v_pad = sum(sizes)
    problem = make_problem(
        9, 16, v_pad - 37, seed=seed, ignore_frac=0.2, padded_vocab=v_pad, temperature=temperature
    )
    p = problem.with_grad()
    ref = linear_logprob(
        p.hidden, p.weight, p.targets, return_entropy=True, return_lse=True, deterministic=True,
        backend=backend, **p.op_kwargs(),
    )  # fmt: skip
    (ref.logprob + 0.5 * ref.entropy - 0.25 * ref.lse).sum().backward()
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, size))
        start += size
    results = run_ranks(_det_layout_rank, world, problem, bounds, backend, timeout=120)
    want = (ref.logprob, ref.entropy, ref.lse, p.hidden.grad)
    for rank, got in enumerate(results):
        for name, a, b in zip(
            ("logprob", "entropy", "lse", "grad_hidden"), got[:4], want, strict=True
        ):
            assert torch.equal(a, b.detach()), f"{name} rank {rank} layout {bounds}"
    assert torch.equal(torch.cat([r[4] for r in results]), p.weight.grad), f"grad_weight {bounds}"
