"""lp's ops under ``torch.compile(fullgraph=True)``: custom ops in the graph, eager's bits.

``linear_logprob`` and ``vocab_parallel_logprob`` reach Dynamo as the opaque custom ops of
``lp_kernels.library``; Inductor never regenerates lp's kernels, so a compiled step's
outputs and gradients are ``torch.equal`` to an eager step's. The captured graphs hold the
custom ops (forward and backward) and none of lp's internal operations.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from lp_kernels import (
    library,
    linear_divergence,
    linear_logprob,
    linear_logprob_loss,
    vocab_parallel_logprob,
)
from lp_testing import assert_bitwise_equal, make_problem, run_ranks

dynamo = pytest.importorskip("torch._dynamo")
aot_autograd = pytest.importorskip("torch._dynamo.backends.common").aot_autograd

# Names of the operations lp's backends are made of: no compiled graph may hold them.
LP_OPS = (
    "autograd_function_apply",  # Dynamo's op for a traced autograd.Function
    *("mm", "matmul", "addmm", "bmm", "linear", "exp", "logsumexp", "amax", "softmax"),
)
N, H, V, V_PAD = 29, 32, 389, 400  # N and V prime, the head padded
OPTIONS = {"temperature": 0.7, "softcap": 3.0, "logit_scale": 1.1, "return_entropy": True}
OPTIONS |= {"return_lse": True, "vocab_size": V}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _name(target) -> str:
    """``lp.linear_logprob.default``, ``aten.mm.default``, or a function's name."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return target if isinstance(target, str) else str(getattr(target, "__name__", target))


class Recorder:
    """A ``torch.compile`` backend that keeps the operations of each graph AOTAutograd
    makes (forward and backward) and runs them as they are."""

    def __init__(self):
        self.graphs: list[list[str]] = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, gm: torch.fx.GraphModule, example_inputs):
        ops = []
        for module in gm.modules():  # the bodies of higher-order ops too
            if isinstance(module, torch.fx.GraphModule):
                ops += [_name(n.target) for n in module.graph.nodes if n.op == "call_function"]
        self.graphs.append(ops)
        return gm.forward


