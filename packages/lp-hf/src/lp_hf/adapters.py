"""What the trainer adapters (:mod:`lp_hf.openrlhf`, :mod:`lp_hf.skyrl`, :mod:`lp_hf.verl`)
share: the head options, one head call on a trainer's model, and the checks that the
trainer's seam is the one an adapter was written against."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lp_hf.head import Backend, install_logprob_head

__all__ = [
    "HeadOptions",
    "check_class",
    "check_parameters",
    "check_series",
    "head_logprobs",
    "remove_forward",
    "set_forward",
]


@dataclass(frozen=True)
class HeadOptions:
    """lp-hf head options of one adapted trainer model (the adapters' ``use_lp`` keywords)."""

    deterministic: bool = False
    backend: Backend = "auto"
    chunk_size: int | None = None
    validate: bool = True


def check_series(adapter: str, dist: str, version: str, series: str, seam: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` of distribution ``dist`` is in release series
    ``series`` (``"0.11"`` admits ``0.11.*``), naming the adapter and the seam read there."""
    if version.split(".")[:2] != series.split("."):
        raise RuntimeError(
            f"{adapter} supports {dist} {series}.x (the {seam} it reproduces was read there); "
            f"found {dist} {version}"
        )


def check_parameters(
    adapter: str, what: str, fn: Callable[..., Any], expected: tuple[str, ...]
) -> None:
    """Raise ``RuntimeError`` unless ``fn`` takes exactly the parameters ``expected``."""
    names = tuple(inspect.signature(fn).parameters) if callable(fn) else ()
    if names != expected:
        raise RuntimeError(
            f"{what} takes {names}, not the arguments {adapter} reproduces {expected}"
        )


def head_logprobs(
    model: torch.nn.Module,
    options: HeadOptions,
    ids: torch.Tensor,
    temperature: float,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``head.logprobs(ids, temperature=temperature, **kwargs)`` with lp-hf's head installed
    on ``model`` for this call only, and the model's own output without its ``logits`` field
    (a forward hook keeps it)."""
    layer = model.get_output_embeddings()
    if layer is not None and "forward" in layer.__dict__:
        raise RuntimeError(
            "lp_hf: the model's output layer already has a replaced forward (a LogprobHead "
            "installed by hand, or offload hooks); remove it first"
        )
    captured: list[Any] = []
    head = install_logprob_head(model, **vars(options))
    hook = model.register_forward_hook(lambda _m, _a, out: captured.append(out))
    try:
        out = head.logprobs(ids, temperature=temperature, **kwargs)
    finally:
        hook.remove()
        head.remove()
    output = captured[-1]
    rest = {name: value for name, value in output.items() if name != "logits"}
    return out, type(output)(**rest)


def check_class(adapter: str, obj: Any, cls: type, what: str, hint: str) -> None:
    """Raise ``TypeError`` unless ``obj`` is a ``cls`` that runs ``cls.forward`` itself
    (``what``: the class as users name it; ``hint``: what to pass instead)."""
    if not isinstance(obj, cls):
        raise TypeError(f"use_lp takes {what}, got {type(obj).__name__} ({hint})")
    if type(obj).forward is not cls.forward:
        raise TypeError(
            f"{type(obj).__name__} overrides {cls.__name__}.forward; {adapter} reproduces "
            f"{cls.__name__}.forward only"
        )


def set_forward(
    obj: torch.nn.Module,
    model: torch.nn.Module,
    forward: Callable[[torch.nn.Module, HeadOptions], Any],
    options: HeadOptions,
    noun: str,
) -> None:
    """Give ``obj`` the instance ``forward`` ``forward(obj, options)`` (a class: adapted
    again with the same options, nothing changes), after lp-hf's install checks on
    ``model``, the causal LM it calls.

    Raises:
        ValueError: ``obj`` already uses lp with other options, or has another instance
            ``forward``; a model lp-hf refuses.
    """
    current = obj.__dict__.get("forward")
    if isinstance(current, forward):  # type: ignore[arg-type]
        if current.options != options:
            raise ValueError(
                f"this {noun} already uses lp with {current.options}; call remove_lp first"
            )
        return
    if current is not None:
        raise ValueError(f"this {noun}'s forward is already replaced by an instance attribute")
    install_logprob_head(model, **vars(options)).remove()  # lp-hf's checks, up front
    obj.__dict__["forward"] = forward(obj, options)


def remove_forward(obj: torch.nn.Module, forward: type) -> torch.nn.Module:
    """Give ``obj`` its class's forward back if :func:`set_forward` gave it a ``forward``
    (idempotent)."""
    if isinstance(obj.__dict__.get("forward"), forward):
        del obj.__dict__["forward"]
    return obj
