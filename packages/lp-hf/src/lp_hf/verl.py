"""lp as verl's fused-kernel backend: ``fused_kernel_options.impl_backend=lp``.

verl 0.9 (FSDP engine) patches a text causal LM's forward to return per-token log-probs and
entropy from the hidden states when ``actor_rollout_ref.model.use_fused_kernels`` is on; the
backend names it accepts (``torch``, ``triton``, ``liger``) are a fixed list inside
``verl.models.transformers.monkey_patch.patch_forward_with_backends``, so a new one can
only be added by wrapping that function. :func:`use_lp` does so, and verl's plugin loader
calls it: lp-hf registers the entry point ``lp = "lp_hf.verl:verl_plugin"`` in the
``verl.plugins`` group, which ``import verl`` resolves in every process (driver and Ray
workers). Importing this module changes nothing; resolving ``verl_plugin`` registers::

    FSDP engine build -> apply_monkey_patch(model, use_fused_kernels, fused_kernels_backend)
      -> patch_forward_with_backends (wrapped): backend "lp" -> use_lp_forward(model),
         any other backend -> verl's own function, unchanged
    engine forward step -> model(input_ids [1, N] (rmpad) or [B, S], position_ids,
                                 temperature=T, shift_labels=[1, N], return_dict=True)
      -> the instance forward (this module): targets = shift_labels, else the ids rolled
         left by one (verl's convention: no masking, the last position scores the first id)
         install_logprob_head(model) for this call only (removed in a finally)
           head.logprobs(..., shift_labels=targets, temperature=T, return_entropy=True)
             -> model(...) again (FSDP2's hooks nest; the root stays unsharded), which
                this forward answers with model.model (the decoder), then lm_head, as
                verl's own fused forwards do; lm_head's forward computes lp's result
      -> CausalLMOutputForPPO(log_probs [1, N] fp32, entropy [1, N] fp32), contiguous

The forward is an instance attribute: verl's own backends replace the class's forward, lp
replaces nothing shared. ``lm_head`` computes inside its own forward, so under FSDP2 its
weight is unsharded there as for the stock logits. Every row of the weight takes part in
the softmax (padded-vocabulary rows too), as in verl's torch backend; targets are used as
given (verl's are token ids, never an ignore index). Entropy is always returned, as verl's
backends do (the engine reads it when it asks for it).

Not supported, with an error naming it: verl other than 0.9.x; the multimodal model types
that verl gives their own fused forward (:data:`MULTIMODAL_TYPES`), a model without a
decoder at ``.model``; ``return_dict=False``,
``past_key_values`` and ``logits_to_keep`` (verl's fused forwards take none of them).
With ``VERL_USE_EXTERNAL_PLUGINS=none`` call :func:`use_lp` yourself in each process that
builds a model.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from types import ModuleType
from typing import Any

import torch

from lp_hf.adapters import (
    HeadOptions,
    check_parameters,
    check_series,
    head_logprobs,
    set_forward,
)
from lp_hf.head import Backend

__all__ = [
    "BACKEND",
    "MULTIMODAL_TYPES",
    "SUPPORTED_VERSIONS",
    "remove_lp",
    "use_lp",
    "use_lp_forward",
    "verl_version",
]

SUPPORTED_VERSIONS = "0.9"
"""The verl release series whose fused-kernel hook this module was read against."""

BACKEND = "lp"
"""The ``fused_kernel_options.impl_backend`` value that selects lp."""

MULTIMODAL_TYPES = frozenset(
    {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe"}
)
"""``config.model_type`` values that verl 0.9 patches with a forward of their own (refused)."""

_HOOK_PARAMETERS = ("model", "use_fused_kernels", "fused_kernels_backend")


def verl_version() -> str:
    """The installed verl version (``importlib.metadata``)."""
    return importlib.metadata.version("verl")


def _monkey_patch_module() -> ModuleType:
    version = verl_version()
    check_series("lp_hf.verl", "verl", version, SUPPORTED_VERSIONS, "fused-kernel hook")
    from verl.models.transformers import monkey_patch

    hook = getattr(monkey_patch, "patch_forward_with_backends", None)
    what = f"verl {version}'s monkey_patch.patch_forward_with_backends"
    check_parameters("lp_hf.verl", what, getattr(hook, "stock", hook), _HOOK_PARAMETERS)
    return monkey_patch


class _Dispatch:
    """Stands in for verl's ``patch_forward_with_backends``: ``"lp"`` here, the rest to verl."""

    def __init__(self, stock: Any, options: HeadOptions):
        self.stock = stock
        self.options = options

    def __call__(
        self,
        model: torch.nn.Module,
        use_fused_kernels: bool = False,
        fused_kernels_backend: str | None = None,
    ) -> None:
        if use_fused_kernels and fused_kernels_backend == BACKEND:
            use_lp_forward(model, self.options)
            return
        self.stock(
            model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
        )