def _problem(dtype=torch.float32, n: int = N, device: str = "cpu"):
    p = make_problem(
        n, H, V, dtype=dtype, device=device, seed=3, ignore_frac=0.1, padded_vocab=V_PAD
    )
    bias = torch.randn(V_PAD, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    return p, bias


def _linear_loss(hidden, weight, bias, targets, g, backend="torch", **kwargs):
    """A loss linear in the outputs, with weights made outside (so that the upstream
    gradients are the same bits compiled or not), and the outputs."""
    out = linear_logprob(hidden, weight, targets, bias=bias, backend=backend, **kwargs)
    loss = (g * out.logprob).sum()
    if out.entropy is not None:
        loss = loss - 0.25 * out.entropy.sum()
    if out.lse is not None:
        loss = loss + (g.flip(0) * out.lse).sum()
    return loss, *(x for x in out if x is not None), out.mean_logit, out.is_top1


def _logits_loss(logits, targets, g, **kwargs):
    out = vocab_parallel_logprob(logits, targets, **kwargs)
    loss = (g * out.logprob - 0.25 * out.entropy + g.flip(0) * out.lse).sum()
    return loss, out.logprob, out.entropy, out.lse, out.log_sum_sq_probs


def _step(fn, leaves, *args, **kwargs):
    """``fn``'s outputs and the gradients of its loss with respect to ``leaves`` (not the
    loss: Inductor sums it in its own order)."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    loss, *outs = fn(*leaves, *args, **kwargs)
    loss.backward()
    return [*outs, *(x.grad for x in leaves)]


def _assert_same(eager, compiled, what: str):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        if a is None:
            assert b is None, f"{what}: output {i}"
        else:
            assert_bitwise_equal(b, a, f"{what}: output {i}")


CASES = {
    "options": dict(OPTIONS, extras=("mean_logit", "is_top1")),
    "deterministic": dict(OPTIONS, deterministic=True, deterministic_tile=256),
    "no-entropy": {"vocab_size": V, "ignore_index": 7},
}


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_step_has_eager_bits(compiler, case):
    """``torch.compile(fullgraph=True)`` of a step with ``linear_logprob``: outputs and the
    gradients of hidden, weight and bias ``torch.equal`` to eager mode's."""
    if compiler == "inductor" and not _have_cxx():
        pytest.skip("Inductor on CPU needs a C++ compiler")
    if compiler == "inductor" and case == "no-entropy":
        pytest.skip("one option set suffices for Inductor (compile time)")
    p, bias = _problem()
    targets = p.targets.clone()
    if case == "no-entropy":  # ignore_index=7: the ignored rows, and row 3, hold 7
        targets[targets == -100] = 7
    targets[3] = 7
    g = torch.linspace(-1.0, 1.0, N)
    kwargs = CASES[case]
    eager = _step(_linear_loss, (p.hidden, p.weight, bias), targets, g, **kwargs)
    compiled_fn = torch.compile(_linear_loss, backend=compiler, fullgraph=True)
    compiled = _step(compiled_fn, (p.hidden, p.weight, bias), targets, g, **kwargs)
    _assert_same(eager, compiled, f"{case} [{compiler}]")


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["options", "deterministic"])
def test_triton_fullgraph_step_has_eager_bits(compiler, case):
    """The triton backend on CUDA (bf16), compiled whole: eager bits."""
    p, bias = _problem(torch.bfloat16, device="cuda")
    g = torch.linspace(-1.0, 1.0, N, device="cuda")
    kwargs = dict(CASES[case], backend="triton")
    eager = _step(_linear_loss, (p.hidden, p.weight, bias), p.targets, g, **kwargs)
    compiled_fn = torch.compile(_linear_loss, backend=compiler, fullgraph=True)
    compiled = _step(compiled_fn, (p.hidden, p.weight, bias), p.targets, g, **kwargs)
    _assert_same(eager, compiled, f"triton {case} [{compiler}]")


def _logged_entropy_loss(hidden, weight, targets, g):
    """A loss of the log-probs alone, the entropy asked for to be logged (no gradient)."""
    out = linear_logprob(hidden, weight, targets, return_entropy=True, backend="torch")
    return (g * out.logprob).sum(), out.logprob, out.entropy.detach()


def test_an_output_outside_the_loss_keeps_eager_bits():
    """An output asked for but left out of the loss inside the compiled region gets no
    upstream gradient, as in eager mode (a zero one would change the backward's bits)."""
    p, _ = _problem()
    g = torch.linspace(-1.0, 1.0, N)
    eager = _step(_logged_entropy_loss, (p.hidden, p.weight), p.targets, g)
    fn = torch.compile(_logged_entropy_loss, backend="aot_eager", fullgraph=True)
    _assert_same(eager, _step(fn, (p.hidden, p.weight), p.targets, g), "logged entropy")


def test_another_n_keeps_eager_bits():
    """A second token count runs the same compiled step (dynamic N), with eager bits."""
    fn = torch.compile(_linear_loss, backend="aot_eager", fullgraph=True)
    for n in (N, 17):
        p, bias = _problem(n=n)
        g = torch.linspace(-1.0, 1.0, n)
        eager = _step(_linear_loss, (p.hidden, p.weight, bias), p.targets, g, **OPTIONS)
        compiled = _step(fn, (p.hidden, p.weight, bias), p.targets, g, **OPTIONS)
        _assert_same(eager, compiled, f"N={n}")


