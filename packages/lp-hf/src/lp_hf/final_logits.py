"""What a transformers causal LM does to its output layer's result, and how lp-hf takes over.

Some models change the logits after ``lm_head`` before returning them. lp computes the
same transform inside its kernels, ``z = c * tanh(s * l / c) / T`` (``logit_scale`` s,
``softcap`` c, temperature T, on the raw logits ``l``, bias included), so for the head's
model forward each of the model's own steps is switched off and restored afterwards.

What a forward does is code, not config: the same field means different things in
different families (``logits_scaling`` divides Granite's logits, multiplies
HyperCLOVA X's, and divides MiniCPM3's hidden states before ``lm_head``), and some read a
copy taken at init. So lp-hf keeps, per transformers class (the class in the MRO of the
output layer's owner that defines ``forward``), the steps read from that forward's source
(transformers 5.24), each from where the forward reads it at run time:

=================================================  =========================================
classes (``...ForCausalLM``)                       after ``logits = self.lm_head(h)``
=================================================  =========================================
Gemma2, Gemma3, Gemma3n, Gemma4, Gemma4Unified,    ``if config.final_logit_softcapping is
VaultGemma, NanoChat, Beam                         not None``: ``c * tanh(logits / c)``
Cohere, Cohere2, Cohere2Moe, CohereCompass         ``logits * self.logit_scale`` (module
                                                   attribute, ``config.logit_scale`` at init)
Granite, GraniteSWA, GraniteMoe, GraniteMoeSWA,    ``logits / config.logits_scaling``
GraniteMoeShared, GraniteMoeHybrid
FalconH1                                           ``logits * self.model.lm_head_multiplier``
                                                   (``config.lm_head_multiplier`` at init)
HyperCLOVAX                                        ``logits * config.logits_scaling``
MiniCPM3                                           nothing: ``config.logits_scaling`` divides
                                                   ``h``, which the head receives as it is
=================================================  =========================================

Switched off, the softcap field is None (the forward skips the step: ``.logits`` is the
head's own result) and a scale is 1.0 (the forward still multiplies or divides, by 1:
``.logits`` is a new tensor with the head's values bit for bit, which ``logprobs`` checks,
one host sync, and drops in favour of its own result).

Any other class that sets one of :data:`FIELDS` in its config (to other than None, or 1 for
a scale), or a listed class that sets a field its forward does not read, is refused,
naming the field: lp-hf has not read that code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["FIELDS", "FinalLogitTransform", "model_logit_transform", "model_softcap"]

FIELDS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "output_multiplier",
)
"""Config fields of transformers models that post-process the logits (or, MiniCPM3, the
output layer's input): set on a class lp-hf has not read, the model is refused."""

Op = Literal["softcap", "multiply", "divide", "input"]


@dataclass(frozen=True)
class _Step:
    """One step of a forward, after (or, ``input``, before) its output layer."""

    path: str
    """Where the forward reads the value, from the output layer's owner module."""
    op: Op
    """``softcap``: ``c * tanh(l / c)`` unless the value is None; ``multiply`` /
    ``divide``: ``l * v`` / ``l / v``, always; ``input``: applied to the layer's input."""
    field: str
    """The config field the value comes from (itself, or a copy taken at init)."""

    @property
    def off(self) -> float | None:
        """The value that switches the step off: None skips a softcap; 1 keeps a scale's
        values bit for bit."""
        return None if self.op == "softcap" else 1.0


_SOFTCAP = (_Step("config.final_logit_softcapping", "softcap", "final_logit_softcapping"),)
_COHERE = (_Step("logit_scale", "multiply", "logit_scale"),)
_GRANITE = (_Step("config.logits_scaling", "divide", "logits_scaling"),)
_FALCON_H1 = (_Step("model.lm_head_multiplier", "multiply", "lm_head_multiplier"),)
_HYPERCLOVAX = (_Step("config.logits_scaling", "multiply", "logits_scaling"),)
_MINICPM3 = (_Step("config.logits_scaling", "input", "logits_scaling"),)

_VERIFIED: dict[str, tuple[_Step, ...]] = {
    f"transformers.models.{module}.modeling_{module}.{name}": steps
    for steps, module, name in (
        (_SOFTCAP, "gemma2", "Gemma2ForCausalLM"),
        (_SOFTCAP, "gemma3", "Gemma3ForCausalLM"),
        (_SOFTCAP, "gemma3n", "Gemma3nForCausalLM"),
        (_SOFTCAP, "gemma4", "Gemma4ForCausalLM"),
        (_SOFTCAP, "gemma4_unified", "Gemma4UnifiedForCausalLM"),
        (_SOFTCAP, "vaultgemma", "VaultGemmaForCausalLM"),
        (_SOFTCAP, "nanochat", "NanoChatForCausalLM"),
        (_SOFTCAP, "beam", "BeamForCausalLM"),
        (_COHERE, "cohere", "CohereForCausalLM"),
        (_COHERE, "cohere2", "Cohere2ForCausalLM"),
        (_COHERE, "cohere2_moe", "Cohere2MoeForCausalLM"),
        (_COHERE, "cohere_compass", "CohereCompassForCausalLM"),
        (_GRANITE, "granite", "GraniteForCausalLM"),
        (_GRANITE, "granite_swa", "GraniteSWAForCausalLM"),
        (_GRANITE, "granitemoe", "GraniteMoeForCausalLM"),
        (_GRANITE, "granitemoe_swa", "GraniteMoeSWAForCausalLM"),
        (_GRANITE, "granitemoeshared", "GraniteMoeSharedForCausalLM"),
        (_GRANITE, "granitemoehybrid", "GraniteMoeHybridForCausalLM"),
        (_FALCON_H1, "falcon_h1", "FalconH1ForCausalLM"),
        (_HYPERCLOVAX, "hyperclovax", "HyperCLOVAXForCausalLM"),
        (_MINICPM3, "minicpm3", "MiniCPM3ForCausalLM"),
    )
}
"""``module.qualname`` of a transformers class -> the steps of its ``forward``, in order."""


@dataclass(frozen=True)
class FinalLogitTransform:
    """The model's final-logit transform as lp's arguments (None: no such step).

    Example:
        >>> FinalLogitTransform(logit_scale=0.25)
        FinalLogitTransform(softcap=None, logit_scale=0.25)
    """

    softcap: float | None = None
    """``softcap=`` of lp: the model caps its logits, ``c * tanh(l / c)``."""
    logit_scale: float | None = None
    """``logit_scale=`` of lp: the model scales its raw logits by it, before any cap."""


@dataclass(frozen=True)
class PostProcessing:
    """What one model forward does after its output layer, read at one moment."""

    owner: torch.nn.Module
    """The module whose forward calls the output layer (the values are read from it)."""
    transform: FinalLogitTransform
    steps: tuple[_Step, ...]
    """The steps to switch off for the head's forward."""
    exact: bool
    """The model then returns the head's result itself (else a copy with its values)."""


def output_layer_owner(model: torch.nn.Module, layer: torch.nn.Module | None) -> torch.nn.Module:
    """The module of ``model`` that holds ``layer`` as a child (``model`` itself for a
    transformers causal LM; the inner one under a wrapper), else ``model``."""
    if layer is not None:
        for module in model.modules():
            if any(child is layer for child in module.children()):
                return module
    return model


def _forward_class(module: torch.nn.Module) -> str:
    """``module.qualname`` of the class whose ``forward`` the module runs (an FSDP2 class
    made by ``fully_shard`` inherits it)."""
    for cls in type(module).__mro__:
        if "forward" in cls.__dict__:
            return f"{cls.__module__}.{cls.__qualname__}"
    return f"{type(module).__module__}.{type(module).__qualname__}"  # pragma: no cover


def _resolve(owner: Any, path: str) -> tuple[Any, str]:
    """The object that holds the last attribute of ``path``, and that attribute's name."""
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _neutral(field: str, value: Any) -> bool:
    """The field's value means "no step": None, or 1 for a scale."""
    if value is None:
        return True
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return field != "final_logit_softcapping" and number and value == 1


def _read(owner: torch.nn.Module, step: _Step) -> float | None:
    """The step's value, checked: None (a softcap only) or a finite float > 0."""
    parent, name = _resolve(owner, step.path)
    value = getattr(parent, name)
    if value is None and step.op == "softcap":
        return None
    where = f"{type(owner).__name__}.{step.path}"
    if step.path != f"config.{step.field}":
        where += f" (from config.{step.field})"
    optional = "None or " if step.op == "softcap" else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be {optional}a float > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where} must be {optional}finite and > 0, got {value!r}")
    return float(value)


