"""The lp log-prob head for a megatron-core ``GPTModel``, installed without editing model source.

Data flow while installed (last pipeline stage; P = tensor-parallel ranks)::

    decoder hidden [s, b, h]  (or [s/P, b, h] under sequence parallel)
      -> HiddenOutputLayer (in place of model.output_layer)
           SP:     all-gather dim 0            backward: reduce-scatter dim 0 (sums over P)
           no SP:  identity                    (no copy_to_tensor_model_parallel_region)
           remembers the weight: the ``weight=`` GPTModel passes (tied embeddings) or its own
      -> GPTModel transposes: output [b, s, h] where the logits [b, s, V/P] were
      -> head.logprobs(output, labels)
           linear_logprob(hidden, weight shard [V/P, h], labels, tp_group, vocab_start,
                          bias=the output layer's bias shard [V/P] or None)
           -> LogProbOutput(logprob, entropy, lse), each [b, s] fp32, the same on every rank

Gradient of the hidden state, summed over the P vocabulary shards exactly once:

- Without sequence parallel every rank holds the whole hidden and a partial gradient
  (its vocabulary shard's share). The stock ``ColumnParallelLinear`` sums it with the
  backward all-reduce of ``copy_to_tensor_model_parallel_region`` (or ``allreduce_dgrad``).
  The replacement layer skips that op and ``linear_logprob(reduce_grad_hidden=True)``
  does the all-reduce instead: one sum.
- With sequence parallel the gather's backward reduce-scatter already sums the
  partials, so ``reduce_grad_hidden=False``: again one sum.

The weight gradient is each rank's own shard's (no collective), as in the stock layer; so is
the bias gradient when the output layer has a bias (``ColumnParallelLinear(bias=True)``, with
``skip_bias_add=False``; GPTModel builds it without one, a model may swap in a biased layer):
each rank passes its shard of the bias to lp as ``bias=``. megatron-core applies no final-logit
softcap after the output layer, so there is none to read from its config.
Models whose logits are post-processed after the output layer (MuP output scaling,
multi-token prediction, a non-standard output layer class) keep the stock
layer; ``head.logprobs`` then computes the same quantities from the (vocabulary-parallel)
logits with ``lp_kernels.vocab_parallel_logprob``, after one warning.

``gather_sequence_parallel``, ``fused_logprobs`` and ``logprobs_from_logits`` are the steps
above as plain functions; ``lp_megatron.processor`` (the output-processor hook) calls them too.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from lp_kernels import LogProbOutput, linear_logprob, vocab_parallel_logprob
from lp_megatron.config import LogprobHeadConfig

_HEAD_ATTR = "_lp_logprob_head"


class HiddenOutputLayer(torch.nn.Module):
    """Stand-in for a GPTModel's ``output_layer`` that returns the hidden state, not logits.

    Registers the stock layer's weight ``Parameter`` (the same object, or None for tied
    embeddings) as its own ``weight``, and its ``bias`` (the same object, or None), so
    parameters, optimizer state, state-dict keys and gradient buffers are unchanged.
    Attributes it does not define (``config``, ``tp_group``, ``output_size``, ...) are read
    from the stock layer.
    """

    def __init__(self, stock: torch.nn.Module) -> None:
        super().__init__()
        # Kept outside _modules: the stock layer's parameters must not appear twice.
        self.__dict__["stock"] = stock
        self.__dict__["last_weight"] = None
        self.__dict__["last_gathered"] = False
        self._parameters["weight"] = stock.weight  # may be None (tied embeddings)
        self._parameters["bias"] = getattr(stock, "bias", None)  # usually None
        self.sequence_parallel = bool(getattr(stock, "sequence_parallel", False))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["stock"], name)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Returns ``(hidden [s, b, h], None)``, all-gathered along s under sequence parallel.

        Args:
            input_: ``[s, b, h]``, or ``[s/P, b, h]`` under sequence parallel.
            weight: ``[V/P, h]``, the shard GPTModel passes for tied embeddings; else None
                and the layer's own weight is used.
            runtime_gather_output: ignored (there are no logits to gather).
        """
        if weight is None:
            weight = self.weight
            if weight is None:
                raise RuntimeError(
                    "the output layer has no weight of its own (tied embeddings) and the "
                    "model passed none"
                )
        self.__dict__["last_weight"] = weight
        input_, gathered = gather_sequence_parallel(input_, self)  # its own SP flag
        self.__dict__["last_gathered"] = gathered
        return input_, None

    # Checkpointing goes through the stock layer, so nothing changes while installed.
    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.stock.sharded_state_dict(*args, **kwargs)

    def get_extra_state(self) -> Any:
        return self.stock.get_extra_state()

    def set_extra_state(self, state: Any) -> None:
        self.stock.set_extra_state(state)