def test_logits_fullgraph_step_has_eager_bits():
    p, _ = _problem(torch.bfloat16)
    logits = (p.hidden.float() @ p.weight.float().T).to(torch.bfloat16).view(N, 1, V_PAD)
    targets = p.targets.view(N, 1)
    g = torch.linspace(-1.0, 1.0, N).view(N, 1)
    kwargs = dict(OPTIONS, extras=("log_sum_sq_probs",))
    eager = _step(_logits_loss, (logits,), targets, g, **kwargs)
    compiled_fn = torch.compile(_logits_loss, backend="aot_eager", fullgraph=True)
    compiled = _step(compiled_fn, (logits,), targets, g, **kwargs)
    _assert_same(eager, compiled, "vocab_parallel_logprob")


@pytest.mark.parametrize("op", ["linear_logprob", "vocab_parallel_logprob"])
def test_graphs_hold_the_custom_ops_only(op):
    """The forward graph holds ``lp::<op>``, the backward graph ``lp::<op>_backward``;
    neither holds lp's operations; the code around the op is compiled."""
    p, bias = _problem()
    g = torch.linspace(-1.0, 1.0, N)
    recorder = Recorder()
    if op == "linear_logprob":
        fn, leaves, args = _linear_loss, (p.hidden, p.weight, bias), (p.targets, g)
    else:
        fn, leaves, args = _logits_loss, (p.hidden @ p.weight.T,), (p.targets, g)
    _step(torch.compile(fn, backend=recorder.backend, fullgraph=True), leaves, *args, **OPTIONS)
    assert len(recorder.graphs) == 2, recorder.graphs  # one forward, one backward
    forward, backward = recorder.graphs
    assert f"lp.{op}.default" in forward, forward
    assert f"lp.{op}_backward.default" in backward, backward
    traced = sorted({o.split(".")[1] for o in forward + backward if "." in o} & set(LP_OPS))
    assert not traced, f"{op}'s operations were traced into a graph: {traced}"
    assert "aten.mul.Tensor" in forward, f"the code around {op} was not compiled: {forward}"


def _options(**kwargs) -> list:
    o = {"ignore_index": -100, "return_entropy": True, "return_lse": True, "vocab_start": None}
    o |= {"vocab_size": V, "reduce_grad_hidden": True, "deterministic": False}
    o |= {"deterministic_tile": None, "backend": "torch", "chunk_size": None, "validate": True}
    return library.op_options((0.7, 3.0, None), ("mean_logit",), None, **o | kwargs)


def test_opcheck():
    """``torch.library.opcheck``: schemas, fake kernels (shapes, dtypes) against the real
    ones, the autograd registration, AOT dispatch."""
    p, bias = _problem()
    h, w, b = (x.detach().clone().requires_grad_() for x in (p.hidden, p.weight, bias))
    options = _options()
    torch.library.opcheck(torch.ops.lp.linear_logprob, (h, w, b, p.targets, *options))
    logits = (p.hidden @ p.weight.T).requires_grad_()
    options = _options(deterministic_tile=128)  # vocab_parallel_logprob's default
    torch.library.opcheck(torch.ops.lp.vocab_parallel_logprob, (logits, p.targets, *options))
    lse, mean_z = torch.randn(N), torch.randn(N)
    grads = (torch.randn(N), torch.randn(N), None)
    args = (p.hidden, p.weight, None, p.targets, lse, mean_z, *grads, [True, False, False])
    torch.library.opcheck(torch.ops.lp.linear_logprob_backward, (*args, *_options()))
    args = (logits.detach(), p.targets, lse, mean_z, *grads)
    torch.library.opcheck(torch.ops.lp.vocab_parallel_logprob_backward, (*args, *options))


def test_bad_arguments_raise_the_eager_errors():
    """Checks run when the op runs: a compiled call raises eager mode's ``ValueError``."""
    p, _ = _problem()
    fn = torch.compile(_linear_loss, backend="aot_eager", fullgraph=True)
    g = torch.ones(N)
    with pytest.raises(ValueError, match="temperature"):
        fn(p.hidden, p.weight, None, p.targets, g, temperature=-1.0)
    bad = p.targets.clone()
    bad[0] = V  # a padding row's id
    with pytest.raises(ValueError, match="target"):
        fn(p.hidden, p.weight, None, bad, g, vocab_size=V)


