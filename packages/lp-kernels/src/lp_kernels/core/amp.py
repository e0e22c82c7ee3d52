"""lp's ops under ``torch.autocast``: inputs cast as ``F.linear`` would, lp's own math fp32.

Under autocast the stock head computes ``F.linear(hidden, weight)`` in the autocast
dtype (bf16 / fp16) and ``log_softmax`` in fp32. lp takes the same inputs: the
floating ones are cast to the autocast dtype (differentiable casts, so an fp32
weight gets an fp32 gradient), which also keeps fp32 models on the fast tensor-core
path instead of lp's exact fp32 one. Inside the op autocast is off, forward and
backward: lp's precision policy (fp32 logits tiles, fp32 sums, fixed point) is its
own, and autocast would otherwise cast its internal GEMMs down (measured on CPU: the
torch backend's logprob moved by 3e-2 with fp32 inputs under bf16 autocast).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` cast to the autocast dtype of their device type when autocast is on."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t.is_floating_point() and t.device.type == device_type else t
        for t in tensors
    )


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast disabled for ``device``'s type (a no-op context when it is not on)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def backward_without_autocast(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator for a ``backward(ctx, *grads)``: autocast off for the grads' device.

    ``loss.backward()`` may run inside an autocast region (on CPU the engine runs the
    backward on the calling thread, with its autocast state)."""

    @functools.wraps(fn)
    def backward(*args: P.args, **kwargs: P.kwargs) -> R:
        grad = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
        if grad is None:
            return fn(*args, **kwargs)
        with autocast_off(grad.device):
            return fn(*args, **kwargs)

    return backward
