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

The forward is an instance attribute: verl's own backends replace the class's forward; lp
replaces one shared thing, the engine's step, for the fused loss below. ``lm_head``
computes inside its own forward, so under FSDP2 its weight is unsharded there as for the
stock logits. Every row of the weight takes part in the softmax (padded-vocabulary rows
too), as in verl's torch backend; targets are used as given (verl's are token ids, never
an ignore index). Entropy is always returned, as verl's backends do (the engine reads it
when it asks for it).

Not supported, with an error naming it: verl other than 0.9.x; the multimodal model types
that verl gives their own fused forward (:data:`MULTIMODAL_TYPES`), a model without a
decoder at ``.model``; ``return_dict=False``,
``past_key_values`` and ``logits_to_keep`` (verl's fused forwards take none of them).
With ``VERL_USE_EXTERNAL_PLUGINS=none`` call :func:`use_lp` yourself in each process that
builds a model.

The fused loss, ``fused_kernel_options.lp_fused_loss=True`` beside ``impl_backend=lp``
(:data:`FUSED_LOSS_KEY`). verl's actor loss, ``ppo_loss`` (vanilla PPO: the clipped and
dual-clipped surrogate, minus ``entropy_coeff`` times the entropy, plus ``kl_loss_coef``
times ``kl_penalty``), is a per-token function of the log-probs and entropy, each term
aggregated by ``agg_loss`` with one mode, mask and global batch info, linearly; so it is one
``linear_logprob_loss`` with a :class:`lp_kernels.losses.PolicyLoss` whose per-token weights
are ``agg_loss``'s gradient (three GEMMs where the step on the head's log-probs takes four).
The micro-batch reaches the model only through the engine's step, so when lp patches a
model it also puts :class:`_FusedStep` in place of ``FSDPEngineWithLMHead.forward_step``
(every engine without the key runs verl's own step; :func:`remove_lp` restores it)::

    engine.forward_step(micro_batch, loss_function=partial(ppo_loss, config), forward_only)
      key set, training: fused_loss_refusals (ValueError naming each option not covered)
        loss_request: PolicyLoss from the ActorConfig; old log-probs, advantages, ref
          log-probs and agg_loss's weights [B, R], placed on the model's rows by verl's
          no_padding_2_padding applied to the row numbers (0 elsewhere)
        armed on the lp forward, verl's own step runs with the loss function wrapped:
          model(...)    -> linear_logprob_loss in lm_head's forward; log-probs (every row;
                           tied to the loss with weight 0, so FSDP's backward hooks on the
                           outputs run) and entropy, the loss only where weighted
          ppo_loss      -> verl's own, on those: its value and metrics (pg_loss, pg_clipfrac,
                           ppo_kl, pg_clipfrac_lower, entropy_loss, kl_loss)
                           + (fused - fused.detach()): the gradient of the same loss
          loss.backward() by the engine

So the value and metrics are verl's operations on lp's log-probs and the gradients those
of the same loss within fp32 rounding. Refused by name: another ``policy_loss.loss_mode``,
rollout importance-sampling weights, ``kl_loss_type`` abs, full and the straight-through
``k1+`` / ``k3+`` forms, negative ``kl_loss_coef``, clip bounds outside ``PolicyLoss``'s
range, Ulysses sequence parallelism, ``pad_to_length``, distillation, multimodal inputs, a
loss function other than ``partial(ppo_loss, config=...)``, and verl loss code other than
0.9.1's (a digest of its identifiers).
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from lp_hf.adapters import (
    HeadOptions,
    LossPasses,
    check_parameters,
    check_series,
    code_digest,
    head_logprobs,
    loss_forward,
    set_forward,
)
from lp_hf.head import Backend
from lp_kernels import LossOutput
from lp_kernels.losses import PolicyLoss

