"""Distillation of a Hugging Face causal LM: a divergence to a teacher, without logits.

Data flow of one :func:`distill_divergence` call::

    rows = next_token_targets(input_ids with mask, attention_mask, position_ids) != -100
                                          [B, T] bool: position t predicts token t + 1
    student.get_decoder()(input_ids, ...) -> h_s [B, T, H]   -> h_s[rows]  [M, H]
    teacher.get_decoder()(input_ids, ...) -> h_t [B, T, H_t] -> h_t[rows]  [M, H_t]
                                          (under torch.no_grad())
    linear_divergence(h_s[rows], W_s, h_t[rows], W_t, bias=b_s, teacher_bias=b_t,
                      softcap / logit_scale of each model, kind, beta, temperatures)
      -> per-row divergence and entropies [M] fp32, scattered back to [B, T] (0 elsewhere)

Neither model computes its ``[B, T, V]`` logits: each runs its decoder (the base model
that ``model.get_decoder()`` returns, final norm included), and lp reads each output
layer (``model.get_output_embeddings()``: weight and bias) and each model's final-logit
softcap and scale (:func:`lp_hf.model_logit_transform`). Only the rows that predict a
scored token reach lp. The teacher's weight and bias go to lp detached: the teacher gets
no gradient, whether or not its parameters require one.

Not covered: a model whose forward changes the decoder's output before its output layer
(MiniCPM3 divides it by ``config.logits_scaling``; refused), the models' own
``logits_to_keep``, and FSDP2 or torch-native tensor parallel (the decoder and the output
layer are called outside the model's forward, so FSDP2's root hooks do not run; a DTensor
head is refused).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from lp_hf.final_logits import FIELDS, FinalLogitTransform, model_logit_transform
from lp_hf.targets import next_token_targets
from lp_kernels import linear_divergence

__all__ = ["DistillOutput", "distill_divergence"]

_IGNORE = -100
_DERIVED = (
    "bias",
    "teacher_bias",
    "softcap",
    "teacher_softcap",
    "logit_scale",
    "teacher_logit_scale",
)
"""``linear_divergence`` arguments that :func:`distill_divergence` sets from the models."""


class DistillOutput(NamedTuple):
    """What :func:`distill_divergence` returns, each ``[B, T]``; position ``t`` is the
    distribution of token ``t + 1``, 0 where ``mask`` is False."""

    divergence: torch.Tensor
    """fp32, differentiable into the student's decoder and output layer."""
    student_entropy: torch.Tensor
    """fp32, detached: ``-sum p log p`` of the student."""
    teacher_entropy: torch.Tensor
    """fp32, detached: ``-sum q log q`` of the teacher."""
    mask: torch.Tensor
    """bool: the positions that count (pass it to :func:`lp_kernels.losses.distill_loss`)."""


def _output_layer(model: torch.nn.Module, role: str) -> torch.nn.Linear:
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    if not isinstance(layer, torch.nn.Linear):
        raise TypeError(
            f"{role}.get_output_embeddings() must be an nn.Linear (a transformers causal LM's "
            f"head), got {type(layer).__name__}"
        )
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(layer.weight, dtensor):
        raise TypeError(
            f"{role}'s output layer is a DTensor (FSDP2 or tensor parallel): "
            "distill_divergence calls the decoder and the head outside the model's forward, "
            "so it takes unsharded models only"
        )
    return layer


def _transform(model: torch.nn.Module, role: str) -> FinalLogitTransform:
    """The model's softcap and scale; refused where a final-logit field is set that acts
    on the output layer's input (the decoder's hidden states would miss it)."""
    transform = model_logit_transform(model)
    config = getattr(model, "config", None)
    fields = [f for f in FIELDS if getattr(config, f, None) not in (None, 1, 1.0)]
    if fields and transform == FinalLogitTransform():
        raise ValueError(
            f"{role}'s config sets {fields[0]}={getattr(config, fields[0])!r}, which its "
            f"forward ({type(model).__name__}) applies to the output layer's input, not to "
            "the decoder's output that distill_divergence reads; such models are not supported"
        )
    return transform


def _rows(
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """``[B, T]`` bool: the positions whose next token is scored."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, T] integer tensor")
    labels = input_ids
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point:
            raise TypeError(f"mask must be a bool or 0/1 integer [B, T] tensor, got {mask!r}")
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                f"{tuple(mask.shape)}"
            )
        labels = input_ids.masked_fill(mask.to(input_ids.device) == 0, _IGNORE)
    targets = next_token_targets(
        labels, attention_mask=attention_mask, position_ids=position_ids, ignore_index=_IGNORE
    )
    return targets != _IGNORE


def _last_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """``[B, T, H]``: the decoder's last hidden states (the output layer's input)."""
    outputs = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        return_dict=True,
    )
    return outputs.last_hidden_state


def _scatter(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values`` ``[M]`` at the True positions of ``rows`` ``[B, T]``, 0 elsewhere."""
    return values.new_zeros(rows.shape).masked_scatter(rows, values)


