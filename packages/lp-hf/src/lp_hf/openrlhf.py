"""lp for OpenRLHF's ``Actor``: action log-probs and entropy without ``[B, T, V]`` logits.

``use_lp(actor)`` gives one ``openrlhf.models.Actor`` (OpenRLHF 0.11.x) an instance
``forward`` with the signature and the results of the class's own, computed by lp-hf's head::

    actor(sequences [B, T], action_mask [B, A], attention_mask [B, T], ...)
      packing_samples: OpenRLHF's own unpad (and ring-attention slice) -> [1, N] tokens,
                       position ids restarting per sequence, targets = the rolled ids
      else:            position_ids = cumsum(attention_mask) - 1 (1 at padding),
                       targets[:, t] = sequences[:, t + 1]  (the last column scores nothing)
      install_logprob_head(actor.model) for this call only (removed in a finally)
        head.logprobs(..., shift_labels=targets, temperature=actor.temperature,
                      return_entropy=return_entropy, logits_to_keep=A + 1 when only the
                      action columns are asked for)
      packing_samples: OpenRLHF's own gather (ring attention) and re-pad -> [B, T]
      log_probs [:, :-1] -> the last A columns * action_mask

The conventions are the stock forward's: log-probs and entropy of ``logits / temperature``
at every position (padding included: ``action_mask`` or the caller's loss mask removes it),
the entropy over all ``T - 1`` columns, ``return_output`` giving the model's own output
(``aux_loss`` and the other fields; ``.logits`` is None, it is never built) with
``.entropy`` set. A call that asks for no log-probs (``action_mask`` None and
``return_logprobs`` False) asks for the logits themselves: it runs the class's own forward.

The head is installed around each call, so outside it ``actor.model`` is the stock model
(generation, ``state_dict``, DeepSpeed's module hooks, which all-gather ZeRO-3 parameters
when ``lm_head`` is called, as they do for the stock forward).

The fused loss, ``use_lp(trainer, fused_loss=True)`` on an ``ActorPPOTrainer``
(``openrlhf.trainer.ray.ppo_actor``). Its ``training_step`` calls the actor, then its
``PolicyLoss`` (``actor_loss_fn``), adds ``kl_ctl`` times the aggregated
``compute_approx_kl`` and minus ``entropy_coef`` times the aggregated entropy, and
backpropagates. Every term is a per-token function of the action log-probs and entropy
aggregated linearly, so their sum is one ``linear_logprob_loss`` (:class:`PpoTokenLoss`,
weights from the step's ``loss_batch_info``; three GEMMs where the stock step takes four)::

    trainer.training_step(experience, kl_ctl, step, loss_batch_info)   (instance attribute)
      loss_batch_info: OpenRLHF's get_loss_batch_info when None (computed once, passed on)
      PpoTokenLoss, per-token tensors [B, A] <- experience, kl_ctl, loss_batch_info
      ActorPPOTrainer.training_step (OpenRLHF's own code), with the request on the actor:
        actor(...)     -> linear_logprob_loss in the output layer's forward (rows outside
                          action_mask ignored); log-probs and entropy returned detached
        actor_loss_fn  -> OpenRLHF's PolicyLoss on the detached log-probs (its value and
                          metrics) + (fused - fused.detach()): the gradient of every term
        its KL and entropy terms, on detached values: the trainer's values, no gradient
        strategy.backward(loss) -> the fused gradients, times DeepSpeed's scale

So the loss value and every metric are OpenRLHF's own operations on lp's log-probs, and
the gradients are those of the fused loss, the same sum within fp32 rounding.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
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
    "FusedActorLoss",
    "PpoTokenLoss",
    "check_fused_options",
    "remove_lp",
    "use_lp",
]

SUPPORTED_VERSIONS = "0.11"
"""The OpenRLHF release series whose ``Actor.forward`` this module was written against."""

_PARAMETERS = (
    "self",
    "sequences",
    "action_mask",
    "attention_mask",
    "return_output",
    "allgather_logits",
    "return_logprobs",
    "ring_attn_group",
    "packed_seq_lens",
    "return_entropy",
    "mm_inputs",
)
_IGNORE = -100


def openrlhf_version() -> str:
    """The installed OpenRLHF version (``importlib.metadata``)."""
    return importlib.metadata.version("openrlhf")


def _actor_class() -> type:
    version = openrlhf_version()
    check_series("lp_hf.openrlhf", "openrlhf", version, SUPPORTED_VERSIONS, "Actor.forward")
    from openrlhf.models.actor import Actor

    what = f"openrlhf {version}'s Actor.forward"
    check_parameters("lp_hf.openrlhf", what, Actor.forward, _PARAMETERS)
    return Actor


class _LpForward(LossPasses):
    """The adapted actor's ``forward`` (an instance attribute; see the module docstring)."""

    def __init__(self, actor: torch.nn.Module, options: HeadOptions):
        self.actor = actor
        self.options = options
        self.request: LossPass | None = None

    def __call__(
        self,
        sequences: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        allgather_logits: bool = False,
        return_logprobs: bool = False,
        ring_attn_group: Any = None,
        packed_seq_lens: list[int] | None = None,
        return_entropy: bool = False,
        **mm_inputs: Any,
    ) -> Any:
        actor = self.actor
        if self.request is not None:
            if ring_attn_group is not None:
                raise NotImplementedError("lp_hf.openrlhf: the fused loss with ring attention")
            if mm_inputs:
                raise NotImplementedError(
                    f"lp_hf.openrlhf: the fused loss with {sorted(mm_inputs)}"
                )
            return self._loss_call(sequences, action_mask, attention_mask, return_entropy)
        if action_mask is None and not return_logprobs:  # the logits are the result asked for
            return type(actor).forward(
                actor,
                sequences,
                attention_mask=attention_mask,
                return_output=return_output,
                allgather_logits=allgather_logits,
                ring_attn_group=ring_attn_group,
                packed_seq_lens=packed_seq_lens,
                return_entropy=return_entropy,
                **mm_inputs,
            )
        if mm_inputs:
            raise NotImplementedError(
                f"lp_hf.openrlhf: multimodal inputs {sorted(mm_inputs)} are not supported; "
                "call lp_hf.openrlhf.remove_lp(actor) for a vision-language actor"
            )
        if return_entropy and not return_output:
            raise ValueError("Actor.forward: return_entropy=True needs return_output=True")
        if attention_mask is None:
            raise ValueError("Actor.forward needs attention_mask for a text actor")
        packing = getattr(actor, "packing_samples", None)
        if packing is None:
            raise AttributeError(
                "this Actor has no packing_samples attribute (Actor(model) does not set it): "
                "set actor.packing_samples = True or False"
            )
        seqlen = sequences.shape[1]
        keep = 0
        if action_mask is not None and not return_entropy and not packing:
            width = action_mask.shape[1]
            keep = width + 1 if 0 < width < seqlen else 0  # only the action columns, and one
        result, output = self._logprobs(
            sequences, attention_mask, ring_attn_group, return_entropy, keep, bool(packing)
        )
        log_probs, entropy = result
        if return_entropy:
            output.entropy = entropy[:, :-1]
        log_probs = log_probs[:, :-1]
        if action_mask is not None:
            log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
        return (log_probs, output) if return_output else log_probs

    def _logprobs(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        ring_attn_group: Any,
        return_entropy: bool,
        keep: int,
        packing: bool,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], Any]:
        """``((log_probs, entropy), model_output)``, each ``[B, T]`` (or ``[B, keep]``)."""
        batch, seqlen = sequences.shape
        if packing:
            from openrlhf.models import ring_attn_utils

            ids, position_ids, targets, pad_len, indices = ring_attn_utils.unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group
            )
            mask = None
        else:
            ids, mask = sequences, attention_mask
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = position_ids.masked_fill(attention_mask == 0, 1)
            targets = torch.roll(sequences, shifts=-1, dims=1)
            targets[:, -1] = _IGNORE  # the wrapped-around id: a column the caller drops
        out, output = head_logprobs(
            self.actor.model,
            self.options,
            ids,
            self.actor.temperature,
            shift_labels=targets,
            attention_mask=mask,
            position_ids=position_ids,
            return_entropy=return_entropy,
            logits_to_keep=keep,
        )
        fields = [out.logprob, out.entropy]
        if packing:
            from openrlhf.models import ring_attn_utils

            fields = [
                (
                    None
                    if f is None
                    else ring_attn_utils.gather_and_pad_tensor(
                        f, ring_attn_group, pad_len, indices, batch, seqlen
                    )
                )
                for f in fields
            ]
        return (fields[0], fields[1]), output

    def _loss_call(
        self,
        sequences: torch.Tensor,
        action_mask: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        return_entropy: bool,
    ) -> tuple[torch.Tensor, Any]:
        """The call within :meth:`loss_pass`: ``(log_probs [B, A], output)`` as the stock
        forward returns them (detached; ``output.entropy`` ``[B, T - 1]``, 0 outside the
        action tokens), the loss in ``request.output``."""
        request = self.request
        if request.output is not None:
            raise RuntimeError("lp_hf.openrlhf: the actor ran twice in one fused loss pass")
        if sequences is not request.sequences or action_mask is not request.action_mask:
            raise RuntimeError(
                "lp_hf.openrlhf: training_step called the actor with other sequences or "
                "action_mask than the experience's; OpenRLHF changed"
            )
        packing = getattr(self.actor, "packing_samples", None)
        if packing is None or attention_mask is None:
            raise ValueError("the fused loss needs attention_mask and actor.packing_samples")
        batch, seqlen = sequences.shape
        width = action_mask.shape[1]
        start = seqlen - 1 - width  # the head column that scores the first action token

        def columns(x: torch.Tensor) -> torch.Tensor:  # [B, A] -> [B, T] head columns
            full = x.new_zeros(batch, seqlen)
            full[:, start : seqlen - 1] = x
            return full

        if packing:
            from openrlhf.models import ring_attn_utils

            ids, position_ids, targets, pad_len, indices = ring_attn_utils.unpad_and_slice_tensor(
                sequences, attention_mask, None
            )
            mask, keep = None, 0
            layout = lambda x: columns(x).reshape(-1)[indices].unsqueeze(0)
        else:
            ids, mask = sequences, attention_mask
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids = position_ids.masked_fill(attention_mask == 0, 1)
            targets = torch.roll(sequences, shifts=-1, dims=1)
            keep = width + 1 if 0 < width < seqlen else 0  # the action columns, and one
            targets = targets[:, -keep:] if keep else targets
            layout = (lambda x: torch.nn.functional.pad(x, (0, 1))) if keep else columns
        live = layout(action_mask) != 0
        request.output, output = loss_forward(
            self.actor.model,
            self.options,
            ids,
            targets.masked_fill(~live, _IGNORE),
            request.loss_fn,
            {name: layout(value) for name, value in request.per_token.items()},
            self.actor.temperature,
            return_entropy=return_entropy,
            attention_mask=mask,
            position_ids=position_ids,
            logits_to_keep=keep,
        )
        fields = [request.output.logprob, request.output.entropy]
        if packing:
            fields = [
                (
                    None
                    if f is None
                    else ring_attn_utils.gather_and_pad_tensor(
                        f, None, pad_len, indices, batch, seqlen
                    )[:, start : seqlen - 1]
                )
                for f in fields
            ]
        else:
            fields = [
                None if f is None else (f[:, :width] if keep else f[:, start:-1]) for f in fields
            ]
        request.log_probs = fields[0]
        if return_entropy:
            output.entropy = columns(fields[1])[:, :-1]
        return fields[0], output


