"""lp's public ops under ``torch.compile``: opaque custom ops in the graph, eager's bits.

lp's guarantees are about bits: run to run, across batches, and with
``deterministic=True`` across tensor-parallel layouts. They hold for lp's own sequence
of kernels. If Dynamo traced into an op, Inductor would regenerate the torch backend's
chunk loop (fusing reductions, reordering sums) and the bits would move (measured on
CPU). So Dynamo never traces into lp: an op decorated with :func:`eager_under_compile`
and given a ``traced`` form (``linear_logprob``, ``vocab_parallel_logprob``,
``linear_divergence``, ``vocab_parallel_divergence``, ``linear_divergence_loss``) calls,
while Dynamo traces, its ``torch.library`` custom ops (:mod:`lp_kernels.library`,
:mod:`lp_kernels.library_divergence`). They are
opaque to Dynamo and Inductor, have fake kernels for their shapes, and their autograd is
a second custom op, so ``torch.compile(fullgraph=True)`` captures forward and backward;
their implementations run the host functions of eager mode, so a compiled step gets
eager mode's bits.

An op without a ``traced`` form, or whose arguments it does not carry (``traced`` returns
``NotImplemented``: DTensors, options of other types), makes a graph break and runs as
in eager mode; ``fullgraph=True`` (and ``torch.export``) then raise Dynamo's
``Unsupported`` error naming the op. ``linear_logprob_loss`` is one (its ``loss_fn`` is a
Python callable, which no custom op takes), ``linear_topk_divergence`` another. Outside
``torch.compile`` the only cost is one check of ``torch.compiler.is_compiling()``;
``torch._dynamo`` is never imported by lp (importing it takes seconds).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

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


def eager_under_compile(
    fn: Callable[P, R] | None = None, *, traced: Callable[..., R] | None = None
) -> Any:
    """Decorator of a public op: under ``torch.compile``, ``traced`` (the op as custom ops,
    in the graph), else, or where ``traced`` returns ``NotImplemented``, ``fn`` eagerly
    behind a graph break.

    ``traced`` takes every argument of ``fn`` by name, defaults filled in. Outside
    ``torch.compile`` the op is ``fn``, after one ``torch.compiler.is_compiling()`` test.
    """
    if fn is None:
        return functools.partial(eager_under_compile, traced=traced)
    name = f"{fn.__module__}.{fn.__qualname__}"
    params = inspect.signature(fn).parameters.values()
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    @functools.wraps(fn)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():  # only tracing takes this branch
            if traced is not None and len(args) <= len(positional):
                named = {**defaults, **dict(zip(positional, args, strict=False)), **kwargs}
                out = traced(**named)
                if out is not NotImplemented:
                    return out
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