def post_processing(owner: torch.nn.Module) -> PostProcessing:
    """Read the final-logit steps of ``owner``'s forward (see the module docstring).

    Raises:
        ValueError: a field of :data:`FIELDS` set where lp-hf does not know the code that
            reads it; a value that is not finite and > 0.
        TypeError: a value that is not a number (None for a scale).
    """
    key = _forward_class(owner)
    steps = _VERIFIED.get(key, ())
    config = getattr(owner, "config", None)
    known = {step.field for step in steps}
    for field in FIELDS:
        value = getattr(config, field, None)
        if field not in known and not _neutral(field, value):
            readers = sorted(
                k.rsplit(".", 1)[1] for k, s in _VERIFIED.items() if field in {t.field for t in s}
            )
            raise ValueError(
                f"the model's config sets {field}={value!r}, and lp-hf does not know how "
                f"{key} uses it, so its log-probs could differ from the model's own; lp-hf "
                f"reads {field} for {', '.join(readers) or 'no class'} (transformers)"
            )
    softcap = None
    scale = 1.0
    off = []
    for step in steps:
        if step.op == "input":
            continue  # the output layer's input: the head computes from it as it is
        value = _read(owner, step)
        if step.op == "softcap":
            softcap = value
            if value is not None:
                off.append(step)
            continue
        if softcap is not None:  # pragma: no cover - no listed class scales after its cap
            raise ValueError(f"{key}: a scale after the softcap is not lp's z = c tanh(s l / c)")
        scale = scale * value if step.op == "multiply" else scale / value
        off.append(step)
    transform = FinalLogitTransform(softcap, None if scale == 1.0 else scale)
    exact = all(step.op == "softcap" for step in off)
    return PostProcessing(owner, transform, tuple(off), exact)


