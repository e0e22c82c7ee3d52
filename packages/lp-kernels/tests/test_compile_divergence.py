"""lp's distillation ops under ``torch.compile(fullgraph=True)``: custom ops, eager's bits.

``linear_divergence`` and ``vocab_parallel_divergence`` reach Dynamo as the opaque custom
ops of ``lp_kernels.library_divergence``, whose implementations run the eager preparation
and the eager Functions' host forward and backward: a compiled step's outputs and the
student's gradients are ``torch.equal`` to an eager step's, and the captured graphs hold
the custom ops and none of lp's internal operations. The gloo TP 2 case runs in
``test_compile.py``'s ranks (one spawn for both families of ops).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from lp_kernels import (
    library_divergence,
    linear_divergence,
    linear_divergence_loss,
    linear_topk_divergence,
    vocab_parallel_divergence,
)
from lp_testing import assert_bitwise_equal, make_problem

dynamo = pytest.importorskip("torch._dynamo")
aot_autograd = pytest.importorskip("torch._dynamo.backends.common").aot_autograd

# Names of the operations lp's backends are made of: no compiled graph may hold them.
LP_OPS = (
    "autograd_function_apply",  # Dynamo's op for a traced autograd.Function
    *("mm", "matmul", "addmm", "bmm", "linear", "exp", "logsumexp", "amax", "softmax"),
)
N, H, H_T, V, V_PAD = 29, 16, 24, 389, 400  # N and V prime, the heads padded, a wider teacher
KINDS = ("forward_kl", "reverse_kl", "jsd")
OPTIONS = {"temperature": 0.8, "teacher_temperature": 1.3, "teacher_softcap": 6.0}
OPTIONS |= {"logit_scale": 1.1, "beta": 0.3, "vocab_size": V}
CASES = {
    "options": OPTIONS,
    "deterministic": dict(OPTIONS, deterministic=True, deterministic_tile=256),
    "plain": {},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _name(target) -> str:
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
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                ops += [_name(n.target) for n in module.graph.nodes if n.op == "call_function"]
        self.graphs.append(ops)
        return gm.forward


def _problem(device: str = "cpu", dtype=torch.float32) -> dict:
    """Both heads (the teacher wider), biases, a mask (NaN in masked rows), an upstream."""
    s = make_problem(N, H, V, seed=7, padded_vocab=V_PAD, dtype=dtype, device=device)
    t = make_problem(N, H_T, V, seed=8, padded_vocab=V_PAD, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(9)
    mask = torch.ones(N, dtype=torch.bool)
    mask[[0, 5, 17]] = False
    hidden = s.hidden.clone()
    hidden[~mask.to(device)] = math.nan
    return {
        "hidden": hidden,
        "weight": s.weight,
        "bias": torch.randn(V_PAD, generator=g).to(device, dtype),
        "teacher_hidden": t.hidden,
        "teacher_weight": t.weight,
        "teacher_bias": torch.randn(V_PAD, generator=g).to(device, dtype),
        "mask": mask.to(device),
        "g": torch.linspace(-1.0, 1.0, N, device=device),
    }


def _divergence_loss(hidden, weight, bias, d: dict, **kwargs):
    """A loss linear in the divergence (its weights made outside: the same upstream bits
    compiled or not), and the outputs."""
    teacher = (d["teacher_hidden"], d["teacher_weight"])
    out = linear_divergence(
        hidden, weight, *teacher, bias=bias, teacher_bias=d["teacher_bias"], **kwargs
    )
    return (d["g"] * out.divergence).sum(), *out


def _logits_loss(logits, d: dict, **kwargs):
    out = vocab_parallel_divergence(logits, d["teacher_logprobs"], **kwargs)
    return (d["g"] * out.divergence).sum(), *out


def _step(fn, leaves, *args, **kwargs):
    """``fn``'s outputs and the gradients of its loss with respect to ``leaves``."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    loss, *outs = fn(*leaves, *args, **kwargs)
    loss.backward()
    return [*outs, *(x.grad for x in leaves)]


def _assert_same(eager, compiled, what: str):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert_bitwise_equal(b, a, f"{what}: output {i}")