def _unwrap(module: Any) -> Any:
    """Peel DDP / Float16Module / FSDP-style wrappers (``.module``) off ``module``."""
    seen = 0
    while not hasattr(module, "output_layer") and hasattr(module, "module") and seen < 16:
        module = module.module
        seen += 1
    return module


def _find_gpt_model(model: Any) -> Any | None:
    """The (unwrapped) model chunk that owns the output layer, or None (not last stage)."""
    chunks: Sequence[Any] = model if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("install_logprob_head got an empty list of model chunks")
    for chunk in reversed(chunks):
        inner = _unwrap(chunk)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(
                f"expected a GPTModel, a wrapper with .module, or a list of them; got "
                f"{type(chunk).__name__}"
            )
        layer = getattr(inner, "output_layer", None)
        if getattr(inner, "post_process", True) and layer is not None:
            return inner
    return None


def _fallback_reasons(gpt: Any) -> list[str]:
    """What the head would not reproduce on this model (empty: the head is exact)."""
    cfg = gpt.config
    layer = gpt.output_layer
    reasons = []
    if mup_logit_scale(cfg) is not None:  # GPTModel scales what the layer returns: h, not l
        reasons.append(f"MuP output scaling (mup_output_mult={cfg.mup_output_mult})")
    stock_scale = getattr(LanguageModule, "_scale_logits", None)  # absent before MuP support
    if stock_scale is not None and getattr(type(gpt), "_scale_logits", stock_scale) is not (
        stock_scale
    ):
        reasons.append(f"{type(gpt).__name__} overrides _scale_logits")
    if getattr(cfg, "mtp_num_layers", None):
        reasons.append("multi-token prediction (mtp_num_layers) reuses the output layer")
    return reasons + layer_fallback_reasons(layer, cfg)


def layer_fallback_reasons(layer: Any, config: Any) -> list[str]:
    """What lp would not reproduce of the output layer itself (the head and the processor)."""
    reasons = []
    if getattr(config, "defer_embedding_wgrad_compute", False):
        reasons.append("defer_embedding_wgrad_compute")
    if type(layer) is not tensor_parallel.ColumnParallelLinear:
        reasons.append(f"output layer is {type(layer).__name__}, not ColumnParallelLinear")
    return reasons


def mup_logit_scale(config: Any) -> float | None:
    """MuP's output multiplier, which the stock ``_scale_logits`` applies to the logits: lp's
    ``logit_scale`` (None without MuP)."""
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        return float(config.mup_output_mult)
    return None


def check_vocab_size(vocab_size: int | None, layer: Any, name: str) -> None:
    """``ValueError`` naming ``name`` if ``vocab_size`` exceeds the output layer's rows."""
    rows = getattr(layer, "output_size", None)
    if vocab_size is not None and rows is not None and vocab_size > rows:
        raise ValueError(
            f"{name}={vocab_size} exceeds the output layer's {rows} rows; pass the real "
            "vocabulary size or None"
        )


def logit_bias(layer: Any) -> torch.Tensor | None:
    """The bias shard ``[V/P]`` the stock output layer adds to its logits, or None.

    ``ColumnParallelLinear`` adds ``self.bias`` unless ``skip_bias_add`` (then it returns the
    bias beside the output and GPTModel discards it: the logits have none)."""
    bias = getattr(layer, "bias", None)
    return None if bias is None or getattr(layer, "skip_bias_add", False) else bias


