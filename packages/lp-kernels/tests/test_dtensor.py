"""DTensor weights in ``linear_logprob`` (torch-native tensor parallel) over gloo, 2 ranks.

A ``Shard(0)`` weight on a 1-D mesh is read as vocabulary shards (group, offsets and vocab
size from the DTensor): outputs must equal the single-process result on every rank, and
``weight.grad`` must be a DTensor with the weight's placements holding this rank's chunk of
the single-process gradient. A Replicate weight is the plain case. Every other placement
raises on every rank, naming it. The FSDP2 trap (a data-parallel ``Shard(0)`` weight with
per-rank tokens) must raise on every rank with a message that names FSDP.
"""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_logprob
from lp_kernels.distributed.dtensor import chunk_rows
from lp_testing import RankError, make_problem, run_ranks

WORLD = 2
# (rows of the weight, real vocab_size or None): 389 rows split 195 / 194 (uneven, as
# torch's chunking gives), 400 rows with the last 11 padding, 7 rows split 4 / 3
SHAPES = [(389, None), (400, 389), (7, None)]


def _problem(rows: int, vocab: int | None):
    return make_problem(
        23,
        16,
        vocab or rows,
        seed=5,
        ignore_frac=0.2,
        padded_vocab=rows if vocab else None,
        temperature=0.9,
    )


def _upstream(n: int) -> torch.Tensor:
    return torch.randn(3, n, generator=torch.Generator().manual_seed(2))


def _loss(out, g):
    return (out.logprob * g[0] + out.entropy * g[1] + out.lse * g[2]).sum()


def _single(problem):
    """The single-process run: outputs, grad_hidden, grad_weight."""
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight.clone().requires_grad_()
    kw = dict(return_entropy=True, return_lse=True, backend="torch", **problem.op_kwargs())
    out = linear_logprob(h, w, problem.targets, **kw)
    _loss(out, _upstream(problem.n)).backward()
    return out, h.grad, w.grad


def test_chunk_rows_is_torchs_shard_rule():
    from torch.distributed.tensor import Shard

    for rows in (1, 2, 5, 7, 8, 389, 400, 1001):
        for ranks in (1, 2, 3, 4, 7, 8):
            starts, sizes = chunk_rows(rows, ranks)
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(ranks)]
            assert list(sizes) == chunks + [0] * (ranks - len(chunks)), (rows, ranks)
            if hasattr(Shard, "local_shard_size_and_offset"):  # torch's own, where public
                for r in range(ranks):
                    assert Shard.local_shard_size_and_offset(rows, ranks, r) == (
                        sizes[r],
                        starts[r],
                    ), (rows, ranks, r)


def _tp_rank(rank, world, rows, vocab, hidden_kind, reduce):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (world,))
    p = _problem(rows, vocab)
    weight = distribute_tensor(p.weight.clone(), mesh, [Shard(0)]).requires_grad_()
    # the offsets lp takes must be DTensor's own
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    starts, sizes = chunk_rows(rows, world)
    assert (shape[0], offset[0]) == (sizes[rank], starts[rank])
    if hidden_kind == "replicate":
        hidden = distribute_tensor(p.hidden.clone(), mesh, [Replicate()]).requires_grad_()
        targets = distribute_tensor(p.targets, mesh, [Replicate()])
    else:
        hidden = p.hidden.clone().requires_grad_()
        targets = p.targets
    out = linear_logprob(
        hidden,
        weight,
        targets,
        return_entropy=True,
        return_lse=True,
        reduce_grad_hidden=reduce,
        backend="torch",
        temperature=p.temperature,
        ignore_index=p.ignore_index,
        vocab_size=vocab,
    )
    assert not any(isinstance(t, DTensor) for t in out)  # plain, the same on every rank
    _loss(out, _upstream(p.n)).backward()
    grad = weight.grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
    g_hidden = hidden.grad
    if hidden_kind == "replicate":
        want = (Replicate(),) if reduce else (Partial(),)
        assert isinstance(g_hidden, DTensor) and g_hidden.placements == want, g_hidden
        g_hidden = g_hidden.full_tensor()  # Partial: the sum of the ranks' partials
    elif not reduce:
        torch.distributed.all_reduce(g_hidden)
    return tuple(out), g_hidden, grad.to_local()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rows,vocab", SHAPES, ids=["uneven-389", "padded-400", "uneven-7"])