def _leaves(d: dict) -> tuple:
    return d["hidden"], d["weight"], d["bias"]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_fullgraph_step_has_eager_bits(kind, case, compiler):
    """``torch.compile(fullgraph=True)`` of a step with ``linear_divergence``: outputs and
    the gradients of hidden, weight and bias ``torch.equal`` to eager mode's."""
    if compiler == "inductor" and not _have_cxx():
        pytest.skip("Inductor on CPU needs a C++ compiler")
    if compiler == "inductor" and case != "options":
        pytest.skip("one option set per kind suffices for Inductor (compile time)")
    if case == "plain" and kind != "reverse_kl":
        pytest.skip("the defaults once, with the default kind (time)")
    d = _problem()
    kwargs = dict(CASES[case], kind=kind, mask=d["mask"], backend="torch")
    eager = _step(_divergence_loss, _leaves(d), d, **kwargs)
    fn = torch.compile(_divergence_loss, backend=compiler, fullgraph=True)
    _assert_same(eager, _step(fn, _leaves(d), d, **kwargs), f"{kind} {case} [{compiler}]")


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["options", "deterministic"])
def test_triton_fullgraph_step_has_eager_bits(compiler, case):
    """The triton backend on CUDA (bf16), compiled whole: eager bits."""
    d = _problem("cuda", torch.bfloat16)
    kwargs = dict(CASES[case], kind="jsd", mask=d["mask"], backend="triton")
    eager = _step(_divergence_loss, _leaves(d), d, **kwargs)
    fn = torch.compile(_divergence_loss, backend=compiler, fullgraph=True)
    _assert_same(eager, _step(fn, _leaves(d), d, **kwargs), f"triton {case} [{compiler}]")


def _logits_problem() -> dict:
    d = _problem()
    logits = (d["hidden"].nan_to_num() @ d["weight"].T).to(torch.bfloat16).view(N, 1, V_PAD)
    teacher = (d["teacher_hidden"] @ d["teacher_weight"].T)[:, :V].log_softmax(-1)
    teacher = torch.cat([teacher, torch.zeros(N, V_PAD - V)], dim=1)  # padding: not read
    d |= {"logits": logits, "teacher_logprobs": teacher.view(N, 1, V_PAD)}
    d |= {"g": d["g"].view(N, 1), "mask": d["mask"].view(N, 1)}
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_logits_fullgraph_step_has_eager_bits(kind):
    d = _logits_problem()
    kwargs = {"kind": kind, "temperature": 0.7, "softcap": 5.0, "mask": d["mask"]}
    kwargs |= {"vocab_size": V, "beta": 0.6}
    eager = _step(_logits_loss, (d["logits"],), d, **kwargs)
    fn = torch.compile(_logits_loss, backend="aot_eager", fullgraph=True)
    _assert_same(eager, _step(fn, (d["logits"],), d, **kwargs), f"{kind} logits")


@pytest.mark.parametrize("op", ["linear_divergence", "vocab_parallel_divergence"])
def test_graphs_hold_the_custom_ops_only(op):
    """The forward graph holds ``lp::<op>``, the backward graph ``lp::<op>_backward``;
    neither holds lp's operations; the code around the op is compiled."""
    recorder = Recorder()
    if op == "linear_divergence":
        d = _problem()
        fn, leaves, kwargs = _divergence_loss, _leaves(d), dict(OPTIONS, backend="torch")
    else:
        d = _logits_problem()
        fn, leaves, kwargs = _logits_loss, (d["logits"],), {"temperature": 0.7}
    compiled = torch.compile(fn, backend=recorder.backend, fullgraph=True)
    _step(compiled, leaves, d, mask=d["mask"], **kwargs)
    assert len(recorder.graphs) == 2, recorder.graphs  # one forward, one backward
    forward, backward = recorder.graphs
    assert f"lp.{op}.default" in forward, forward
    assert f"lp.{op}_backward.default" in backward, backward
    traced = sorted({o.split(".")[1] for o in forward + backward if "." in o} & set(LP_OPS))
    assert not traced, f"{op}'s operations were traced into a graph: {traced}"
    assert "aten.mul.Tensor" in forward, f"the code around {op} was not compiled: {forward}"