def _tp_layout(group: Any) -> tuple[Any, int, int]:
    """``(group or None, rank, size)`` of the tensor-parallel group."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None, 0, 1
    size = dist.get_world_size(group)
    if size == 1:
        return None, 0, 1
    return group, dist.get_rank(group), size


def gather_sequence_parallel(hidden: torch.Tensor, layer: Any) -> tuple[torch.Tensor, bool]:
    """``(hidden [s, b, h], gathered)``: the stock output layer's sequence-parallel gather.

    Under sequence parallel (``layer.sequence_parallel``) ``hidden`` is ``[s/P, b, h]``;
    forward: all-gather dim 0, backward: reduce-scatter dim 0, which sums the ranks' partial
    gradients (so lp is then called with ``reduce_grad_hidden=False``). Otherwise ``hidden``
    is returned as it is and ``gathered`` is False.
    """
    if not getattr(layer, "sequence_parallel", False):
        return hidden, False
    hidden = gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=True, group=layer.tp_group
    )
    return hidden, True


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    layer: Any,
    config: LogprobHeadConfig,
    *,
    gathered: bool,
    return_entropy: bool = False,
    return_lse: bool = False,
    logit_scale: float | None = None,
) -> LogProbOutput:
    """``linear_logprob`` on this rank's vocabulary shard of the stock output ``layer``.

    Args:
        hidden: ``[*, H]``, the whole sequence (gathered under sequence parallel).
        weight: ``[V/P, H]``, the layer's weight shard or the tied embedding's.
        labels: ``[*]`` int64 global token ids.
        layer: the stock ``ColumnParallelLinear`` (its ``tp_group`` and bias shard).
        config: temperature, vocab_size and the lp options.
        gathered: ``hidden`` went through :func:`gather_sequence_parallel`'s gather, whose
            backward sums the gradient over TP; else lp all-reduces it. One sum either way.
        logit_scale: a multiplier of the logits before the temperature (MuP), or None.
    """
    group, rank, _ = _tp_layout(getattr(layer, "tp_group", None))
    return linear_logprob(
        hidden,
        weight,
        labels,
        tp_group=group,
        vocab_start=rank * weight.shape[0],
        bias=logit_bias(layer),  # this rank's shard, or None
        reduce_grad_hidden=not gathered,
        logit_scale=logit_scale,
        deterministic=config.deterministic,
        deterministic_tile=config.deterministic_tile,
        backend=config.backend,
        **_common_options(config, return_entropy, return_lse),
    )


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    layer: Any,
    config: LogprobHeadConfig,
    *,
    return_entropy: bool = False,
    return_lse: bool = False,
) -> LogProbOutput:
    """The fallback: ``vocab_parallel_logprob`` on the stock layer's logits ``[*, V/P]`` (or
    ``[*, V]`` when gathered at runtime: then every rank computes alone)."""
    group, rank, size = _tp_layout(getattr(layer, "tp_group", None))
    if group is not None and logits.shape[-1] == layer.output_size_per_partition * size:
        group, rank = None, 0  # runtime_gather_output=True: full logits on every rank
    return vocab_parallel_logprob(
        logits,
        labels,
        tp_group=group,
        vocab_start=rank * logits.shape[-1],
        deterministic=config.deterministic,
        deterministic_tile=config.deterministic_tile or 128,  # logits: 128 columns
        **_common_options(config, return_entropy, return_lse),
    )


def _common_options(
    config: LogprobHeadConfig, return_entropy: bool, return_lse: bool
) -> dict[str, Any]:
    return dict(
        temperature=config.temperature,
        ignore_index=config.ignore_index,
        return_entropy=return_entropy,
        return_lse=return_lse,
        vocab_size=config.vocab_size,
        chunk_size=config.chunk_size,
        validate=config.validate,
    )


def _labels_guard(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the model cannot compute its own loss from a hidden state."""
    labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
    if labels is not None:
        raise RuntimeError(
            "the lp log-prob head is installed: call the model with labels=None and pass "
            "the output and labels to head.logprobs(), or head.remove() first"
        )