__all__ = [
    "BACKEND",
    "FUSED_LOSS_KEY",
    "MULTIMODAL_TYPES",
    "SUPPORTED_VERSIONS",
    "LossRequest",
    "fused_loss_refusals",
    "loss_digest",
    "loss_request",
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
            _install_step_seam()
            return
        self.stock(
            model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
        )


class _LpForward(LossPasses):
    """The patched model's ``forward`` (an instance attribute; see the module docstring).

    While it runs, the head's own call of the model reaches :func:`_decoder_and_head`
    (``inside``).
    """

    def __init__(self, model: torch.nn.Module, options: HeadOptions):
        self.model = model
        self.options = options
        self.inside = False
        self.request: LossRequest | None = None

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
        if self.request is not None:
            kwargs.pop("use_cache", None)
            kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
            return self._loss_call(input_ids, shift_labels, temperature, kwargs)
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

    def _loss_call(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        kwargs: dict[str, Any],
    ) -> Any:
        """The armed call: ``linear_logprob_loss`` in the output layer's forward; its
        log-probs and entropy returned, the loss in ``request.output``."""
        request = self.request
        if request.output is not None:
            raise RuntimeError("lp_hf.verl: the model ran twice in one fused loss pass")
        if tuple(targets.shape) != request.shape:
            raise RuntimeError(
                f"lp_hf.verl: the engine called the model with {tuple(targets.shape)} rows, the "
                f"fused loss was built for {request.shape}; verl changed"
            )
        self.inside = True
        try:
            request.output, output = loss_forward(
                self.model,
                self.options,
                input_ids,
                targets,
                request.loss_fn,
                request.per_token,
                temperature,
                return_entropy=True,
                logits_to_keep=0,
                **kwargs,
            )
        finally:
            self.inside = False
        from verl.models.transformers.dense_common import CausalLMOutputForPPO

        # the log-probs carry the loss's graph with weight 0 (the same values, no gradient
        # added): FSDP's pre-backward hooks on the module's outputs then run before the
        # loss's backward reaches the parameters, as they do for the stock outputs
        tied = request.output.logprob + 0.0 * request.output.loss
        return CausalLMOutputForPPO(
            log_probs=tied,
            entropy=request.output.entropy.contiguous(),
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


# ---- the fused loss: verl's PPO actor loss in the head pass --------------------------------

FUSED_LOSS_KEY = "lp_fused_loss"
"""The ``fused_kernel_options`` key that turns the fused loss on (with ``impl_backend=lp``)."""

_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_SEAM_DIGEST = "35c74dfc1d99d379"
"""Digest of the names, numbers and short strings of verl 0.9.1's ``ppo_loss``,
``compute_policy_loss_vanilla``, ``agg_loss``, ``kl_penalty`` and ``kl_penalty_forward``:
the code whose loss the fused step reproduces."""
_KL_ESTIMATORS = {
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "mse+": "k2",
    "k2+": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}
"""verl's ``kl_loss_type`` values whose ``kl_penalty`` is lp's estimator (value and gradient)."""
_CLAMP_LOG_RATIO = 20.0  # verl clamps the log-ratio (policy loss, low_var_kl) to [-20, 20]
_CLAMP_KL = 10.0  # and low_var_kl's estimate to [-10, 10]


@dataclass
class LossRequest:
    """One fused loss pass: the micro-batch's loss, armed on the lp forward for one call.

    Attributes:
        loss_fn: the per-token loss (:class:`lp_kernels.losses.PolicyLoss`).
        per_token: its keyword tensors in the model's row layout (``shape``), 0 off the loss.
        shape: the targets' shape the engine passes the model (``[1, N]`` or ``[B, S]``).
        output: ``linear_logprob_loss``'s result, once the model has run.
        used: the engine's loss function has taken ``output``'s gradient.
    """

    loss_fn: PolicyLoss
    per_token: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    output: LossOutput | None = field(default=None)
    used: bool = False


def loss_digest() -> str:
    """The digest of verl's actor-loss code as installed (compared with verl 0.9.1's)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses

    functions = (
        losses.ppo_loss,
        core_algos.compute_policy_loss_vanilla,
        core_algos.agg_loss,
        core_algos.kl_penalty,
        core_algos.kl_penalty_forward,
    )
    return code_digest(*functions)


def fused_loss_refusals(config: Any, micro_batch: Any, engine: Any) -> list[str]:
    """The options of this actor step whose loss the fused step does not reproduce (empty:
    every one is covered). ``config``: verl's ``ActorConfig``; ``micro_batch``: the engine's
    ``TensorDict``; ``engine``: the ``FSDPEngineWithLMHead``."""
    from verl.utils import tensordict_utils as tu

    refused = []
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode != "vanilla":
        refused.append(f"policy_loss.loss_mode={mode!r}")
    keys = set(micro_batch.keys())  # a TensorDict refuses `in` itself
    if "rollout_is_weights" in keys:
        refused.append("rollout importance-sampling weights (rollout_is_weights)")
    if config.use_kl_loss and config.kl_loss_type not in _KL_ESTIMATORS:
        refused.append(f"kl_loss_type={config.kl_loss_type!r}")
    if config.use_kl_loss and not config.kl_loss_coef >= 0:
        refused.append(f"kl_loss_coef={config.kl_loss_coef} (need >= 0)")
    low, high = _clip_bounds(config)
    if not (0 <= low < 1 and high >= 0):
        refused.append(f"clip_ratio_low/high=({low}, {high}) (need 0 <= low < 1, high >= 0)")
    if getattr(engine, "use_ulysses_sp", False):
        refused.append("Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1)")
    if getattr(engine, "pad_to_length", None):
        refused.append("pad_to_length")
    for key in ("distillation_use_topk", "distillation_only", "calculate_sum_pi_squared"):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            refused.append(key)
    if "multi_modal_inputs" in keys:
        refused.append("multi_modal_inputs")
    return refused


def _clip_bounds(config: Any) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)`` as ``compute_policy_loss_vanilla`` reads them."""
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    return low, high


def loss_request(config: Any, micro_batch: Any) -> LossRequest:
    """The :class:`LossRequest` of one actor micro-batch: verl's ``ppo_loss`` (vanilla PPO,
    its entropy and KL terms) as one :class:`PolicyLoss` with per-token weights.

    Every term of ``ppo_loss`` is aggregated by ``agg_loss`` with the same mode, mask and
    global batch info, linearly: the weights are ``agg_loss``'s own gradient with respect
    to its loss matrix. The response tokens' values (``[B, R]``, padded as ``ppo_loss``
    pads them) are placed on the model's rows by verl's own ``no_padding_2_padding``
    applied to the row numbers.
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu

    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += ["ref_log_prob"] if config.use_kl_loss else []
    padded = micro_batch.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].to(bool)
    info = {
        "dp_size": micro_batch["dp_size"],
        "batch_num_tokens": micro_batch["batch_num_tokens"],
        "global_batch_size": micro_batch["global_batch_size"],
        "loss_scale_factor": config.loss_scale_factor,
    }
    with torch.enable_grad():
        x = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
        total = agg_loss(loss_mat=x, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **info)
        (weights,) = torch.autograd.grad(total, x)
    entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
    use_kl = bool(config.use_kl_loss)
    loss_fn = PolicyLoss(
        *_clip_bounds(config),
        dual_clip=config.get("clip_ratio_c", 3.0),
        kl_coef=float(config.kl_loss_coef) if use_kl else 0.0,
        kl_estimator=_KL_ESTIMATORS[config.kl_loss_type] if use_kl else "k3",
        entropy_coef=float(config.entropy_coeff) if entropy else 0.0,
        max_log_ratio=_CLAMP_LOG_RATIO,
        max_kl=_CLAMP_KL,
    )
    per_token = {
        "old_logprob": padded["old_log_probs"],
        "advantages": padded["advantages"],
        "weights": weights,
    }
    if use_kl:
        per_token["ref_logprob"] = padded["ref_log_prob"]
    place, shape = _row_layout(micro_batch, mask.shape)
    return LossRequest(loss_fn, {k: place(v) for k, v in per_token.items()}, shape)


def _row_layout(
    micro_batch: Any, response_shape: torch.Size
) -> tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]:
    """``(place, shape)``: ``place`` puts a ``[B, R]`` response tensor on the rows of the
    model call (``shape``: ``[1, N]`` packed, or ``[B, S]`` padded without remove-padding),
    0 elsewhere, fp32."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    offsets = micro_batch["input_ids"].offsets()
    total = int(offsets[-1])
    # 1 + the packed row ppo_loss reads for each response slot; 0 at its padding
    index = no_padding_2_padding(torch.arange(1, total + 1, device=offsets.device), micro_batch)
    if tuple(index.shape) != tuple(response_shape):
        raise RuntimeError(
            f"lp_hf.verl: response rows {tuple(index.shape)} vs the loss tensors' "
            f"{tuple(response_shape)}; verl changed"
        )
    live = index > 0
    rows = index[live] - 1
    shape: tuple[int, ...] = (1, total)
    if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        lengths = offsets.diff()
        width = int(lengths.max())
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=rows.device), lengths)
        padded_row = sequence * width + torch.arange(total, device=rows.device) - offsets[sequence]
        rows, shape = padded_row[rows], (len(lengths), width)

    def place(value: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=value.device)
        out[rows.to(value.device)] = value[live.to(value.device)].float()
        return out.view(shape)

    return place, shape


