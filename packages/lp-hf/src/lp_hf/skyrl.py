"""lp for SkyRL's FSDP / DeepSpeed policy: ``HFModelWrapper.forward`` without logits.

``use_lp(wrapper)`` gives one ``skyrl_train.model_wrapper.HFModelWrapper`` (skyrl-train
0.3.x) an instance ``forward`` with the signature and the results of the class's own,
computed by lp-hf's head::

    wrapper(sequences [B, S], num_actions, attention_mask [B, S], temperature, ...)
      position_ids = cumsum(attention_mask) - 1 (1 at padding)
      use_sample_packing: flash-attn's unpad (SkyRL's import) -> [1, nnz] ids and positions
      targets = the ids rolled left by one (packed: across sequence ends, as SkyRL does)
      install_logprob_head(wrapper.model) for this call only (removed in a finally)
        head.logprobs(..., shift_labels=targets, temperature=temperature,
                      return_entropy=compute_entropy, logits_to_keep=num_actions + 1 when
                      only the action columns are asked for)
      entropy * attention_mask (packed: re-padded with zeros); detached unless
        entropy_requires_grad
      use_sample_packing: re-pad the log-probs -> [B, S]
      log_probs[:, -num_actions - 1 : -1]

The conventions are the stock forward's: the per-call ``temperature`` argument (not the
wrapper's attribute), log-probs of every position, ``output["entropy"]`` ``[B, S]`` when
``compute_entropy``. Differences: the log-probs and entropy are float32 whatever the model's
dtype (the stock ones have the logits' dtype); ``output`` has no ``logits``. Not supported,
with an error naming it: ``sequence_parallel_size > 1`` (Ulysses), ``num_actions`` as a list
of several lengths (the stock forward cannot slice by it either).

The head is installed around each call, so outside it ``wrapper.model`` is the stock model:
``wrapper.generate`` and weight sync see it unchanged. Under FSDP the output layer runs
inside the wrapped module's forward, so its weight is unsharded there as for the stock one.

The fused loss, ``use_lp(worker, fused_loss=True)`` on a policy worker
(``skyrl_train.workers.worker.PolicyWorkerBase``: the FSDP and DeepSpeed policy workers).
Its ``forward_backward`` calls the wrapper, then ``policy_loss_fn`` (SkyRL's
``ppo_policy_loss``), adds ``kl_loss_coef`` times the KL term and subtracts
``entropy_loss_coef`` times the masked-mean entropy, divides by the accumulation steps and
backpropagates. Every term with a gradient is a per-token function of the action log-probs
and entropy, aggregated linearly, so their sum is one ``linear_logprob_loss``
(:class:`SkyrlTokenLoss`; three GEMMs where the stock step takes four)::

    worker.forward_backward(experience, accumulation_steps)   (an instance attribute)
      PolicyWorkerBase.forward_backward (SkyRL's own code), with a loss pass armed:
        self.model(...)     -> linear_logprob_loss in the output layer's forward over the
                               action columns; per-token inputs from the experience (after
                               its to_device); log-probs carrying the loss's graph at weight 0 (the
                               model's outputs, for FSDP2's hooks), entropy detached
        policy_loss_fn      -> SkyRL's ppo_policy_loss on those log-probs (its value
                               and clip ratio) + (fused - fused.detach()): every gradient
        its entropy and KL terms on the detached values: SkyRL's values, no gradient
        strategy.backward(loss / accumulation_steps)

SkyRL 0.3's ``compute_approx_kl`` runs under ``no_grad``, so its KL term changes the loss
value and not the gradient; the fused loss has no KL term either (checked at ``use_lp``:
a KL that carries a gradient is refused).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lp_hf.adapters import (
    HeadOptions,
    LossPasses,
    check_class,
    check_parameters,
    check_series,
    code_digest,
    head_logprobs,
    loss_forward,
    remove_forward,
    set_forward,
)
from lp_hf.head import Backend
from lp_kernels import LossOutput
from lp_kernels.losses import clipped_surrogate

__all__ = [
    "SUPPORTED_VERSIONS",
    "FusedPolicyLoss",
    "SkyrlTokenLoss",
    "check_fused_options",
    "remove_lp",
    "use_lp",
]

SUPPORTED_VERSIONS = "0.3"
"""The skyrl-train release series whose ``HFModelWrapper.forward`` this module reproduces."""

_IGNORE = -100
_PARAMETERS = (
    "self",
    "sequences",
    "num_actions",
    "attention_mask",
    "temperature",
    "return_output",
    "compute_entropy",
    "entropy_requires_grad",
)


def skyrl_train_version() -> str:
    """The installed skyrl-train version (``importlib.metadata``)."""
    return importlib.metadata.version("skyrl-train")


def _wrapper_class() -> type:
    version = skyrl_train_version()
    seam = "HFModelWrapper.forward"
    check_series("lp_hf.skyrl", "skyrl-train", version, SUPPORTED_VERSIONS, seam)
    from skyrl_train.model_wrapper import HFModelWrapper

    what = f"skyrl-train {version}'s {seam}"
    check_parameters("lp_hf.skyrl", what, HFModelWrapper.forward, _PARAMETERS)
    return HFModelWrapper


def _check_parallel(wrapper: torch.nn.Module) -> None:
    if getattr(wrapper, "sequence_parallel_size", 1) > 1:
        raise NotImplementedError(
            "lp_hf.skyrl: sequence_parallel_size > 1 (Ulysses) is not supported; use "
            "sequence_parallel_size=1 or call lp_hf.skyrl.remove_lp(wrapper)"
        )


def _action_count(num_actions: int | list[int]) -> int:
    if isinstance(num_actions, list):
        if len(num_actions) != 1:
            raise ValueError(
                "HFModelWrapper.forward: num_actions must be an int or a one-element list (one "
                f"response width for the batch), got a list of {len(num_actions)}"
            )
        num_actions = num_actions[0]
    return int(num_actions)


class _LpForward(LossPasses):
    """The adapted wrapper's ``forward`` (an instance attribute; see the module docstring)."""

    def __init__(self, wrapper: torch.nn.Module, options: HeadOptions):
        self.wrapper = wrapper
        self.options = options
        self.request: LossPass | None = None

    def __call__(
        self,
        sequences: torch.Tensor,
        num_actions: int | list[int],
        attention_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_output: bool = False,
        compute_entropy: bool = False,
        entropy_requires_grad: bool = True,
    ) -> Any:
        wrapper = self.wrapper
        _check_parallel(wrapper)
        if attention_mask is None:
            raise ValueError("HFModelWrapper.forward needs attention_mask")
        if self.request is not None:
            log_probs, output = self._loss_call(sequences, num_actions, attention_mask, temperature)
            return (log_probs, output) if return_output else log_probs
        width = _action_count(num_actions)
        packing = bool(wrapper.use_sample_packing)
        batch, seqlen = sequences.shape
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        ids, positions, mask, indices = sequences, position_ids, attention_mask, None
        if packing:
            from skyrl_train import model_wrapper

            with torch.no_grad():
                ids, indices, *_ = model_wrapper.unpad_input(sequences[..., None], attention_mask)
                positions, *_ = model_wrapper.unpad_input(position_ids[..., None], attention_mask)
            ids, positions, mask = ids.transpose(0, 1), positions.transpose(0, 1), None
        keep = width + 1 if not packing and not compute_entropy and 0 < width < seqlen else 0
        out, output = head_logprobs(
            wrapper.model,
            self.options,
            ids,
            temperature,
            shift_labels=torch.roll(ids, shifts=-1, dims=1),
            attention_mask=mask,
            position_ids=positions,
            return_entropy=bool(compute_entropy),
            logits_to_keep=keep,
        )
        log_probs, entropy = out.logprob, out.entropy
        if packing:
            from skyrl_train import model_wrapper

            def repad(values: torch.Tensor) -> torch.Tensor:
                padded = model_wrapper.pad_input(values.transpose(0, 1), indices, batch, seqlen)
                return padded.squeeze(-1)

            log_probs = repad(log_probs)
            entropy = None if entropy is None else repad(entropy)
        elif entropy is not None:
            entropy = entropy * attention_mask
        if entropy is not None:
            output["entropy"] = entropy if entropy_requires_grad else entropy.detach()
        action_log_probs = log_probs[:, -width - 1 : -1]
        return (action_log_probs, output) if return_output else action_log_probs

    def _loss_call(
        self,
        sequences: torch.Tensor,
        num_actions: int | list[int],
        attention_mask: torch.Tensor,
        temperature: float,
    ) -> tuple[torch.Tensor, Any]:
        """The call within :meth:`loss_pass`: ``(action log-probs [B, A], output)`` as the
        stock forward returns them (the loss's graph at weight 0; ``output["entropy"]``
        ``[B, S]``, 0 outside the action columns), the loss in ``request.output``."""
        request, wrapper = self.request, self.wrapper
        experience = request.experience
        if request.output is not None:
            raise RuntimeError("lp_hf.skyrl: the policy ran twice in one fused loss pass")
        width = _action_count(num_actions)
        if sequences is not experience.sequences or width != experience.num_actions:
            raise RuntimeError(
                "lp_hf.skyrl: forward_backward called the policy with other sequences or "
                "num_actions than the experience's; SkyRL changed (use fused_loss=False)"
            )
        batch, seqlen = sequences.shape
        if not 0 < width < seqlen:
            raise ValueError(f"the fused loss needs 0 < num_actions < {seqlen}, got {width}")
        start = seqlen - 1 - width  # the head column that scores the first action token
        positions = attention_mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(attention_mask == 0, 1)
        packing = bool(wrapper.use_sample_packing)
        if packing:
            from skyrl_train import model_wrapper

            with torch.no_grad():
                ids, indices, *_ = model_wrapper.unpad_input(sequences[..., None], attention_mask)
                positions, *_ = model_wrapper.unpad_input(positions[..., None], attention_mask)
            ids, positions, mask, keep = ids.transpose(0, 1), positions.transpose(0, 1), None, 0

            def layout(x: torch.Tensor) -> torch.Tensor:  # [B, A] -> the packed head rows
                full = x.new_zeros(batch, seqlen)
                full[:, start : seqlen - 1] = x
                return full.reshape(-1)[indices].unsqueeze(0)

        else:
            ids, mask, keep = sequences, attention_mask, width + 1  # the action columns, and one
            layout = lambda x: torch.nn.functional.pad(x, (0, 1))
        per_token = token_inputs(experience, request.config)
        targets = torch.roll(ids, shifts=-1, dims=1)[:, -keep:]  # keep 0 (packed): every row
        live = layout(torch.ones_like(per_token["advantages"])) != 0
        request.output, output = loss_forward(
            wrapper.model, self.options, ids, targets.masked_fill(~live, _IGNORE), request.loss_fn,
            {name: layout(value) for name, value in per_token.items()}, temperature,
            return_entropy=True, attention_mask=mask, position_ids=positions,
            logits_to_keep=keep,
        )  # fmt: skip
        log_probs, entropy = request.output.logprob, request.output.entropy
        if packing:
            log_probs, entropy = (
                model_wrapper.pad_input(f.transpose(0, 1), indices, batch, seqlen).squeeze(-1)
                for f in (log_probs, entropy)
            )
        else:
            full = entropy.new_zeros(batch, seqlen)
            full[:, start:] = entropy
            log_probs, entropy = log_probs[:, :width], full * attention_mask
        request.log_probs = log_probs[:, -width - 1 : -1] if packing else log_probs
        output["entropy"] = entropy
        return request.log_probs, output