class LogprobHead:
    """Handle returned by :func:`install_logprob_head`; also a context manager.

    Attributes:
        config: the :class:`LogprobHeadConfig` it was installed with.
        model: the unwrapped GPTModel (chunk) that owns the output layer, or None on a
            pipeline stage without one.
        fallback_reason: why the stock output layer was kept, or None.
    """

    def __init__(self, model: Any, config: LogprobHeadConfig, fallback_reason: str | None):
        self.config = config
        self.model = model
        self.fallback_reason = fallback_reason
        self._stock: torch.nn.Module | None = None
        self._layer: HiddenOutputLayer | None = None
        self._hook: Any = None
        self._installed = False

    @property
    def installed(self) -> bool:
        """True from install until :meth:`remove`."""
        return self._installed

    @property
    def fused(self) -> bool:
        """True when the output layer returns hidden states (not on fallback or other stages)."""
        return self._layer is not None

    def _install(self) -> None:
        gpt = self.model
        if gpt is not None:
            gpt.__dict__[_HEAD_ATTR] = self
            if self.fallback_reason is None:
                self._stock = gpt.output_layer
                self._layer = HiddenOutputLayer(self._stock)
                gpt.output_layer = self._layer
                self._hook = gpt.register_forward_pre_hook(_labels_guard, with_kwargs=True)
        self._installed = True

    def remove(self) -> None:
        """Restore the stock output layer (the model returns logits again). Idempotent."""
        if not self._installed:
            return
        gpt = self.model
        if gpt is not None:
            if self._layer is not None and gpt.output_layer is self._layer:
                gpt.output_layer = self._stock
            if self._hook is not None:
                self._hook.remove()
            if gpt.__dict__.get(_HEAD_ATTR) is self:
                del gpt.__dict__[_HEAD_ATTR]
        self._layer = self._stock = self._hook = None
        self._installed = False

    def __enter__(self) -> LogprobHead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def logprobs(
        self,
        output: torch.Tensor,
        labels: torch.Tensor,
        *,
        return_entropy: bool = False,
        return_lse: bool = False,
    ) -> LogProbOutput:
        """Per-token log-probs of ``labels`` from the model's output (last pipeline stage).

        Args:
            output: what the model returned with ``labels=None``: the hidden state
                ``[b, s, h]`` (or, after a fallback, the logits ``[b, s, V/P]`` or
                ``[b, s, V]``), from the latest forward of this model. An fp32 output of
                a bf16/fp16 model (``Float16Module`` upcasts it) is cast back to the
                weight dtype, which is exact.
            labels: ``[b, s]`` int64 global token ids; ``config.ignore_index`` skips.
            return_entropy: also return the per-token entropy (differentiable).
            return_lse: also return the per-token log-sum-exp (differentiable).

        Returns:
            ``LogProbOutput(logprob, entropy, lse)``, each ``[b, s]`` float32 and the
            same on every tensor-parallel rank.

        Raises:
            RuntimeError: the head was removed, this stage has no output layer, or the
                model has not run forward since install.
        """
        if not self._installed:
            raise RuntimeError("this LogprobHead was removed; install_logprob_head() again")
        if self.model is None:
            raise RuntimeError(
                "this pipeline stage has no output layer; log-probs exist on the last stage"
            )
        stock = self._stock if self._layer is not None else self.model.output_layer
        extras = dict(return_entropy=return_entropy, return_lse=return_lse)
        if self._layer is None:
            return logprobs_from_logits(output, labels, stock, self.config, **extras)
        weight = self._layer.last_weight
        if weight is None:
            raise RuntimeError("run the model forward (labels=None) before head.logprobs()")
        if output.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
            # Float16Module upcasts the model output (fp32_output=True); the hidden state was
            # computed in the weight dtype, so casting back is exact.
            output = output.to(weight.dtype)
        if output.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"output has last dim {output.shape[-1]}, the hidden size is {weight.shape[1]}: "
                "pass what the model returned while the head was installed"
            )
        return fused_logprobs(
            output,
            weight,
            labels,
            stock,
            self.config,
            gathered=self._layer.last_gathered,
            **extras,
        )


def install_logprob_head(model: Any, config: LogprobHeadConfig | None = None) -> LogprobHead:
    """Make a Megatron GPTModel return hidden states and get log-probs from lp instead.

    While installed, ``model(input_ids, position_ids, attention_mask)`` (``labels=None``)
    returns the hidden state ``[b, s, h]`` where it returned logits ``[b, s, V/P]``; pass
    it to :meth:`LogprobHead.logprobs`. Calling the model with ``labels`` raises.

    Args:
        model: a ``GPTModel``, a wrapper with ``.module`` (DDP, Float16Module), or a list
            of model chunks (virtual pipeline); the chunk that owns the output layer
            (``post_process``) is used. On other pipeline stages the head is inert.
        config: options; default ``LogprobHeadConfig()``.

    Returns:
        The :class:`LogprobHead`. Installing again with an equal config returns the same
        head (idempotent).

    Raises:
        ValueError: installed already with a different config; ``config.vocab_size``
            larger than the output layer; a model the head cannot reproduce with
            ``config.allow_fallback=False``.
        TypeError: ``model`` is not a module (or a list of modules).

    Example:
        >>> with install_logprob_head(model) as head:  # doctest: +SKIP
        ...     hidden = model(tokens, position_ids, attention_mask)
        ...     out = head.logprobs(hidden, labels, return_entropy=True)
    """
    config = LogprobHeadConfig() if config is None else config
    if not isinstance(config, LogprobHeadConfig):
        raise TypeError(f"config must be a LogprobHeadConfig, got {type(config).__name__}")
    gpt = _find_gpt_model(model)
    if gpt is not None:
        existing = gpt.__dict__.get(_HEAD_ATTR)
        if existing is not None and existing.installed:
            if existing.config != config:
                raise ValueError(
                    "a log-prob head with a different config is installed on this model; "
                    "call head.remove() first"
                )
            return existing
        check_vocab_size(config.vocab_size, gpt.output_layer, "config.vocab_size")
        reasons = _fallback_reasons(gpt)
        reason = "; ".join(reasons) if reasons else None
        if reason is not None:
            if not config.allow_fallback:
                raise ValueError(
                    f"the lp head cannot reproduce this model's logits ({reason}); set "
                    "allow_fallback=True to keep the stock output layer"
                )
            warnings.warn(
                f"lp_megatron: keeping the stock output layer ({reason}); head.logprobs() "
                "will compute from the materialized logits",
                RuntimeWarning,
                stacklevel=2,
            )
    else:
        reason = None
    head = LogprobHead(gpt, config, reason)
    head._install()
    return head