@dataclass
class LossPass:
    """One fused loss pass of an adapted actor (see the module docstring).

    Attributes:
        loss_fn: the per-token loss (:class:`PpoTokenLoss`).
        per_token: its keyword tensors, each ``[B, A]`` over the action columns.
        sequences: ``[B, T]`` the experience's sequences (the call it answers).
        action_mask: ``[B, A]`` the experience's action mask: the rows that count.
        output: ``linear_logprob_loss``'s result, once the actor has run.
        log_probs: ``[B, A]`` the action log-probs the actor returned (detached).
        used: the trainer's ``actor_loss_fn`` has taken ``output``'s gradient.
    """

    loss_fn: Callable[..., torch.Tensor]
    per_token: dict[str, torch.Tensor]
    sequences: torch.Tensor
    action_mask: torch.Tensor
    output: LossOutput | None = field(default=None)
    log_probs: torch.Tensor | None = field(default=None)
    used: bool = False


_TRAINER_MODULE = "openrlhf.trainer.ray.ppo_actor"
_SEAM_DIGEST = "e353c5ff8c267d51"
"""Digest of the identifiers and float constants of OpenRLHF 0.11.2's
``ActorPPOTrainer.training_step``, ``PolicyLoss.forward`` and ``aggregate_loss``: the code
whose loss :class:`FusedActorLoss` reproduces."""
_LOG_RATIO_CLAMP = 20.0  # PolicyLoss clamps the log-ratio to [-20, 20] before exp ("ppo")


