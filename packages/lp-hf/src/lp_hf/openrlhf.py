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
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from lp_hf.adapters import (
    HeadOptions,
    check_class,
    check_parameters,
    check_series,
    head_logprobs,
    remove_forward,
    set_forward,
)
from lp_hf.head import Backend

__all__ = ["SUPPORTED_VERSIONS", "remove_lp", "use_lp"]

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


class _LpForward:
    """The adapted actor's ``forward`` (an instance attribute; see the module docstring)."""

    def __init__(self, actor: torch.nn.Module, options: HeadOptions):
        self.actor = actor
        self.options = options

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


def use_lp(
    actor: torch.nn.Module,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.nn.Module:
    """Make an OpenRLHF ``Actor``'s forward compute its log-probs and entropy with lp.

    After the call, ``actor(sequences, action_mask, attention_mask, return_output=...,
    return_logprobs=..., return_entropy=..., ring_attn_group=..., packed_seq_lens=...)``
    returns what ``Actor.forward`` returns (the same shapes, conventions and temperature,
    packed samples included), computed by lp-hf's head (:func:`lp_hf.install_logprob_head`)
    inside ``actor.model``'s forward instead of from materialized logits. Differences:
    ``output.logits`` is None; a call without ``action_mask`` and without
    ``return_logprobs`` (one that asks for the logits) runs the stock forward. Call it
    before or after DeepSpeed wraps the actor (the engine calls this same module).

    Args:
        actor: an ``openrlhf.models.Actor`` (OpenRLHF 0.11.x) of a text causal LM.
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).

    Returns:
        ``actor`` itself. :func:`remove_lp` gives it the stock forward back.

    Raises:
        RuntimeError: another OpenRLHF version, or an ``Actor.forward`` of other arguments.
        TypeError: ``actor`` is not an ``Actor``, or a subclass with its own forward.
        ValueError: a vision-language actor; an actor already adapted with other options;
            a model lp-hf refuses (:func:`lp_hf.install_logprob_head`'s errors).

    Example:
        >>> actor = lp_hf.openrlhf.use_lp(Actor(pretrain, ...))  # doctest: +SKIP
        >>> action_log_probs, output = actor(sequences, action_mask, attention_mask,
        ...                                  return_output=True, return_entropy=True)
    """
    actor_cls = _actor_class()
    hint = "a DeepSpeed engine: pass engine.module"
    check_class("lp_hf.openrlhf", actor, actor_cls, "an openrlhf.models.Actor", hint)
    if getattr(actor, "is_vlm", False):
        raise ValueError("lp_hf.openrlhf supports text actors; this Actor is a vision-language one")
    options = HeadOptions(deterministic, backend, chunk_size, validate)
    set_forward(actor, actor.model, _LpForward, options, "actor")
    return actor


def remove_lp(actor: torch.nn.Module) -> torch.nn.Module:
    """Give an actor adapted by :func:`use_lp` its class's forward back (idempotent)."""
    return remove_forward(actor, _LpForward)