def distill_divergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    **op_kwargs: Any,
) -> DistillOutput:
    """Per-position divergence between a student's and a teacher's next-token distributions.

    ``p = softmax(z_s / temperature)`` and ``q = softmax(z_t / teacher_temperature)`` over
    the shared vocabulary, ``z`` each model's logits with its own bias, scale and softcap,
    at each position ``t`` that predicts a scored token ``t + 1``. ``kind``:
    ``"forward_kl"`` ``KL(q || p)`` (mode covering, classic distillation),
    ``"reverse_kl"`` ``KL(p || q)`` (mode seeking, on-policy distillation),
    ``"jsd"`` the generalized JSD ``beta KL(q || m) + (1 - beta) KL(p || m)``,
    ``m = beta q + (1 - beta) p`` (TRL's GKD).

    Args:
        student: a transformers causal LM (``get_decoder()``, ``get_output_embeddings()``);
            gradients reach its parameters.
        teacher: a causal LM with the student's vocabulary (the same output-layer rows); its
            hidden size may differ. Run under ``torch.no_grad()``; no gradient reaches it.
        input_ids: ``[B, T]`` token ids (prompt and completion).
        attention_mask: ``[B, T]``, 0 at padding (passed to both models).
        position_ids: ``[B, T]`` or ``[1, T]`` (passed to both; packed sequences as in
            :func:`lp_hf.next_token_targets`).
        mask: ``[B, T]`` bool or 0/1, True at the tokens to distill (the completion), as
            ``labels != -100``; None: every token. Position ``t`` counts where token
            ``t + 1`` is masked in and both are attended (not padding, same sequence).
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: ``jsd``'s mixture weight of the teacher, in ``(0, 1)``.
        temperature: the student's (> 0).
        teacher_temperature: the teacher's; None: ``temperature``.
        **op_kwargs: other ``lp_kernels.linear_divergence`` options (``backend``,
            ``chunk_size``, ``validate``, ``deterministic``).

    Returns:
        :class:`DistillOutput` ``(divergence, student_entropy, teacher_entropy, mask)``,
        each ``[B, T]``; ``distill_loss(out.divergence, out.mask)`` is the token mean.

    Raises:
        ValueError: the vocabularies differ; a bad ``mask``, ``kind``, ``beta`` or
            temperature (from ``linear_divergence``); a model that scales its decoder's
            output before the output layer.
        TypeError: an output layer that is not an ``nn.Linear`` or is a DTensor; an
            option in ``op_kwargs`` that is set from the models.

    Example:
        >>> out = distill_divergence(student, teacher, ids, mask=completion)  # doctest: +SKIP
        >>> distill_loss(out.divergence, out.mask).backward()
    """
    derived = sorted(set(op_kwargs) & set(_DERIVED))
    if derived:
        raise TypeError(
            f"distill_divergence sets {derived} itself (from the models' output layers and "
            "final-logit transforms)"
        )
    layer_s, layer_t = _output_layer(student, "student"), _output_layer(teacher, "teacher")
    if layer_s.weight.shape[0] != layer_t.weight.shape[0]:
        raise ValueError(
            f"the teacher's vocabulary differs from the student's: its output layer has "
            f"{layer_t.weight.shape[0]} rows, the student's {layer_s.weight.shape[0]}; "
            "distillation needs the same token ids in the same rows"
        )
    form_s, form_t = _transform(student, "student"), _transform(teacher, "teacher")
    rows = _rows(input_ids, mask, attention_mask, position_ids)
    hidden = _last_hidden(student, input_ids, attention_mask, position_ids)
    with torch.no_grad():
        teacher_hidden = _last_hidden(teacher, input_ids, attention_mask, position_ids)
    rows = rows.to(hidden.device)
    bias_t = None if layer_t.bias is None else layer_t.bias.detach()
    out = linear_divergence(
        hidden[rows],
        layer_s.weight,
        teacher_hidden[rows],
        layer_t.weight.detach(),
        kind=kind,
        beta=beta,
        temperature=temperature,
        teacher_temperature=teacher_temperature,
        bias=layer_s.bias,
        teacher_bias=bias_t,
        softcap=form_s.softcap,
        teacher_softcap=form_t.softcap,
        logit_scale=form_s.logit_scale,
        teacher_logit_scale=form_t.logit_scale,
        **op_kwargs,
    )
    fields = (_scatter(value, rows) for value in out)
    return DistillOutput(*fields, rows)