@dataclass(frozen=True)
class PpoTokenLoss:
    """OpenRLHF's PPO actor loss per token, a ``loss_fn`` of ``linear_logprob_loss``:

    ``policy_weight * is_coef * surrogate + token_weight * (kl_coef * kl - entropy_coef * H)``

    with ``surrogate`` :func:`lp_kernels.losses.clipped_surrogate` (``clip_low``,
    ``clip_high``, ``dual_clip``, the log-ratio clamped to 20 as ``PolicyLoss`` does), ``kl``
    OpenRLHF's own ``compute_approx_kl`` (``kl_fn``, elementwise) against ``ref_logprob``,
    ``is_coef`` the per-token importance-sampling coefficient (None: 1), ``H`` the entropy.
    The weights carry the two aggregations (``PolicyLoss``'s, and the token mean of the
    KL and entropy terms). Differentiated by autograd block by block.

    Example:
        >>> fn = PpoTokenLoss(0.2, 0.28)
        >>> one = torch.ones(2)
        >>> fn(torch.zeros(2), None, None, old_logprob=torch.zeros(2), advantages=one,
        ...    policy_weight=one / 2, token_weight=one / 2).tolist()
        [-0.5, -0.5]
    """

    clip_low: float
    """``PolicyLoss.clip_eps_low``."""
    clip_high: float
    """``PolicyLoss.clip_eps_high``."""
    dual_clip: float | None = None
    """``PolicyLoss.dual_clip``: None or ``c > 1``, the bound for ``A < 0``."""
    kl_coef: float = 0.0
    """The step's ``kl_ctl`` when the KL is in the loss (``algo.kl.use_loss``), else 0."""
    kl_estimator: str = "k1"
    """``algo.kl.estimator``, passed to ``kl_fn``."""
    kl_unbiased_gradient: bool = False
    """``algo.kl.unbiased_gradient``, passed to ``kl_fn``."""
    kl_fn: Callable[..., torch.Tensor] | None = None
    """OpenRLHF's ``compute_approx_kl``; needed when ``kl_coef != 0``."""
    entropy_coef: float = 0.0
    """``actor.entropy_coef`` (None there: 0)."""

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
        token_weight: torch.Tensor,
        ref_logprob: torch.Tensor | None = None,
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
        if self.kl_coef != 0:
            kl = self.kl_fn(
                logprob,
                ref_logprob,
                log_probs_old=old_logprob,
                kl_estimator=self.kl_estimator,
                unbiased_gradient=self.kl_unbiased_gradient,
            )
            loss = loss + token_weight * (self.kl_coef * kl)
        if self.entropy_coef != 0:
            loss = loss - token_weight * (self.entropy_coef * entropy)
        return loss


