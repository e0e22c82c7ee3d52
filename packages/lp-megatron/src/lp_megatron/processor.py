"""``output_processor``: lp's per-token log-probs at megatron-core's output-processor hook.

megatron-core >= 0.18: ``GPTModel.forward(..., output_processor=f, output_processor_context=c)``
calls ``f`` by keyword on the last pipeline stage, after the decoder and multi-token
prediction, in place of the output layer and the loss; the model returns what ``f``
returns (other stages return their hidden state and never call it)::

    f(hidden_states=[s, b, h] ([s/P, b, h] under sequence parallel), output_layer=the stock
      ColumnParallelLinear, output_weight=the tied embedding shard [V/P, h] or None,
      labels=the model's labels= [b, s] or None, loss_mask=the model's loss_mask= or None,
      context=c, scale_logits=GPTModel._scale_logits, config=TransformerConfig, ...)

Data flow of :func:`output_processor` (P = tensor-parallel ranks)::

    hidden [s/P, b, h] -SP: all-gather dim 0, backward reduce-scatter (sums over P)-> [s, b, h]
    labels [b, s]  (context.labels or labels=; loss_mask == 0 -> ignore_index) -> [s, b]
    linear_logprob(hidden, weight shard [V/P, h], labels, tp_group, vocab_start, bias shard,
                   logit_scale = MuP's mup_output_mult, reduce_grad_hidden = not SP)
    -> LogProbOutput(logprob, entropy, lse): [s, b] -> [b, s] fp32, the same on every rank

The gradient of the hidden state is summed over TP exactly once, as by the stock layer:
by the gather's reduce-scatter under sequence parallel, else by lp's all-reduce (the
hook hands over the decoder's output before the stock layer's
``copy_to_tensor_model_parallel_region``). This is the head's arithmetic
(:func:`lp_megatron.head.fused_logprobs`), so the two entry points give the same bits.

A plain function, not a factory: megatron passes everything per call (the output layer,
the tied weight, ``labels``, ``loss_mask``) and forwards ``output_processor_context``
unchanged, so the per-call options belong in that context and there is nothing to close
over. Models whose logits lp does not reproduce (an overridden ``_scale_logits``, an
output layer of another class, ``defer_embedding_wgrad_compute``) take the stock layer's
logits and ``vocab_parallel_logprob``, after a warning (``allow_fallback=False``: error).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule

from lp_kernels import LogProbOutput
from lp_megatron.context import OutputContext
from lp_megatron.head import (
    check_vocab_size,
    fused_logprobs,
    gather_sequence_parallel,
    layer_fallback_reasons,
    logprobs_from_logits,
    mup_logit_scale,
)

_LABEL_DTYPES = (torch.int64, torch.int32)


def _context(context: Any) -> OutputContext:
    if context is None:
        return OutputContext()
    if not isinstance(context, OutputContext):
        raise TypeError(
            f"output_processor_context must be an lp_megatron.OutputContext or None, got "
            f"{type(context).__name__}"
        )
    return context


def _labels(
    ctx: OutputContext,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    seq: int,
    batch: int,
) -> torch.Tensor:
    """The ``[s, b]`` targets: the context's or the model's ``[b, s]`` labels, masked."""
    if ctx.labels is not None:
        if labels is not None and labels is not ctx.labels:
            raise ValueError(
                "labels were given both to the model (labels=) and in OutputContext.labels; "
                "pass them once"
            )
        labels = ctx.labels
    if labels is None:
        raise ValueError(
            "output_processor needs labels: call the model with labels=[b, s] token ids or "
            "pass OutputContext(labels=...)"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype not in _LABEL_DTYPES:
        raise TypeError(f"labels must be an int64 (or int32) tensor, got {labels!r:.80}")
    if tuple(labels.shape) != (batch, seq):
        raise ValueError(
            f"labels must be [b, s] = {(batch, seq)} for hidden states [s, b, h] = "
            f"{(seq, batch)} (gathered), got {tuple(labels.shape)}"
        )
    if ctx.apply_loss_mask and loss_mask is not None:
        if tuple(loss_mask.shape) != tuple(labels.shape):
            raise ValueError(
                f"loss_mask must have the labels' shape {tuple(labels.shape)}, got "
                f"{tuple(loss_mask.shape)}; or pass OutputContext(apply_loss_mask=False)"
            )
        labels = labels.masked_fill(loss_mask == 0, ctx.config.ignore_index)
    return labels.transpose(0, 1)  # [b, s] -> [s, b], the hidden state's order


def _fallback_reason(output_layer: Any, scale_logits: Any, config: Any) -> str | None:
    """Why lp would not reproduce this model's logits from its weight, or None (MuP's
    multiplier is reproduced: :func:`lp_megatron.head.mup_logit_scale`)."""
    reasons = layer_fallback_reasons(output_layer, config)
    stock = getattr(LanguageModule, "_scale_logits", None)
    if scale_logits is not None and getattr(scale_logits, "__func__", None) is not stock:
        reasons.append("the model overrides _scale_logits")
    return "; ".join(reasons) or None


def _stock_logits(
    hidden: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    scale_logits: Any,
    runtime_gather_output: bool | None,
    reason: str,
    allow: bool,
) -> torch.Tensor:
    """The fallback's logits ``[s, b, V/P]`` (or ``[s, b, V]``), as GPTModel computes them."""
    if not allow:
        raise ValueError(
            f"lp cannot reproduce this model's logits ({reason}); set "
            "LogprobHeadConfig(allow_fallback=True) in the OutputContext to use the stock logits"
        )
    warnings.warn(
        f"lp_megatron.output_processor: computing from the stock output layer's logits ({reason})",
        RuntimeWarning,
        stacklevel=3,
    )
    logits, _ = output_layer(
        hidden, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    return logits if scale_logits is None else scale_logits(logits)


def output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: Any,
    output_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    context: OutputContext | None = None,
    config: Any = None,
    scale_logits: Any = None,
    runtime_gather_output: bool | None = None,
    **_unused: Any,
) -> LogProbOutput:
    """GPTModel ``output_processor``: per-token log-probs of the labels, no ``[s, b, V]`` logits.

    Pass it to the model; megatron-core (>= 0.18) calls it with these keywords on the
    last pipeline stage and returns its result where it returned logits or the loss.

    Args:
        hidden_states: ``[s, b, h]`` decoder output (``[s/P, b, h]`` under sequence
            parallel; gathered here as the stock output layer does).
        output_layer: the model's ``ColumnParallelLinear`` (TP group, bias shard, weight).
        output_weight: ``[V/P, h]`` tied embedding shard, or None (the layer's weight).
        labels: ``[b, s]`` int64 global token ids, the model's ``labels=``; or None when
            the context carries them. ``config.ignore_index`` entries are skipped.
        loss_mask: ``[b, s]``, the model's ``loss_mask=``; entries equal to 0 are
            ignored unless ``context.apply_loss_mask`` is False.
        context: the model's ``output_processor_context``: an :class:`OutputContext`, or
            None for ``OutputContext()``.
        config: the model's ``TransformerConfig`` (MuP's output multiplier is applied).
        scale_logits: the model's ``_scale_logits``; an override triggers the fallback.
        runtime_gather_output: used by the fallback's output layer only.

    Returns:
        ``LogProbOutput(logprob, entropy, lse)``, each ``[b, s]`` float32 (entropy and lse
        None unless asked for), the same on every TP rank; ignored tokens hold 0. Under
        ``Float16Module(fp32_output=True)`` it arrives as a plain tuple in that order.

    Raises:
        TypeError: ``context`` is not an OutputContext; labels are not an integer tensor.
        ValueError: no labels, or two different ones; labels or loss_mask not ``[b, s]``;
            ``vocab_size`` above the output layer's rows; a model lp cannot reproduce
            with ``allow_fallback=False``.

    Example:
        >>> out = model(tokens, position_ids, attention_mask, labels=labels,  # doctest: +SKIP
        ...             output_processor=lp_megatron.output_processor,
        ...             output_processor_context=OutputContext(return_entropy=True))
        >>> logprob, entropy = out.logprob, out.entropy  # [b, s] fp32
    """
    ctx = _context(context)
    cfg = ctx.config
    check_vocab_size(cfg.vocab_size, output_layer, "OutputContext.config.vocab_size")
    extras = dict(return_entropy=ctx.return_entropy, return_lse=ctx.return_lse)
    reason = _fallback_reason(output_layer, scale_logits, config)
    if reason is not None:
        logits = _stock_logits(
            hidden_states,
            output_layer,
            output_weight,
            scale_logits,
            runtime_gather_output,
            reason,
            cfg.allow_fallback,
        )
        targets = _labels(ctx, labels, loss_mask, logits.shape[0], logits.shape[1])
        out = logprobs_from_logits(logits, targets, output_layer, cfg, **extras)
    else:
        weight = output_weight if output_weight is not None else output_layer.weight
        if weight is None:
            raise ValueError("the output layer has no weight and the model passed none")
        hidden, gathered = gather_sequence_parallel(hidden_states, output_layer)
        targets = _labels(ctx, labels, loss_mask, hidden.shape[0], hidden.shape[1])
        out = fused_logprobs(
            hidden,
            weight,
            targets,
            output_layer,
            cfg,
            gathered=gathered,
            logit_scale=mup_logit_scale(config),
            **extras,
        )
    # [s, b] -> [b, s], as GPTModel returns its per-token loss
    return LogProbOutput(*(None if t is None else t.transpose(0, 1).contiguous() for t in out))
