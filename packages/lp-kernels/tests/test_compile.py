"""lp's ops under ``torch.compile``: eager behind a graph break, the bits of eager mode.

Without ``lp_kernels.core.compile.eager_under_compile`` Dynamo traces into the autograd
Functions and Inductor regenerates the torch backend's chunk loop: on CPU the compiled
step's gradients then differ from eager ones in the last bits (measured). These tests
fail that way.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import assert_bitwise_equal, make_problem

dynamo = pytest.importorskip("torch._dynamo")

# Names of the operations lp's backends are made of. The compiled graphs around an lp
# call must hold none of them: lp's own work stays out of every graph.
LP_OPS = (
    "autograd_function_apply",  # Dynamo's op for a traced autograd.Function
    *("mm", "matmul", "addmm", "bmm", "linear", "exp", "logsumexp", "amax", "softmax"),
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


class Recorder:
    """A ``torch.compile`` backend that keeps each graph's operations and runs it as is."""

    def __init__(self):
        self.graphs: list[list[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        ops = []
        for module in gm.modules():  # the bodies of higher-order ops too
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    if node.op in ("call_function", "call_method"):
                        t = node.target
                        ops.append(t if isinstance(t, str) else getattr(t, "__name__", str(t)))
        self.graphs.append(ops)
        return gm.forward


def _step(op, inputs, targets, g, **kwargs):
    """``op``'s outputs and the gradients of a loss with per-token weights ``g``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = op(*leaves, targets, return_entropy=True, return_lse=True, **kwargs)
    # Linear in the outputs, with weights made outside: the upstream gradients are the
    # same bits compiled or not (Inductor's own linspace or pow would not be).
    loss = (g * out.logprob - 0.25 * out.entropy + g.flip(0) * out.lse).sum()
    loss.backward()
    return (*out, *(x.grad for x in leaves))


def _weights(targets):
    return torch.linspace(-1.0, 1.0, targets.numel(), device=targets.device).view(targets.shape)


def _linear(p, **kwargs):
    return linear_logprob, (p.hidden, p.weight), dict(vocab_size=p.vocab_size, **kwargs)


def _logits(p, **kwargs):
    logits = (p.hidden.float() @ p.weight.float().T).to(p.hidden.dtype)
    return vocab_parallel_logprob, (logits,), dict(vocab_size=p.vocab_size, **kwargs)


NAMES = ("logprob", "entropy", "lse", "grad 0", "grad 1")


def _assert_same(eager, compiled):
    assert len(eager) == len(compiled)
    for name, a, b in zip(NAMES, eager, compiled, strict=False):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_stay_out_of_compiled_graphs(device, backend, dtype):
    """The code around an lp call compiles; lp's own work is in no graph; eager bits."""
    p = make_problem(
        29, 32, 389, dtype=dtype, device=device, seed=3, ignore_frac=0.1, padded_vocab=400
    )
    targets = p.targets.view(29, 1)  # leading dims are kept through the graph break
    hidden = p.hidden.view(29, 1, 32)
    for op, inputs, kwargs in (
        (linear_logprob, (hidden, p.weight), dict(vocab_size=p.vocab_size, backend=backend)),
        _logits(p),
    ):
        targets_ = targets if op is linear_logprob else p.targets
        g = _weights(targets_)
        eager = _step(op, inputs, targets_, g, temperature=0.7, **kwargs)
        recorder = Recorder()
        compiled = torch.compile(_step, backend=recorder)(
            op, inputs, targets_, g, temperature=0.7, **kwargs
        )
        _assert_same(eager, compiled)
        assert recorder.graphs, "torch.compile captured no graph around the lp call"
        ops = [o for graph in recorder.graphs for o in graph]
        traced = sorted({o for o in ops if o in LP_OPS})
        assert not traced, f"{op.__name__}'s operations were traced into a graph: {traced}"
        assert "mul" in ops, f"the code around {op.__name__} was not compiled: {ops}"


def _have_cxx() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.parametrize(
    "case",
    ["linear", "linear-deterministic", "logits"],
)
def test_inductor_step_has_eager_bits(device, case):
    """A step compiled by Inductor (the default) gives eager mode's bits, gradients too."""
    if device == "cpu" and not _have_cxx():
        pytest.skip("Inductor on CPU needs a C++ compiler")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    p = make_problem(
        53, 48, 1031, dtype=dtype, device=device, seed=8, ignore_frac=0.1, padded_vocab=1040
    )
    if case == "logits":
        op, inputs, kwargs = _logits(p)
    else:
        deterministic = case == "linear-deterministic"
        op, inputs, kwargs = _linear(p, backend="auto", deterministic=deterministic)
        if deterministic:
            kwargs["deterministic_tile"] = 256
    g = _weights(p.targets)
    eager = _step(op, inputs, p.targets, g, **kwargs)
    compiled = torch.compile(_step)(op, inputs, p.targets, g, **kwargs)
    _assert_same(eager, compiled)


def test_fullgraph_names_the_op():
    p = make_problem(5, 16, 100, dtype=torch.float32, device="cpu", seed=1)

    def f(h, w, t):
        return linear_logprob(h, w, t, backend="torch").logprob.sum()

    with pytest.raises(dynamo.exc.Unsupported, match="linear_logprob"):
        torch.compile(f, backend=Recorder(), fullgraph=True)(p.hidden, p.weight, p.targets)


def test_eager_calls_do_not_import_dynamo(tmp_path):
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