def aggregation_weights(mask: torch.Tensor, token_level: bool, info: dict) -> torch.Tensor:
    """``[B, A]`` fp32 weights ``w`` with ``sum(w * x) = aggregate_loss(x, mask,
    token_level_loss=token_level, **info)`` for any per-token ``x`` (OpenRLHF's token mean
    over ``batch_num_tokens``, or mean of sequence means over ``global_batch_size``, times
    ``dp_size``; without them, the batch's own masked means)."""
    m = mask.float()
    dp = info.get("dp_size", 1)
    if token_level:
        total = info.get("batch_num_tokens")
        return m / m.sum() if total is None else m * dp / total
    counts = mask.sum(dim=-1)
    live = (counts > 0).float()
    per_sequence = live / (counts + 1e-8)  # aggregate_loss's sequence mean, its epsilon
    total = info.get("global_batch_size")
    per_sequence = per_sequence / live.sum() if total is None else per_sequence * dp / total
    return m * per_sequence.unsqueeze(-1)


def is_coefficient(
    policy_loss: Any,
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    masked_mean: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``[B, A]`` the constant that ``PolicyLoss`` (``is_correction_level`` token or seq)
    multiplies each token's surrogate by: the train/rollout statistic (the ratio, or the
    sampled token's binary KL or TV distance; per token or its sequence mean) gates the
    token's ratio ``exp(old - rollout)`` (mode ``mask``) or is clamped (mode ``clip``)."""
    low, high = policy_loss.is_correction_threshold
    per_sequence = policy_loss.is_correction_level == "seq"
    log_ratio = (old - rollout).detach()
    token_ratio = log_ratio.exp()
    if policy_loss.is_correction_gating == "ratio":
        stat = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1) if per_sequence else log_ratio
        stat = stat.exp()
    else:
        p = rollout.exp().clamp(1e-6, 1 - 1e-6)
        q = old.exp().clamp(1e-6, 1 - 1e-6)
        if policy_loss.is_correction_gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        if per_sequence:
            stat = masked_mean(stat, mask, dim=-1).unsqueeze(-1)
    if policy_loss.is_correction_mode == "clip":
        return stat.clamp(min=low, max=high).expand_as(old)
    return torch.where((stat >= low) & (stat <= high), token_ratio, 0.0)


