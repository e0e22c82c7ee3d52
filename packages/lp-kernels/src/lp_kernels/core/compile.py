"""lp's public ops under ``torch.compile``: run eagerly, behind a graph break.

lp's guarantees are about bits: run to run, across batches, and with
``deterministic=True`` across tensor-parallel layouts. They hold for lp's own sequence
of kernels. If Dynamo traced into an op, Inductor would regenerate the torch backend's
chunk loop (fusing reductions, reordering sums) and the bits would move: measured on
CPU, for the same inputs a compiled step's logprob and gradients differed from eager
ones in the last bits. lp's results would then depend on whether the caller compiles,
and ``deterministic=True``'s TP invariance on how Inductor fuses each shard's shapes.
(Under the Triton interpreter, Dynamo failed on the triton backend's kernels.) Nothing
in an op gains from tracing: its GEMMs and fused kernels are the work, the rest is
host-side checks and collectives.

So each public op, when Dynamo reaches it, makes a graph break and runs as in eager
mode; the code around it is compiled as usual. The autograd graph joins up as for
any eager op. ``fullgraph=True`` (and ``torch.export``) raise Dynamo's
``Unsupported`` error naming the op. Outside ``torch.compile`` the only cost is one
check of ``torch.compiler.is_compiling()``; ``torch._dynamo`` is never imported by lp
(importing it takes seconds).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch.autograd.function import once_differentiable

from lp_kernels.core.amp import backward_without_autocast

P = ParamSpec("P")
R = TypeVar("R")

_REASON = (
    "lp runs its ops eagerly under torch.compile: tracing them would change the bits "
    "that lp keeps reproducible (see lp_kernels.core.compile)"
)
_TAKES_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters
_DISABLED: dict[str, Callable] = {}


def _disabled(name: str, fn: Callable) -> Callable:
    """``fn`` wrapped by ``torch.compiler.disable`` (made on first use, while tracing)."""
    wrapped = _DISABLED.get(name)
    if wrapped is None:
        kwargs = {"reason": _REASON} if _TAKES_REASON else {}
        wrapped = torch.compiler.disable(fn, recursive=True, **kwargs)
        _DISABLED[name] = wrapped
    return wrapped


def eager_under_compile(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: ``fn`` runs eagerly (a graph break) when ``torch.compile`` reaches it."""
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():  # only Dynamo's tracing takes this branch
            return _disabled(name, fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return op


TWICE = (
    "lp's ops are differentiable once: their backward computes the first-order gradient "
    "only, so a second derivative through it (torch.autograd.grad(..., create_graph=True), "
    "e.g. a gradient penalty, or an upstream gradient that itself requires grad) would be "
    "silently zero. Compute the first-order gradient without create_graph, or take the "
    "logits path (hidden @ weight.T, log_softmax) for higher-order terms"
)
"""The message of the RuntimeError a backward raises when asked for a graph of itself."""


def differentiable_once(fn: Callable) -> Callable:
    """Decorator for a ``backward(ctx, *grads)``: raise :data:`TWICE` (``RuntimeError``)
    when the engine builds a graph of the backward (grad mode on inside it, which is
    ``create_graph=True``) or an upstream gradient requires grad. Never a silent zero."""

    @functools.wraps(fn)
    def backward(ctx, *grads):
        if torch.is_grad_enabled() or any(
            isinstance(g, torch.Tensor) and g.requires_grad for g in grads
        ):
            raise RuntimeError(TWICE)
        return fn(ctx, *grads)

    return backward


def backend_backward(fn: Callable) -> Callable:
    """Decorator for a backend Function's ``backward``: differentiable once
    (:func:`differentiable_once`, then ``once_differentiable``), autocast off
    (:func:`lp_kernels.core.amp.backward_without_autocast`), eager under ``torch.compile``."""
    return eager_under_compile(
        backward_without_autocast(differentiable_once(once_differentiable(fn)))
    )