_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")
_LOG_RATIO_CLAMP = 20.0  # ppo_policy_loss and its TIS ratio clamp the log-ratio to +-20


@dataclass(frozen=True)
class SkyrlTokenLoss:
    """SkyRL's policy loss per token, a ``loss_fn`` of ``linear_logprob_loss``:

    ``policy_weight * is_coef * surrogate - entropy_weight * entropy_coef * H``

    with ``surrogate`` :func:`lp_kernels.losses.clipped_surrogate` (``eps_clip_low``,
    ``eps_clip_high``, the dual clip ``clip_ratio_c``, the log-ratio clamped to 20 as
    ``ppo_policy_loss`` does), ``is_coef`` the truncated importance-sampling ratio (None:
    1) and ``H`` the entropy. The weights carry the aggregations (:func:`token_inputs`).

    Example:
        >>> fn = SkyrlTokenLoss(0.2, 0.2)
        >>> one = torch.ones(2)
        >>> fn(torch.zeros(2), None, None, old_logprob=torch.zeros(2), advantages=one,
        ...    policy_weight=one / 2, entropy_weight=one / 2).tolist()
        [-0.5, -0.5]
    """

    clip_low: float
    """``algorithm.eps_clip_low``."""
    clip_high: float
    """``algorithm.eps_clip_high``."""
    dual_clip: float | None = None
    """``algorithm.clip_ratio_c`` with ``policy_loss_type="dual_clip"``, else None."""
    entropy_coef: float = 0.0
    """``algorithm.entropy_loss_coef`` with ``use_entropy_loss``, else 0."""

    @property
    def needs_entropy(self) -> bool:
        """Whether the op must compute the entropy (``entropy_coef != 0``)."""
        return self.entropy_coef != 0

    def __call__(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        lse: torch.Tensor | None,
        *,
        old_logprob: torch.Tensor,
        advantages: torch.Tensor,
        policy_weight: torch.Tensor,
        entropy_weight: torch.Tensor,
        is_coef: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss ``[n]``; every argument ``[n]`` fp32."""
        clip = (self.clip_low, self.clip_high, self.dual_clip)
        loss = clipped_surrogate(
            logprob, old_logprob, advantages, *clip, max_log_ratio=_LOG_RATIO_CLAMP
        )
        if is_coef is not None:
            loss = is_coef * loss
        loss = policy_weight * loss
        if self.entropy_coef != 0:
            loss = loss - entropy_weight * (self.entropy_coef * entropy)
        return loss


def reduction_weights(mask: torch.Tensor, reduction: str, max_seq_len: int | None) -> torch.Tensor:
    """``[B, A]`` fp32 weights ``w`` with ``sum(w * x) = reduce_loss(x, mask, reduction,
    max_seq_len)`` (skyrl-train 0.3) for any per-token ``x``: the token mean, the mean over
    all ``B`` rows of each row's token mean, or each row's sum over ``max_seq_len`` averaged
    over ``B``."""
    m = mask.float()
    if reduction == "token_mean":
        return m / m.sum().clamp(min=1.0)
    if reduction == "sequence_mean":
        return m / (m.shape[0] * m.sum(dim=-1, keepdim=True).clamp(min=1.0))
    if reduction == "seq_mean_token_sum_norm":
        return m / (max_seq_len * m.shape[0])
    raise ValueError(f"loss_reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def token_inputs(experience: Any, config: Any) -> dict[str, torch.Tensor]:
    """The per-token inputs ``[B, A]`` of :class:`SkyrlTokenLoss` for one micro-batch: the
    experience's old log-probs and advantages, ``ppo_policy_loss``'s aggregation weights,
    the masked mean that ``forward_backward`` takes of the entropy (``entropy * attention
    mask`` over the loss mask), and with ``use_tis`` the truncated ratio
    ``min(exp(clamp(old - rollout, +-20)), tis_imp_ratio_cap)``."""
    advantages = experience.advantages.float()
    width = advantages.shape[-1]
    mask = experience.loss_mask
    mask = torch.ones_like(advantages) if mask is None else mask.float()
    attention = experience.attention_mask[:, -width - 1 : -1].float()
    out = {
        "old_logprob": experience.action_log_probs.float(),
        "advantages": advantages,
        "policy_weight": reduction_weights(mask, config.loss_reduction, config.max_seq_len),
        "entropy_weight": mask * attention / mask.sum().clamp(min=1.0),
    }
    if config.use_tis:
        if experience.rollout_logprobs is None:
            raise ValueError("use_tis needs the experience's rollout_logprobs")
        delta = (experience.action_log_probs - experience.rollout_logprobs).float()
        ratio = delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
        out["is_coef"] = ratio.clamp(max=config.tis_imp_ratio_cap)
    return out


@dataclass
class LossPass:
    """One fused loss pass of an adapted wrapper (see the module docstring).

    Attributes:
        loss_fn: the per-token loss (:class:`SkyrlTokenLoss`).
        experience: the micro-batch's ``Experience`` (read at the wrapper's call, after
            ``forward_backward`` moved it to the device).
        config: ``cfg.trainer.algorithm``.
        output: ``linear_logprob_loss``'s result, once the wrapper has run.
        log_probs: ``[B, A]`` the action log-probs the wrapper returned (their gradient is 0).
        used: the worker's ``policy_loss_fn`` has taken ``output``'s gradient.
    """

    loss_fn: SkyrlTokenLoss
    experience: Any
    config: Any
    output: LossOutput | None = field(default=None)
    log_probs: torch.Tensor | None = field(default=None)
    used: bool = False


_WORKER_MODULE = "skyrl_train.workers.worker"
_PPO_UTILS = "skyrl_train.utils.ppo_utils"
_SEAM_DIGEST = "8581be954971d3de"
"""Digest of the identifiers and float constants of skyrl-train 0.3.1's
``PolicyWorkerBase.forward_backward``, ``ppo_policy_loss``, ``_safe_exp_delta``,
``reduce_loss``, ``masked_mean`` and ``compute_approx_kl``: the code whose loss
:class:`FusedPolicyLoss` reproduces."""


def check_fused_options(worker: Any) -> None:
    """Raise ``ValueError`` naming each option of a policy worker whose loss
    ``use_lp(worker, fused_loss=True)`` does not reproduce (see :func:`use_lp`)."""
    config = worker.cfg.trainer.algorithm
    loss_fn = worker.policy_loss_fn
    loss_fn = loss_fn.policy_loss_fn if isinstance(loss_fn, FusedPolicyLoss) else loss_fn
    ppo = inspect.unwrap(sys.modules[_PPO_UTILS].ppo_policy_loss)
    refused = []
    if config.policy_loss_type not in ("regular", "dual_clip"):
        refused.append(f"policy_loss_type={config.policy_loss_type!r}")
    elif inspect.unwrap(loss_fn) is not ppo:
        refused.append("a policy_loss_fn other than SkyRL's ppo_policy_loss")
    if config.loss_reduction not in _REDUCTIONS:
        refused.append(f"loss_reduction={config.loss_reduction!r}")
    elif config.loss_reduction == "seq_mean_token_sum_norm" and not config.max_seq_len:
        refused.append(f"max_seq_len={config.max_seq_len!r} (seq_mean_token_sum_norm)")
    if not 0 <= config.eps_clip_low < 1 or not config.eps_clip_high >= 0:
        refused.append(
            f"eps_clip_low={config.eps_clip_low}, eps_clip_high={config.eps_clip_high} "
            "(need 0 <= eps_clip_low < 1, eps_clip_high >= 0)"
        )
    if config.policy_loss_type == "dual_clip" and not config.clip_ratio_c > 1:
        refused.append(f"clip_ratio_c={config.clip_ratio_c} (need > 1)")
    if refused:
        raise ValueError(
            f"use_lp(worker, fused_loss=True) does not reproduce SkyRL's policy loss with "
            f"{'; '.join(refused)}; use fused_loss=False (SkyRL's loss on lp's log-probs)"
        )


class FusedPolicyLoss:
    """A policy worker's loss computed in the wrapper's head pass: its ``forward_backward``
    (bound as an instance attribute) and its ``policy_loss_fn`` (this object, called as
    ``ppo_policy_loss`` is). See the module docstring.

    Attributes:
        worker: the policy worker.
        policy_loss_fn: the worker's own ``policy_loss_fn`` (its values and clip ratio).
        forward: the adapted wrapper's forward.
        worker_class: SkyRL's ``PolicyWorkerBase`` (whose ``forward_backward`` runs).
    """

    def __init__(
        self, worker: Any, policy_loss_fn: Callable[..., Any], forward: _LpForward, cls: type
    ) -> None:
        self.worker = worker
        self.policy_loss_fn = policy_loss_fn
        self.forward = forward
        self.worker_class = cls
        self.pending: LossPass | None = None

    def forward_backward(self, experience: Any, accumulation_steps: int) -> dict:
        """``PolicyWorkerBase.forward_backward`` with the fused loss; its result."""
        worker = self.worker
        check_fused_options(worker)
        config = worker.cfg.trainer.algorithm
        entropy_coef = float(config.entropy_loss_coef) if config.use_entropy_loss else 0.0
        dual = float(config.clip_ratio_c) if config.policy_loss_type == "dual_clip" else None
        loss_fn = SkyrlTokenLoss(
            float(config.eps_clip_low), float(config.eps_clip_high), dual, entropy_coef
        )
        request = LossPass(loss_fn, experience, config)
        with self.forward.loss_pass(request):
            self.pending = request
            try:
                status = self.worker_class.forward_backward(worker, experience, accumulation_steps)
            finally:
                self.pending = None
        if not request.used:
            raise RuntimeError(
                "lp_hf.skyrl: forward_backward did not pass the policy's log-probs to "
                "policy_loss_fn; SkyRL changed (use fused_loss=False)"
            )
        return status

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        config: Any,
        loss_mask: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> tuple:
        """``ppo_policy_loss``'s result; within :meth:`forward_backward` its loss also carries
        the fused loss's gradient (``+ fused - fused.detach()``, its value unchanged)."""
        result = self.policy_loss_fn(
            log_probs, old_log_probs, advantages, config=config, loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
        )  # fmt: skip
        request = self.pending
        if request is None:  # outside a fused step: the stock loss
            return result
        if request.used or request.output is None or log_probs is not request.log_probs:
            raise RuntimeError(
                "lp_hf.skyrl: policy_loss_fn got other log-probs than the policy's fused "
                "pass returned, or was called twice; SkyRL changed (use fused_loss=False)"
            )
        request.used = True
        fused = request.output.loss
        return (result[0] + (fused - fused.detach()), *result[1:])