def check_fused_options(trainer: Any) -> None:
    """Raise ``ValueError`` naming each option of an ``ActorPPOTrainer`` whose loss
    ``use_lp(trainer, fused_loss=True)`` does not reproduce (see :func:`use_lp`)."""
    loss = trainer.actor_loss_fn
    loss = loss.policy_loss if isinstance(loss, FusedActorLoss) else loss
    kl = trainer.args.algo.kl
    refused = []
    if loss.policy_loss_type != "ppo":
        refused.append(f"policy_loss_type={loss.policy_loss_type!r} (its ratio is per sequence)")
    if not (loss.clip_eps_low >= 0 and loss.clip_eps_high >= 0):
        refused.append(f"eps_clip_low_high=({loss.clip_eps_low}, {loss.clip_eps_high}) (need >= 0)")
    if kl.use_loss and kl.init_coef > 0 and kl.estimator not in ("k1", "k2", "k3"):
        refused.append(f"algo.kl.estimator={kl.estimator!r}")
    if getattr(trainer.strategy, "ring_attn_group", None) is not None:
        refused.append("ring attention (ds.ring_attn_size > 1)")
    if getattr(trainer.args.ds, "zero_stage", 0) == 3:  # lm_head is not re-gathered for
        refused.append("DeepSpeed ZeRO-3 (ds.zero_stage=3; not verified)")  # the backward
    if getattr(trainer.actor, "is_vlm", False):
        refused.append("a vision-language actor")
    if refused:
        raise ValueError(
            f"use_lp(trainer, fused_loss=True) does not reproduce OpenRLHF's actor loss with "
            f"{'; '.join(refused)}; use fused_loss=False (OpenRLHF's loss on lp's log-probs)"
        )