@contextlib.contextmanager
def switched_off(processing: PostProcessing) -> Iterator[None]:
    """Inside, each of the model's own steps has its switch-off value (lp applies them);
    the values are restored on exit, in reverse order, also after an error."""
    saved = []
    try:
        for step in processing.steps:
            parent, name = _resolve(processing.owner, step.path)
            saved.append((parent, name, getattr(parent, name)))
            setattr(parent, name, step.off)
        yield
    finally:
        for parent, name, value in reversed(saved):
            setattr(parent, name, value)


def same_values(got: Any, want: torch.Tensor) -> bool:
    """``got`` is a plain tensor with ``want``'s shape, dtype, device and values (NaN
    equal to NaN): what a multiply by 1 leaves. One host sync."""
    if type(got) is not torch.Tensor:  # a DTensor or other subclass: not what x * 1 gives
        return False
    if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
        return False
    with torch.no_grad():
        return bool(((got == want) | (got.isnan() & want.isnan())).all())


def model_logit_transform(model: torch.nn.Module) -> FinalLogitTransform:
    """The final-logit transform the head computes for ``model``: its softcap and its
    logit scale (a divisor as its reciprocal), read where its forward reads them.

    Raises:
        ValueError, TypeError: as :func:`post_processing` (naming the field).

    Example:
        >>> model_logit_transform(granite)  # doctest: +SKIP
        FinalLogitTransform(softcap=None, logit_scale=0.25)   # config.logits_scaling = 4
    """
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    return post_processing(output_layer_owner(model, layer)).transform


def model_softcap(model: torch.nn.Module) -> float | None:
    """The model's final-logit softcap (``config.final_logit_softcapping`` of the Gemma-style
    classes listed in :mod:`lp_hf.final_logits`), or None.

    Raises:
        ValueError, TypeError: as :func:`model_logit_transform`.
    """
    return model_logit_transform(model).softcap