@pytest.mark.parametrize(
    "hidden_kind,reduce",
    [("plain", True), ("replicate", True), ("replicate", False)],
    ids=["plain-hidden", "replicate-hidden", "replicate-hidden-partial-grad"],
)
def test_shard0_weight_is_vocab_parallel(rows, vocab, hidden_kind, reduce):
    problem = _problem(rows, vocab)
    want, want_gh, want_gw = _single(problem)
    starts, sizes = chunk_rows(rows, WORLD)
    results = run_ranks(_tp_rank, WORLD, rows, vocab, hidden_kind, reduce, timeout=240)
    for rank, (out, g_hidden, g_weight) in enumerate(results):
        for got, ref in zip(out, want, strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_hidden, want_gh, rtol=1e-5, atol=1e-5)
        shard = want_gw[starts[rank] : starts[rank] + sizes[rank]]
        torch.testing.assert_close(g_weight, shard, rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][0][0], results[1][0][0])  # the same bits on every rank


def _replicate_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = _problem(389, None)
    weight = distribute_tensor(p.weight.clone(), mesh, [Replicate()]).requires_grad_()
    hidden = p.hidden.clone().requires_grad_()
    kw = dict(return_entropy=True, return_lse=True, backend="torch", **p.op_kwargs())
    out = linear_logprob(hidden, weight, p.targets, **kw)
    _loss(out, _upstream(p.n)).backward()
    assert isinstance(weight.grad, DTensor) and weight.grad.placements == (Replicate(),)
    return tuple(out), hidden.grad, weight.grad.to_local()


@pytest.mark.timeout(300)
def test_replicate_weight_is_the_plain_case():
    want, want_gh, want_gw = _single(_problem(389, None))
    for out, g_hidden, g_weight in run_ranks(_replicate_rank, WORLD, timeout=240):
        for got, ref in zip(out, want, strict=True):
            assert torch.equal(got, ref.detach())  # no collective: the single-process bits
        assert torch.equal(g_hidden, want_gh)
        assert torch.equal(g_weight, want_gw)


def _bad_rank(rank, world, case):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    p = _problem(389, None)
    hidden, targets = p.hidden, p.targets
    kwargs = {}
    if case == "2d-mesh":
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        weight = distribute_tensor(p.weight, mesh, [Replicate(), Shard(0)])
    else:
        mesh = init_device_mesh("cpu", (world,))
        placement = {"shard1": Shard(1), "empty-shard": Shard(0)}.get(case, Shard(0))
        if case == "partial":
            weight = DTensor.from_local(p.weight, mesh, [Partial()])
        elif case == "empty-shard":  # 1 row over 2 ranks: rank 1 gets none
            weight = distribute_tensor(p.weight[:1], mesh, [placement])
            targets = torch.zeros_like(targets)
        else:
            weight = distribute_tensor(p.weight, mesh, [placement])
    if case == "hidden-sharded":
        hidden = distribute_tensor(p.hidden, mesh, [Shard(0)])
    elif case == "targets-sharded":
        targets = distribute_tensor(p.targets, mesh, [Shard(0)])
    elif case == "tp-group":
        kwargs["tp_group"] = dist.group.WORLD
    elif case == "vocab-start":
        kwargs["vocab_start"] = 0
    elif case == "hidden-with-plain-weight":
        hidden = distribute_tensor(p.hidden, mesh, [Replicate()])
        weight = p.weight
    linear_logprob(hidden, weight, targets, **kwargs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case,error,message",
    [
        ("shard1", "TypeError", "placements (Shard(dim=1),)"),
        (
            "partial",
            "TypeError",
            "placements (Partial(sum),) on a mesh of shape (2,) (partial sums)",
        ),
        ("2d-mesh", "ValueError", "placements (Replicate(), Shard(dim=0)) on a mesh of shape"),
        ("empty-shard", "ValueError", "leaves ranks [1] without rows"),
        ("hidden-sharded", "ValueError", "lp takes hidden plain or Replicate"),
        ("targets-sharded", "ValueError", "lp takes targets plain or Replicate"),
        ("tp-group", "ValueError", "pass neither tp_group nor vocab_start"),
        ("vocab-start", "ValueError", "pass neither tp_group nor vocab_start"),
        ("hidden-with-plain-weight", "TypeError", "only with a DTensor weight"),
    ],
)
def test_other_placements_raise_on_every_rank(case, error, message):
    with pytest.raises(RankError) as info:
        run_ranks(_bad_rank, WORLD, case, timeout=120)
    text = str(info.value)
    assert len(info.value.failures) == WORLD, text  # both ranks raised, none hung
    assert text.count(error) >= WORLD, text
    assert message in text, text
    if case in ("shard1", "partial", "2d-mesh"):
        assert "lp accepts a weight DTensor on a 1-D mesh" in text