class FusedActorLoss:
    """An ``ActorPPOTrainer``'s actor loss computed in the actor's head pass: its
    ``training_step`` (bound as an instance attribute) and its ``actor_loss_fn`` (this
    object, called as ``PolicyLoss`` is). See the module docstring.

    Attributes:
        trainer: the ``ActorPPOTrainer``.
        policy_loss: the trainer's own ``PolicyLoss`` (its options; its values and metrics).
        forward: the adapted actor's forward.
        namespace: the trainer's module (``compute_approx_kl``, ``masked_mean``,
            ``get_loss_batch_info``: the functions its ``training_step`` calls).
    """

    def __init__(
        self, trainer: Any, policy_loss: Any, forward: _LpForward, namespace: types.ModuleType
    ) -> None:
        self.trainer = trainer
        self.policy_loss = policy_loss
        self.forward = forward
        self.namespace = namespace
        self.pending: LossPass | None = None

    def training_step(
        self, experience: Any, kl_ctl: float, step: int, loss_batch_info: dict | None = None
    ) -> dict:
        """``ActorPPOTrainer.training_step`` with the fused loss; its result."""
        trainer = self.trainer
        check_fused_options(trainer)
        if loss_batch_info is None:  # what training_step computes, computed once and passed
            loss_batch_info = self.namespace.get_loss_batch_info(
                trainer.strategy,
                experience.action_mask,
                replay_buffer=trainer.replay_buffer,
                step=step,
                dynamic_batch=trainer.args.train.dynamic_batch_enable,
            )
        request = self.request(experience, kl_ctl, loss_batch_info)
        with self.forward.loss_pass(request):
            self.pending = request
            try:
                status = type(trainer).training_step(
                    trainer, experience, kl_ctl, step, loss_batch_info
                )
            finally:
                self.pending = None
        if not request.used:
            raise RuntimeError(
                "lp_hf.openrlhf: training_step did not pass the actor's log-probs to "
                "actor_loss_fn; OpenRLHF changed (use fused_loss=False)"
            )
        return status

    def request(self, experience: Any, kl_ctl: float, info: dict) -> LossPass:
        """The :class:`LossPass` of one micro-batch: the per-token loss and its inputs."""
        args, policy = self.trainer.args, self.policy_loss
        mask = experience.action_mask
        kl = args.algo.kl
        entropy_coef = args.actor.entropy_coef
        loss_fn = PpoTokenLoss(
            policy.clip_eps_low,
            policy.clip_eps_high,
            policy.dual_clip,
            kl_coef=float(kl_ctl) if kl.use_loss and kl.init_coef > 0 else 0.0,
            kl_estimator=kl.estimator,
            kl_unbiased_gradient=bool(kl.unbiased_gradient),
            kl_fn=self.namespace.compute_approx_kl,
            entropy_coef=float(entropy_coef or 0.0),
        )
        old = experience.action_log_probs.float()
        per_token = {
            "old_logprob": old,
            "advantages": experience.advantages.float(),
            "policy_weight": aggregation_weights(mask, policy.token_level_loss, info),
            "token_weight": aggregation_weights(mask, True, info),
        }
        if loss_fn.kl_coef != 0:
            per_token["ref_logprob"] = experience.base_action_log_probs.float()
        if policy.is_correction_level != "off":
            rollout = experience.rollout_log_probs.float()
            masked_mean = self.namespace.masked_mean
            per_token["is_coef"] = is_coefficient(policy, old, rollout, mask, masked_mean)
        return LossPass(loss_fn, per_token, experience.sequences, mask)

    def __call__(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        **loss_batch_info: Any,
    ) -> tuple:
        """``PolicyLoss``'s result; within :meth:`training_step` its loss also carries the
        fused loss's gradient (``+ fused - fused.detach()``, its value unchanged)."""
        kwargs = {"action_mask": action_mask, "rollout_log_probs": rollout_log_probs}
        result = self.policy_loss(log_probs, old_log_probs, advantages, **kwargs, **loss_batch_info)
        request = self.pending
        if request is None:  # outside a fused training step: the stock loss
            return result
        if request.used or request.output is None or log_probs is not request.log_probs:
            raise RuntimeError(
                "lp_hf.openrlhf: actor_loss_fn got other log-probs than the actor's fused "
                "pass returned, or was called twice; OpenRLHF changed (use fused_loss=False)"
            )
        request.used = True
        fused = request.output.loss
        return (result[0] + (fused - fused.detach()), *result[1:])