def _options(**kwargs) -> list:
    o = {"kind": "jsd", "beta": 0.3, "vocab_start": None, "vocab_size": V}
    o |= {"reduce_grad_hidden": True, "deterministic": False, "deterministic_tile": None}
    o |= {"backend": "torch", "chunk_size": None, "validate": True} | kwargs
    return library_divergence.op_options(((0.8, None, 1.1), (1.3, 6.0, None)), None, o)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_opcheck(deterministic):
    """``torch.library.opcheck``: schemas, fake kernels against the real ones, the autograd
    registration, AOT dispatch."""
    d = _problem()
    d["hidden"] = d["hidden"].nan_to_num()  # opcheck compares the statistics: no NaN rows
    h, w, b = (x.detach().clone().requires_grad_() for x in _leaves(d))
    teacher = (d["teacher_hidden"], d["teacher_weight"], d["teacher_bias"])
    options = _options(deterministic=deterministic)
    args = (h, w, b, *teacher, d["mask"])
    torch.library.opcheck(torch.ops.lp.linear_divergence, (*args, *options))
    outs = torch.ops.lp.linear_divergence(*(x.detach() for x in args[:3]), *args[3:], *options)
    saved, bound = outs[3], outs[4]
    args = (*_leaves(d), *teacher, d["mask"], saved, bound, d["g"], [True, True, False])
    torch.library.opcheck(torch.ops.lp.linear_divergence_backward, (*args, *options))
    if deterministic:
        return
    weights = d["g"].abs()
    args = (h, w, b, *teacher, d["mask"], weights, [True, True, True])
    torch.library.opcheck(torch.ops.lp.linear_divergence_loss, (*args, *options))
    grads = (torch.randn(N, H), torch.randn(V_PAD, H), torch.randn(V_PAD))
    args = (*grads, torch.tensor(0.7))
    torch.library.opcheck(torch.ops.lp.linear_divergence_loss_backward, args)
    e = _logits_problem()
    logits = e["logits"].detach().clone().requires_grad_()
    options = _options(beta=0.6)
    args = (logits, e["teacher_logprobs"], e["mask"])
    torch.library.opcheck(torch.ops.lp.vocab_parallel_divergence, (*args, *options))
    saved = torch.ops.lp.vocab_parallel_divergence(logits.detach(), *args[1:], *options)[3]
    args = (logits.detach(), *args[1:], saved, e["g"].view(-1))
    torch.library.opcheck(torch.ops.lp.vocab_parallel_divergence_backward, (*args, *options))


def test_bad_arguments_raise_the_eager_errors():
    """Checks run when the op runs: a compiled call raises eager mode's errors; a teacher
    that requires grad takes the graph break, where the eager op raises."""
    d = _problem()
    fn = torch.compile(_divergence_loss, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="kind"):
        fn(*_leaves(d), d, kind="kl", backend="torch")
    with pytest.raises(ValueError, match="beta"):
        fn(*_leaves(d), d, kind="jsd", beta=1.5, backend="torch")
    with pytest.raises(TypeError, match="mask"):
        fn(*_leaves(d), d, mask=d["mask"].int(), backend="torch")
    with pytest.raises(ValueError, match="temperature"):
        fn(*_leaves(d), d, teacher_temperature=-1.0, backend="torch")
    d["teacher_weight"] = d["teacher_weight"].clone().requires_grad_()
    with pytest.raises(ValueError, match="teacher_weight requires grad"):
        torch.compile(_divergence_loss, backend="aot_eager")(*_leaves(d), d, backend="torch")