class _WithFusedGradient:
    """The engine's loss function for one fused micro-batch: verl's own ``ppo_loss`` on the
    detached log-probs (its value and metrics) plus ``fused - fused.detach()`` (the
    gradient of the same loss, finished in the head pass)."""

    def __init__(self, stock: Callable[..., Any], request: LossRequest):
        self.stock = stock
        self.request = request

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        request = self.request
        if request.used or request.output is None:
            raise RuntimeError(
                "lp_hf.verl: the loss function ran before the model, or twice, in one fused "
                f"step; verl changed (remove {FUSED_LOSS_KEY})"
            )
        loss, metrics = self.stock(model_output=model_output, data=data, dp_group=dp_group)
        request.used = True
        fused = request.output.loss
        return loss + (fused - fused.detach()), metrics


class _FusedStep:
    """Stands in for ``FSDPEngineWithLMHead.forward_step`` (a class attribute, installed when
    lp patches a model): an engine whose ``fused_kernel_options`` has :data:`FUSED_LOSS_KEY`
    computes its actor loss in the head pass; every other call is verl's own step."""

    def __init__(self, stock: Callable[..., Any]):
        self.stock = stock

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else types.MethodType(self, engine)

    def __call__(self, engine: Any, micro_batch: Any, loss_function: Any, forward_only: bool):
        options = getattr(engine.model_config, "fused_kernel_options", None) or {}
        if forward_only or loss_function is None or not options.get(FUSED_LOSS_KEY):
            return self.stock(
                engine, micro_batch, loss_function=loss_function, forward_only=forward_only
            )
        forward = _lp_forward_of(engine.module)
        config = _ppo_loss_config(loss_function)
        refused = fused_loss_refusals(config, micro_batch, engine)
        if refused:
            raise ValueError(
                f"lp_hf.verl: {FUSED_LOSS_KEY} does not reproduce verl's actor loss with "
                f"{'; '.join(refused)}; remove {FUSED_LOSS_KEY} (verl's loss on lp's log-probs)"
            )
        request = loss_request(config, micro_batch)
        with forward.loss_pass(request):
            result = self.stock(
                engine,
                micro_batch,
                loss_function=_WithFusedGradient(loss_function, request),
                forward_only=forward_only,
            )
        if not request.used:
            raise RuntimeError(
                "lp_hf.verl: the engine's step did not call its loss function; verl changed "
                f"(remove {FUSED_LOSS_KEY})"
            )
        return result