def _trainer_seam(trainer: Any) -> types.ModuleType:
    """The trainer's module, after checking that ``trainer`` is an ``ActorPPOTrainer`` running
    OpenRLHF 0.11.2's own ``training_step`` and ``PolicyLoss`` as lp-hf read them."""
    module = sys.modules[_TRAINER_MODULE]
    cls = module.ActorPPOTrainer
    name = type(trainer).__name__
    if type(trainer).training_step is not cls.training_step:
        raise TypeError(f"{name} overrides ActorPPOTrainer.training_step; fused_loss reproduces it")
    if "training_step" in trainer.__dict__:
        raise RuntimeError(f"{name}: training_step is already replaced by an instance attribute")
    if type(trainer.actor_loss_fn) is not module.PolicyLoss:
        raise TypeError(f"{name}.actor_loss_fn is not OpenRLHF's PolicyLoss")
    digest = code_digest(cls.training_step, module.PolicyLoss.forward, module.aggregate_loss)
    helpers = ("compute_approx_kl", "masked_mean", "get_loss_batch_info")
    if digest != _SEAM_DIGEST or not all(callable(getattr(module, h, None)) for h in helpers):
        raise RuntimeError(
            "OpenRLHF's ActorPPOTrainer.training_step / PolicyLoss are not the ones lp-hf has "
            f"read (0.11.2: digest {_SEAM_DIGEST}, got {digest}); use fused_loss=False"
        )
    return module


def _trainer_class() -> type | None:
    """``ActorPPOTrainer`` if its module is imported (a trainer exists only then), else None."""
    return getattr(sys.modules.get(_TRAINER_MODULE), "ActorPPOTrainer", None)