def _weighted_loss(hidden, weight, bias, d: dict, **kwargs):
    """``linear_divergence_loss``'s loss (its bits are the op's, compiled or not), a loss
    around it, and the outputs."""
    teacher = (d["teacher_hidden"], d["teacher_weight"])
    out = linear_divergence_loss(
        hidden, weight, *teacher, bias=bias, teacher_bias=d["teacher_bias"], **kwargs
    )
    return 0.5 * out.loss, *out


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", KINDS)
def test_loss_fullgraph_step_has_eager_bits(kind, compiler):
    """``linear_divergence_loss`` (row weights, a mask): the loss, the per-row outputs and
    the gradients ``torch.equal`` to eager mode's."""
    if compiler == "inductor" and not _have_cxx():
        pytest.skip("Inductor on CPU needs a C++ compiler")
    if compiler == "inductor" and kind != "jsd":
        pytest.skip("one kind suffices for Inductor: the op is opaque to it (compile time)")
    d = _problem()
    weights = torch.rand(N, generator=torch.Generator().manual_seed(2)) / N
    kwargs = dict(OPTIONS, kind=kind, mask=d["mask"], weights=weights, backend="torch")
    eager = _step(_weighted_loss, _leaves(d), d, **kwargs)
    fn = torch.compile(_weighted_loss, backend=compiler, fullgraph=True)
    _assert_same(eager, _step(fn, _leaves(d), d, **kwargs), f"loss {kind} [{compiler}]")


def _autocast_loss(hidden, weight, bias, d: dict, **kwargs):
    """Both ops under CPU bf16 autocast (casts in the caller's graph, as eager makes them)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, *out = _divergence_loss(hidden, weight, bias, d, **kwargs)
        weighted = _weighted_loss(hidden, weight, bias, d, weights=d["g"].abs(), **kwargs)
    return loss + weighted[0], *out, *weighted[1:]


def test_autocast_and_mixed_dtypes_keep_eager_bits():
    """Under autocast, and with a bf16 hidden and fp32 heads (the wider dtype computes, the
    gradients come back in each input's dtype): eager bits."""
    d = _problem()
    kwargs = dict(OPTIONS, kind="jsd", mask=d["mask"], backend="torch")
    fn = torch.compile(_autocast_loss, backend="aot_eager", fullgraph=True)
    eager = _step(_autocast_loss, _leaves(d), d, **kwargs)
    _assert_same(eager, _step(fn, _leaves(d), d, **kwargs), "autocast")
    leaves = (d["hidden"].bfloat16(), d["weight"], d["bias"])
    fn = torch.compile(_weighted_loss, backend="aot_eager", fullgraph=True)
    eager = _step(_weighted_loss, leaves, d, **kwargs)
    _assert_same(eager, _step(fn, leaves, d, **kwargs), "mixed dtypes")


def test_loss_graphs_hold_the_custom_ops_only():
    d = _problem()
    recorder = Recorder()
    compiled = torch.compile(_weighted_loss, backend=recorder.backend, fullgraph=True)
    _step(compiled, _leaves(d)[:2], None, d, mask=d["mask"], backend="torch")
    forward, backward = recorder.graphs
    assert "lp.linear_divergence_loss.default" in forward, forward
    assert "lp.linear_divergence_loss_backward.default" in backward, backward
    traced = sorted({o.split(".")[1] for o in forward + backward if "." in o} & set(LP_OPS))
    assert not traced, f"lp's operations were traced into a graph: {traced}"


def test_composed_and_topk_ops_stay_behind_a_graph_break():
    """``linear_divergence_loss(deterministic=True)`` (its composed path) and
    ``linear_topk_divergence`` run eagerly behind a graph break: ``fullgraph=True`` raises
    naming the op; without it the bits are eager's."""
    d = _problem()
    heads = (d["hidden"].nan_to_num(), d["weight"], d["teacher_hidden"], d["teacher_weight"])
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[: N * 4].view(N, 4)
    logprobs = torch.randn(N, 4).log_softmax(-1)

    def loss(h, w, th, tw):
        return linear_divergence_loss(h, w, th, tw, deterministic=True, backend="torch").loss

    def topk(h, w, th, tw):
        return linear_topk_divergence(h, w, ids, logprobs, backend="torch").divergence

    for fn, name in ((loss, "linear_divergence_loss"), (topk, "linear_topk_divergence")):
        with pytest.raises(dynamo.exc.Unsupported, match=name):
            torch.compile(fn, backend="eager", fullgraph=True)(*heads)
        assert torch.equal(torch.compile(fn, backend="eager")(*heads), fn(*heads))