def seam_digest() -> str:
    """The digest of the installed SkyRL code that the fused loss reproduces (see
    ``_SEAM_DIGEST``); needs ``skyrl_train.workers.worker`` imported."""
    worker, ppo = sys.modules[_WORKER_MODULE], sys.modules[_PPO_UTILS]
    functions = (
        worker.PolicyWorkerBase.forward_backward,
        ppo.ppo_policy_loss,
        ppo._safe_exp_delta,
        ppo.reduce_loss,
        ppo.masked_mean,
        worker.compute_approx_kl,
    )
    return code_digest(*functions)


def _worker_seam(worker: Any) -> type:
    """SkyRL's ``PolicyWorkerBase``, after checking that ``worker`` runs skyrl-train 0.3.1's
    own ``forward_backward`` and loss code as lp-hf read them."""
    cls = sys.modules[_WORKER_MODULE].PolicyWorkerBase
    name = type(worker).__name__
    if type(worker).forward_backward is not cls.forward_backward:
        raise TypeError(
            f"{name} overrides PolicyWorkerBase.forward_backward; fused_loss reproduces it"
        )
    if "forward_backward" in worker.__dict__:
        raise RuntimeError(f"{name}: forward_backward is already replaced by an instance attribute")
    digest = seam_digest()
    if digest != _SEAM_DIGEST:
        raise RuntimeError(
            "SkyRL's PolicyWorkerBase.forward_backward / ppo_policy_loss are not the ones lp-hf "
            f"has read (0.3.1: digest {_SEAM_DIGEST}, got {digest}); use fused_loss=False"
        )
    probe = torch.zeros(1, requires_grad=True)
    if sys.modules[_WORKER_MODULE].compute_approx_kl(probe, torch.zeros(1)).requires_grad:
        raise RuntimeError(
            "SkyRL's compute_approx_kl carries a gradient here (0.3.1's does not); use "
            "fused_loss=False"
        )
    return cls