def use_lp(
    target: Any,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
    fused_loss: bool = False,
) -> Any:
    """Make an OpenRLHF ``Actor``'s forward compute its log-probs and entropy with lp.

    After the call, ``actor(sequences, action_mask, attention_mask, return_output=...,
    return_logprobs=..., return_entropy=..., ring_attn_group=..., packed_seq_lens=...)``
    returns what ``Actor.forward`` returns (the same shapes, conventions and temperature,
    packed samples included), computed by lp-hf's head (:func:`lp_hf.install_logprob_head`)
    inside ``actor.model``'s forward instead of from materialized logits. Differences:
    ``output.logits`` is None; a call without ``action_mask`` and without
    ``return_logprobs`` (one that asks for the logits) runs the stock forward. Call it
    before or after DeepSpeed wraps the actor (the engine calls this same module).

    Given an ``ActorPPOTrainer`` (``openrlhf.trainer.ray.ppo_actor``), it adapts
    ``trainer.actor``. With ``fused_loss=True`` (a trainer only) each ``training_step``
    also computes the actor loss in the head pass by ``lp_kernels.linear_logprob_loss``
    (three GEMMs where the stock step takes four; see the module docstring): the loss value
    and metrics are OpenRLHF's own on lp's log-probs, the gradients those of the same loss
    within fp32 rounding. Covered: ``eps_clip_low_high``, ``dual_clip``, ``loss_agg_mode``
    (token or sequence mean), the KL loss (``algo.kl.use_loss``: k1, k2, k3, with or
    without ``unbiased_gradient``), ``entropy_coef``, the train/rollout importance-sampling
    correction (every level, mode and gating), dynamic batches, packed samples, the MoE
    aux loss. Within the step the actor's ``output.entropy`` is the action tokens' (0 at
    other positions: the trainer reads those only). Outside ``training_step`` the actor and
    ``actor_loss_fn`` behave as without it.

    Args:
        target: an ``openrlhf.models.Actor`` (OpenRLHF 0.11.x) of a text causal LM, or an
            ``ActorPPOTrainer`` whose ``actor`` is one.
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).
        fused_loss: compute an ``ActorPPOTrainer``'s actor loss in the head pass (above).

    Returns:
        ``target`` itself. :func:`remove_lp` undoes it.

    Raises:
        RuntimeError: another OpenRLHF version, or an ``Actor.forward`` of other arguments;
            with ``fused_loss``, a ``training_step`` or ``PolicyLoss`` that is not 0.11.2's.
        TypeError: ``target`` is not an ``Actor`` (or a trainer with one), or a subclass
            with its own forward; ``fused_loss`` without the trainer, or a trainer subclass
            with its own ``training_step``.
        ValueError: a vision-language actor; an actor already adapted with other options;
            a model lp-hf refuses (:func:`lp_hf.install_logprob_head`'s errors);
            ``fused_loss`` with an option it does not reproduce (:func:`check_fused_options`:
            ``policy_loss_type="gspo"``, negative clip bounds, an unknown KL estimator, ring
            attention, DeepSpeed ZeRO-3).

    Example:
        >>> actor = lp_hf.openrlhf.use_lp(Actor(pretrain, ...))  # doctest: +SKIP
        >>> action_log_probs, output = actor(sequences, action_mask, attention_mask,
        ...                                  return_output=True, return_entropy=True)
        >>> lp_hf.openrlhf.use_lp(self.trainer, fused_loss=True)  # doctest: +SKIP
    """
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {fused_loss!r}")
    trainer_cls = _trainer_class()
    trainer = target if trainer_cls is not None and isinstance(target, trainer_cls) else None
    actor = target if trainer is None else trainer.actor
    if fused_loss and trainer is None:
        raise TypeError(
            "use_lp(fused_loss=True) takes the ActorPPOTrainer (its PolicyLoss and KL "
            "coefficient are the trainer's), e.g. PolicyModelActor's self.trainer"
        )
    actor_cls = _actor_class()
    hint = "a DeepSpeed engine: pass engine.module"
    check_class("lp_hf.openrlhf", actor, actor_cls, "an openrlhf.models.Actor", hint)
    if getattr(actor, "is_vlm", False):
        raise ValueError("lp_hf.openrlhf supports text actors; this Actor is a vision-language one")
    options = HeadOptions(deterministic, backend, chunk_size, validate)
    if fused_loss and isinstance(trainer.actor_loss_fn, FusedActorLoss):
        set_forward(actor, actor.model, _LpForward, options, "actor")  # same options: no-op
        return target
    module = _trainer_seam(trainer) if fused_loss else None
    if fused_loss:
        check_fused_options(trainer)  # every check before any change
    set_forward(actor, actor.model, _LpForward, options, "actor")
    if module is not None:
        fused = FusedActorLoss(trainer, trainer.actor_loss_fn, actor.__dict__["forward"], module)
        trainer.training_step = fused.training_step
        trainer.actor_loss_fn = fused
    return target


def remove_lp(target: Any) -> Any:
    """Undo :func:`use_lp` on an actor or a trainer (idempotent): the actor's class forward,
    the trainer's own ``training_step`` and ``PolicyLoss``."""
    trainer_cls = _trainer_class()
    if trainer_cls is not None and isinstance(target, trainer_cls):
        fused = target.actor_loss_fn
        if isinstance(fused, FusedActorLoss):
            target.actor_loss_fn = fused.policy_loss
            target.__dict__.pop("training_step", None)
        remove_forward(target.actor, _LpForward)
        return target
    return remove_forward(target, _LpForward)