def _lp_forward_of(module: torch.nn.Module) -> _LpForward:
    """The lp forward of the engine's model (FSDP1 wraps it, FSDP2 is the model itself)."""
    for sub in module.modules():
        forward = sub.__dict__.get("forward")
        if isinstance(forward, _LpForward):
            return forward
    raise ValueError(
        f"lp_hf.verl: {FUSED_LOSS_KEY} needs the lp fused forward: use_fused_kernels=True and "
        "fused_kernel_options.impl_backend=lp"
    )


def _ppo_loss_config(loss_function: Any) -> Any:
    """The ``ActorConfig`` of ``partial(ppo_loss, config=...)``, the actor's loss function,
    after checking that ``ppo_loss`` and the functions it calls are verl 0.9.1's."""
    from verl.workers.utils import losses

    if not (
        isinstance(loss_function, functools.partial)
        and loss_function.func is losses.ppo_loss
        and set(loss_function.keywords) == {"config"}
        and not loss_function.args
    ):
        raise ValueError(
            f"lp_hf.verl: {FUSED_LOSS_KEY} reproduces verl's ppo_loss; this actor's loss is "
            f"{loss_function!r} (distillation or another loss: remove {FUSED_LOSS_KEY})"
        )
    digest = loss_digest()
    if digest != _SEAM_DIGEST:
        raise RuntimeError(
            f"lp_hf.verl: verl's ppo_loss / compute_policy_loss_vanilla / agg_loss / kl_penalty "
            f"are not the ones lp-hf has read (0.9.1: digest {_SEAM_DIGEST}, got {digest}); "
            f"remove {FUSED_LOSS_KEY}"
        )
    return loss_function.keywords["config"]


