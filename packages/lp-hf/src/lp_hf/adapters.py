"""What the trainer adapters (:mod:`lp_hf.openrlhf`, :mod:`lp_hf.skyrl`, :mod:`lp_hf.verl`)
share: the head options, one head call on a trainer's model, one model forward whose output
layer computes a fused loss, and the checks that the trainer's seam is the one an adapter
was written against (:func:`code_digest`)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lp_hf.final_logits import output_layer_owner, post_processing, same_values, switched_off
from lp_hf.head import Backend, install_logprob_head
from lp_kernels import LossOutput, linear_logprob_loss

__all__ = [
    "HeadOptions",
    "LossPasses",
    "check_class",
    "check_parameters",
    "check_series",
    "code_digest",
    "head_logprobs",
    "loss_forward",
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


class LossPasses:
    """Mixin of an adapter's forward that computes a trainer's loss for one armed pass:
    :meth:`loss_pass` sets ``request`` for the block (the forward reads it), then clears it."""

    request: Any = None

    @contextlib.contextmanager
    def loss_pass(self, request: Any) -> Iterator[Any]:
        """Within the block, the forward's call computes ``request``'s loss."""
        if self.request is not None:
            raise RuntimeError(f"{type(self).__module__}: a fused loss pass is already running")
        self.request = request
        try:
            yield request
        finally:
            self.request = None


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


def loss_forward(
    model: torch.nn.Module,
    options: HeadOptions,
    ids: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Any,
    per_token: dict[str, torch.Tensor],
    temperature: float,
    *,
    return_entropy: bool,
    logits_to_keep: int,
    **model_kwargs: Any,
) -> tuple[LossOutput, Any]:
    """``model(ids, **model_kwargs)`` with its output layer computing
    ``linear_logprob_loss(hidden, weight, targets, loss_fn, per_token=...)`` for this
    call only (the model's final-logit softcap and scale applied by lp, as the head does);
    returns that result and the model's output without ``logits``."""
    layer = model.get_output_embeddings()
    if layer is None or "forward" in layer.__dict__:
        raise RuntimeError("lp_hf: the model's output layer already has a forward")
    processing = post_processing(output_layer_owner(model, layer))
    results: list[tuple[LossOutput, torch.Tensor]] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if results:
            raise RuntimeError("the output layer ran twice in one model forward")
        if hasattr(layer.weight, "device_mesh"):
            raise NotImplementedError("lp_hf: the fused loss with a DTensor head")
        if tuple(hidden.shape[:-1]) != tuple(targets.shape):
            raise ValueError(f"the output layer got {tuple(hidden.shape)}, targets {targets.shape}")
        out = linear_logprob_loss(
            hidden,
            layer.weight,
            targets.to(hidden.device),
            loss_fn,
            per_token={k: v.to(hidden.device) for k, v in per_token.items()},
            return_entropy=return_entropy or loss_fn.needs_entropy,
            bias=layer.bias,
            temperature=temperature,
            softcap=processing.transform.softcap,
            logit_scale=processing.transform.logit_scale,
            **vars(options),
        )
        # the model's "logits": the log-probs with the loss's graph at weight 0 (the same
        # values, no gradient added), so that hooks on the model's outputs (FSDP2's) see it
        results.append((out, (out.logprob + 0.0 * out.loss).unsqueeze(-1)))
        return results[0][1]

    if logits_to_keep:
        model_kwargs["logits_to_keep"] = logits_to_keep
    layer.__dict__["forward"] = forward
    try:
        with switched_off(processing):
            output = model(input_ids=ids, use_cache=False, return_dict=True, **model_kwargs)
    finally:
        del layer.__dict__["forward"]
    if not results:
        raise RuntimeError("the model's forward did not call its output layer")
    result, stand_in = results[0]
    got = output.logits
    if got is not stand_in and (processing.exact or not same_values(got, stand_in)):
        raise RuntimeError("the model changed what its output layer returned; lp-hf refuses it")
    rest = {name: value for name, value in output.items() if name != "logits"}
    return result._replace(logprob=got[..., 0]), type(output)(**rest)


def _identifiers(consts: Any) -> set[str]:
    """What a code object (its names and constants) or a tuple of constants names: names,
    numbers and short strings without spaces (modes, keys; not docstrings or messages),
    nested code and tuples included."""
    found: set[str] = set()
    if isinstance(consts, types.CodeType):
        found = {name for name in consts.co_names if name.isidentifier()}
        consts = consts.co_consts
    for const in consts:
        if isinstance(const, (types.CodeType, tuple)):
            found |= _identifiers(const)
        elif isinstance(const, str) and const and len(const) <= 40 and " " not in const:
            found.add(const)
        elif isinstance(const, (int, float)):
            found.add(repr(const))
    return found


def code_digest(*functions: Callable[..., Any]) -> str:
    """The first 16 hex digits of the sha256 of the names, numbers and short strings that
    ``functions`` name (decorators unwrapped, nested code included), sorted: an adapter
    compares it with the digest of the trainer code it reproduces, so that a trainer whose
    seam reads another option, branch or constant is refused."""
    names = set().union(*(_identifiers(inspect.unwrap(fn).__code__) for fn in functions))
    return hashlib.sha256(" ".join(sorted(names)).encode()).hexdigest()[:16]