class _TinyLM(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.body = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)


def _fsdp_trap_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _TinyLM(16, 389)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weight = model.lm_head.weight  # outside forward: the data-parallel shard
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own tokens
    hidden = torch.randn(12, 16, generator=g)
    targets = torch.randint(0, 389, (12,), generator=g)
    linear_logprob(hidden, weight, targets, validate=True)


@pytest.mark.timeout(300)
def test_fsdp2_weight_outside_forward_raises_on_every_rank():
    """Needs the per-call rank record (validate=True compares the ranks' targets)."""
    with pytest.raises(RankError) as info:
        run_ranks(_fsdp_trap_rank, WORLD, timeout=240)
    text = str(info.value)
    assert len(info.value.failures) == WORLD, text
    assert text.count("ValueError") >= WORLD, text
    assert "FSDP" in text and "through the FSDP-wrapped module" in text, text


def _bias_softcap_rank(rank, world, plain_bias):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = _problem(389, None)
    bias = torch.linspace(-2.0, 2.0, 389)
    weight = distribute_tensor(p.weight.clone(), mesh, [Shard(0)]).requires_grad_()
    if plain_bias:
        try:
            linear_logprob(p.hidden, weight, p.targets, bias=bias, backend="torch")
        except ValueError as exc:
            return str(exc)
        return None
    b = distribute_tensor(bias.clone(), mesh, [Shard(0)]).requires_grad_()
    hidden = p.hidden.clone().requires_grad_()
    kw = dict(return_entropy=True, return_lse=True, backend="torch", softcap=3.0, **p.op_kwargs())
    out = linear_logprob(hidden, weight, p.targets, bias=b, **kw)
    _loss(out, _upstream(p.n)).backward()
    assert isinstance(b.grad, DTensor) and b.grad.placements == (Shard(0),), b.grad
    return tuple(out), hidden.grad, weight.grad.to_local(), b.grad.to_local()


@pytest.mark.timeout(300)
def test_shard0_weight_takes_a_sharded_bias_and_softcap():
    """A bias sharded like the weight (ColwiseParallel on a biased lm_head) and softcap reach
    the computation: the same outputs and gradients as one process; a plain bias beside a
    Shard(0) weight is ambiguous and raises on every rank."""
    p = _problem(389, None)
    bias = torch.linspace(-2.0, 2.0, 389).requires_grad_()
    hidden, weight = p.hidden.clone().requires_grad_(), p.weight.clone().requires_grad_()
    kw = dict(return_entropy=True, return_lse=True, backend="torch", softcap=3.0, **p.op_kwargs())
    want = linear_logprob(hidden, weight, p.targets, bias=bias, **kw)
    _loss(want, _upstream(p.n)).backward()
    starts, sizes = chunk_rows(389, WORLD)
    for rank, (out, g_h, g_w, g_b) in enumerate(
        run_ranks(_bias_softcap_rank, WORLD, False, timeout=240)
    ):
        for got, ref in zip(out, want, strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
        rows = slice(starts[rank], starts[rank] + sizes[rank])
        torch.testing.assert_close(g_h, hidden.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_w, weight.grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_b, bias.grad[rows], rtol=1e-5, atol=1e-5)
    messages = run_ranks(_bias_softcap_rank, WORLD, True, timeout=240)
    assert all(
        m is not None and "bias is a plain tensor beside a DTensor weight" in m for m in messages
    )