def test_loss_op_stays_behind_a_graph_break():
    """``linear_logprob_loss`` takes a Python ``loss_fn``, which no custom op can: it runs
    eagerly behind a graph break, and ``fullgraph=True`` raises naming it."""
    p, _ = _problem()

    def f(h, w, t):
        return linear_logprob_loss(h, w, t, lambda lp, ent, lse: -lp, backend="torch").loss

    with pytest.raises(dynamo.exc.Unsupported, match="linear_logprob_loss"):
        torch.compile(f, backend="eager", fullgraph=True)(p.hidden, p.weight, p.targets)
    eager = f(p.hidden, p.weight, p.targets)
    assert torch.equal(torch.compile(f, backend="eager")(p.hidden, p.weight, p.targets), eager)


def _tp_rank(rank: int, world: int, bounds) -> list[torch.Tensor]:
    """One rank's eager and compiled steps of a deterministic TP call (a tile crossing
    the shard bound: the halo is exchanged in the forward and again in the backward)."""
    p, bias = _problem()
    lo, hi = bounds[rank]
    g = torch.linspace(-1.0, 1.0, N)
    kwargs = dict(OPTIONS, tp_group=dist.group.WORLD, vocab_start=lo, deterministic=True)
    kwargs["deterministic_tile"] = 256
    leaves = (p.hidden, p.weight[lo:hi], bias[lo:hi])
    eager = _step(_linear_loss, leaves, p.targets, g, **kwargs)
    # Dynamo's eager backend: the graph (custom ops, group by name, the backward op and its
    # collectives) without AOTAutograd's seconds per rank; the tests above cover AOT
    fn = torch.compile(_linear_loss, backend="eager", fullgraph=True)
    compiled = _step(fn, leaves, p.targets, g, **kwargs)
    div_eager, div_compiled = _tp_divergence(leaves, lo, hi, g, kwargs)
    return [*eager, *div_eager, *compiled, *div_compiled]


def _tp_divergence(leaves, lo: int, hi: int, g, kwargs: dict) -> tuple[list, list]:
    """``linear_divergence(deterministic=True)`` on the same shards (a wider teacher, a
    mask), eager and compiled: both heads' halos cross the shard bound."""
    t = make_problem(N, 48, V, seed=5, padded_vocab=V_PAD)
    mask = torch.arange(N) % 7 != 3
    kwargs = {k: kwargs[k] for k in ("temperature", "tp_group", "vocab_start", "vocab_size")}
    kwargs |= {"deterministic": True, "deterministic_tile": 256, "kind": "jsd", "mask": mask}

    def loss(hidden, weight, bias):
        teacher = (t.hidden, t.weight[lo:hi])
        out = linear_divergence(hidden, weight, *teacher, bias=bias, backend="torch", **kwargs)
        return (g * out.divergence).sum(), *out

    fn = torch.compile(loss, backend="eager", fullgraph=True)
    return _step(loss, leaves), _step(fn, leaves)


def test_tensor_parallel_fullgraph_has_eager_bits():
    """Two gloo ranks: a compiled step equals the eager one on every rank, for
    ``linear_logprob`` and ``linear_divergence``."""
    per_rank = run_ranks(_tp_rank, 2, [(0, 128), (128, V_PAD)], timeout=240)
    for rank, results in enumerate(per_rank):
        half = len(results) // 2
        _assert_same(results[:half], results[half:], f"rank {rank}")


def test_eager_calls_do_not_import_dynamo():
    """Outside torch.compile lp never imports torch._dynamo (seconds of import time)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from lp_kernels import linear_logprob\n"
        "h = torch.randn(4, 8, requires_grad=True)\n"
        "w = torch.randn(20, 8, requires_grad=True)\n"
        "linear_logprob(h, w, torch.tensor([1, 2, 3, 4]), backend='torch').logprob.sum()"
        ".backward()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