def _engine_class() -> type | None:
    """verl's ``FSDPEngineWithLMHead`` if its module is imported, else None."""
    return getattr(sys.modules.get(_ENGINE_MODULE), "FSDPEngineWithLMHead", None)


def _install_step_seam() -> None:
    """Put :class:`_FusedStep` on ``FSDPEngineWithLMHead`` (idempotent; :func:`remove_lp`
    takes it off). Without the engine module imported (a model patched outside verl's
    engine) there is nothing to install."""
    engine = _engine_class()
    if engine is None or isinstance(engine.__dict__.get("forward_step"), _FusedStep):
        return
    check_parameters(
        "lp_hf.verl",
        "verl's FSDPEngineWithLMHead.forward_step",
        engine.forward_step,
        ("self", "micro_batch", "loss_function", "forward_only"),
    )
    engine.forward_step = _FusedStep(engine.__dict__["forward_step"])


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
    :func:`use_lp_forward`; the other backends behave as before. Adding
    ``fused_kernel_options.lp_fused_loss=True`` (Hydra: ``+actor_rollout_ref.model.
    fused_kernel_options.lp_fused_loss=True``) computes the actor's PPO loss in the head
    pass (module docstring): verl's loss value and metrics, its gradients within fp32
    rounding. Covered: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high``, the dual
    clip ``clip_ratio_c``, every ``loss_agg_mode`` (with the global batch info and
    ``loss_scale_factor``), ``entropy_coeff`` (when the step computes the entropy, as
    verl's loss reads it), ``use_kl_loss`` with ``kl_loss_type`` kl / k1, mse / k2 (``+``
    too), low_var_kl / k3, padded and remove-padding batches. The other options raise
    ``ValueError`` at the step, naming each (:func:`fused_loss_refusals`).

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
    """Give verl its own ``patch_forward_with_backends`` and, where lp replaced it,
    ``FSDPEngineWithLMHead.forward_step`` back (idempotent).

    Models already patched keep the lp forward; ``del model.forward`` undoes one.
    """
    from verl.models.transformers import monkey_patch

    current = monkey_patch.patch_forward_with_backends
    if isinstance(current, _Dispatch):
        monkey_patch.patch_forward_with_backends = current.stock
    engine = _engine_class()
    step = None if engine is None else engine.__dict__.get("forward_step")
    if isinstance(step, _FusedStep):
        engine.forward_step = step.stock


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