class _LpForward:
    """The patched model's ``forward`` (an instance attribute; see the module docstring).

    While it runs, the head's own call of the model reaches :func:`_decoder_and_head`
    (``inside``).
    """

    def __init__(self, model: torch.nn.Module, options: HeadOptions):
        self.model = model
        self.options = options
        self.inside = False

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        model = self.model
        if self.inside:  # head.logprobs -> model(...): decoder, then the head's lm_head
            return _decoder_and_head(model, input_ids, attention_mask, position_ids, kwargs)
        _check_call(return_dict, logits_to_keep, kwargs)
        if shift_labels is None:
            base = labels if labels is not None else input_ids
            if base is None:
                raise ValueError("the lp fused forward needs input_ids, labels or shift_labels")
            shift_labels = torch.roll(base, shifts=-1, dims=-1)
        self.inside = True
        try:
            out, output = head_logprobs(
                model,
                self.options,
                input_ids,
                temperature,
                shift_labels=shift_labels,
                attention_mask=attention_mask,
                position_ids=position_ids,
                return_entropy=True,
                **kwargs,
            )
        finally:
            self.inside = False
        from verl.models.transformers.dense_common import CausalLMOutputForPPO

        # the head's results are views of one [.., 2] tensor: FSDP2 hooks the outputs of the
        # module's forward for backward, and an in-place op on a view would lose that hook
        return CausalLMOutputForPPO(
            log_probs=out.logprob.contiguous(),
            entropy=out.entropy.contiguous(),
            hidden_states=output.get("hidden_states"),
            attentions=output.get("attentions"),
        )


def _decoder_and_head(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> Any:
    """The class forward's two steps, as verl's own fused forwards take them: the decoder
    (``model.model``), then the output layer on its hidden states. Not ``type(model).forward``:
    verl's torch/triton backends replace that class-wide, for every model of the class."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    kwargs.pop("return_dict", None)
    outputs = model.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )
    logits = model.get_output_embeddings()(outputs[0])
    return CausalLMOutputWithPast(
        logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
    )


def _check_call(return_dict: bool | None, logits_to_keep: Any, kwargs: dict[str, Any]) -> None:
    if return_dict is False:
        raise NotImplementedError("the lp fused forward returns a dict only (return_dict=True)")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise NotImplementedError("the lp fused forward scores every position (logits_to_keep)")
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise NotImplementedError("the lp fused forward runs without a KV cache (use_cache=False)")


def use_lp_forward(model: torch.nn.Module, options: HeadOptions | None = None) -> torch.nn.Module:
    """Give one model the lp fused forward (what ``impl_backend=lp`` does to verl's model).

    Args:
        model: a transformers text causal LM (verl's actor or reference model, before or
            after FSDP wraps it).
        options: lp-hf head options; default :class:`lp_hf.adapters.HeadOptions()`.

    Returns:
        ``model``: its ``forward`` returns ``CausalLMOutputForPPO(log_probs, entropy)``.

    Raises:
        NotImplementedError: a multimodal model type (:data:`MULTIMODAL_TYPES`).
        ValueError: the model already has another instance forward, or lp with other
            options; a model lp-hf refuses (:func:`lp_hf.install_logprob_head`'s errors).
    """
    options = HeadOptions() if options is None else options
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MULTIMODAL_TYPES:
        raise NotImplementedError(
            f"lp_hf.verl: verl gives {model_type} a multimodal fused forward that lp does not "
            "reproduce; use fused_kernel_options.impl_backend=torch for this model"
        )
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        raise TypeError(
            f"lp_hf.verl: {type(model).__name__} has no decoder at .model (verl's fused "
            "forwards call model.model, then lm_head)"
        )
    set_forward(model, model, _LpForward, options, "model")
    model._verl_fused_kernels_backend = BACKEND
    return model


def use_lp(
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> None:
    """Register ``lp`` as a verl fused-kernel backend in this process.

    verl's plugin loader calls it through the ``verl.plugins`` entry point (default
    options); call it yourself only with ``VERL_USE_EXTERNAL_PLUGINS=none`` or for other
    options, in every process that builds a model, before the engine builds it. Then
    ``actor_rollout_ref.model.use_fused_kernels=True`` with
    ``actor_rollout_ref.model.fused_kernel_options.impl_backend=lp`` patches the model with
    :func:`use_lp_forward`; the other backends behave as before.

    Args:
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).

    Raises:
        RuntimeError: another verl version, or a fused-kernel hook of other arguments.
        ValueError: already registered with other options (call :func:`remove_lp` first).

    Example:
        >>> lp_hf.verl.use_lp()  # doctest: +SKIP
    """
    monkey_patch = _monkey_patch_module()
    options = HeadOptions(deterministic, backend, chunk_size, validate)
    current = monkey_patch.patch_forward_with_backends
    if isinstance(current, _Dispatch):
        if current.options != options:
            raise ValueError(f"lp is registered in verl with {current.options}; remove_lp first")
        return
    monkey_patch.patch_forward_with_backends = _Dispatch(current, options)


def remove_lp() -> None:
    """Give verl its own ``patch_forward_with_backends`` back (idempotent).

    Models already patched keep the lp forward; ``del model.forward`` undoes one.
    """
    from verl.models.transformers import monkey_patch

    current = monkey_patch.patch_forward_with_backends
    if isinstance(current, _Dispatch):
        monkey_patch.patch_forward_with_backends = current.stock


def _plugin() -> Any:
    """The entry point's target: registers lp; verl's loader hides errors, so warn instead."""
    try:
        use_lp()
    except (RuntimeError, ValueError) as exc:
        warnings.warn(f"lp_hf.verl: impl_backend=lp is unavailable: {exc}", stacklevel=2)
    return use_lp


def __getattr__(name: str) -> Any:
    # verl's loader resolves ``lp_hf.verl:verl_plugin`` (an attribute lookup); only that
    # lookup registers, never the import of this module
    if name == "verl_plugin":
        return _plugin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