def _worker_class() -> type | None:
    """``PolicyWorkerBase`` if its module is imported (a worker exists only then), else None."""
    return getattr(sys.modules.get(_WORKER_MODULE), "PolicyWorkerBase", None)


def _policy_wrapper(worker: Any) -> Any:
    """The ``HFModelWrapper`` a policy worker calls: ``worker.model`` or its ``.module``."""
    model = worker.model
    return model if hasattr(model, "use_sample_packing") else getattr(model, "module", model)


def use_lp(
    target: Any,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
    fused_loss: bool = False,
) -> Any:
    """Make a SkyRL ``HFModelWrapper``'s forward compute its log-probs and entropy with lp.

    After the call, ``wrapper(sequences, num_actions, attention_mask, temperature=...,
    return_output=..., compute_entropy=..., entropy_requires_grad=...)`` returns what
    ``HFModelWrapper.forward`` returns (shapes, slicing, temperature, masks, sample packing),
    computed by lp-hf's head (:func:`lp_hf.install_logprob_head`) inside ``wrapper.model``'s
    forward instead of from materialized logits, in float32; ``output`` has no ``logits``.
    Call it after building the wrapper, before or after FSDP wraps it (FSDP calls this
    same module's forward; with FSDP1 pass the wrapped module, ``fsdp_model.module``).

    Given a policy worker (``skyrl_train.workers.worker.PolicyWorkerBase``, e.g. the FSDP
    policy worker after ``init_model``), it adapts ``worker.model``. With
    ``fused_loss=True`` (a worker only) each ``forward_backward`` also computes the policy
    loss in the head pass by ``lp_kernels.linear_logprob_loss`` (three GEMMs where the
    stock step takes four; see the module docstring): the loss value and metrics are
    SkyRL's own on lp's log-probs, the gradients those of the same loss within fp32
    rounding. Covered: ``policy_loss_type`` regular and dual_clip (``clip_ratio_c``),
    ``eps_clip_low`` / ``eps_clip_high``, every ``loss_reduction`` (token_mean,
    sequence_mean, seq_mean_token_sum_norm), ``use_tis`` with ``tis_imp_ratio_cap``,
    ``use_entropy_loss`` with ``entropy_loss_coef``, ``use_kl_loss`` (any estimator:
    SkyRL's KL term has no gradient), sample packing. Within the step the wrapper's
    ``output["entropy"]`` is the action columns' (0 elsewhere: the worker reads those
    only), detached. Outside ``forward_backward`` the wrapper and ``policy_loss_fn``
    behave as without it.

    Args:
        target: a ``skyrl_train.model_wrapper.HFModelWrapper`` (skyrl-train 0.3.x) of a
            text causal LM, ``sequence_parallel_size`` 1; or a policy worker whose
            ``model`` is one (or wraps one as ``.module``).
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).
        fused_loss: compute a policy worker's loss in the head pass (above).

    Returns:
        ``target`` itself. :func:`remove_lp` undoes it.

    Raises:
        RuntimeError: another skyrl-train version, or a forward of other arguments; with
            ``fused_loss``, a ``forward_backward`` or loss code that is not 0.3.1's.
        TypeError: not an ``HFModelWrapper`` (or a worker with one), or a subclass with its
            own forward; ``fused_loss`` without the worker, or a worker class with its own
            ``forward_backward`` (the Megatron worker).
        NotImplementedError: ``sequence_parallel_size > 1``.
        ValueError: already adapted with other options; a model lp-hf refuses
            (:func:`lp_hf.install_logprob_head`'s errors); ``fused_loss`` with an option it
            does not reproduce (:func:`check_fused_options`: ``policy_loss_type`` gspo,
            sapo, clip_cov, kl_cov or a custom loss; another ``loss_reduction``; clip bounds
            outside ``0 <= eps_clip_low < 1``, ``eps_clip_high >= 0``; ``clip_ratio_c <= 1``).

    Example:
        >>> policy = lp_hf.skyrl.use_lp(HFModelWrapper(model_path, ...))  # doctest: +SKIP
        >>> log_probs, output = policy(  # doctest: +SKIP
        ...     sequences, num_actions, attention_mask, return_output=True, compute_entropy=True)
        >>> lp_hf.skyrl.use_lp(policy_worker, fused_loss=True)  # doctest: +SKIP
    """
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {fused_loss!r}")
    worker_cls = _worker_class()
    worker = target if worker_cls is not None and isinstance(target, worker_cls) else None
    wrapper = target if worker is None else _policy_wrapper(worker)
    if fused_loss and worker is None:
        raise TypeError(
            "use_lp(fused_loss=True) takes the policy worker (its policy_loss_fn and "
            "cfg.trainer.algorithm are the loss's), not the HFModelWrapper"
        )
    wrapper_cls = _wrapper_class()
    what = "a skyrl_train HFModelWrapper"
    check_class("lp_hf.skyrl", wrapper, wrapper_cls, what, "an FSDP1 module: pass its .module")
    _check_parallel(wrapper)
    options = HeadOptions(deterministic, backend, chunk_size, validate)
    if fused_loss and isinstance(worker.policy_loss_fn, FusedPolicyLoss):
        set_forward(wrapper, wrapper.model, _LpForward, options, "wrapper")  # same options
        return target
    cls = _worker_seam(worker) if fused_loss else None
    if fused_loss:
        check_fused_options(worker)  # every check before any change
    set_forward(wrapper, wrapper.model, _LpForward, options, "wrapper")
    if cls is not None:
        fused = FusedPolicyLoss(worker, worker.policy_loss_fn, wrapper.__dict__["forward"], cls)
        worker.forward_backward = fused.forward_backward
        worker.policy_loss_fn = fused
    return target


def remove_lp(target: Any) -> Any:
    """Undo :func:`use_lp` on a wrapper or a policy worker (idempotent): the wrapper's class
    forward, the worker's own ``forward_backward`` and ``policy_loss_fn``."""
    worker_cls = _worker_class()
    if worker_cls is not None and isinstance(target, worker_cls):
        fused = target.policy_loss_fn
        if isinstance(fused, FusedPolicyLoss):
            target.policy_loss_fn = fused.policy_loss_fn
            target.__dict__.pop("forward_backward", None)
        remove_forward(_policy_wrapper(target), _LpForward)
        return target
    return remove_forward(target, _LpForward)
