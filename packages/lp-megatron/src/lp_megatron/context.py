"""``OutputContext``: what a trainer passes as ``output_processor_context`` with
:func:`lp_megatron.output_processor`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lp_megatron.config import LogprobHeadConfig

_LABEL_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class OutputContext:
    """Per-call options of :func:`lp_megatron.output_processor` (``output_processor_context=``).

    One context can serve every micro-batch when the labels travel as the model's own
    ``labels=`` argument; ``OutputContext()`` (or no context at all) is the common case.

    Example:
        >>> from lp_megatron import LogprobHeadConfig, OutputContext
        >>> ctx = OutputContext(config=LogprobHeadConfig(temperature=0.7), return_entropy=True)
        >>> ctx.config.temperature, ctx.labels is None
        (0.7, True)
    """

    labels: torch.Tensor | None = field(default=None, compare=False)
    """``[b, s]`` int64 (or int32) global token ids, the layout of GPTModel's ``labels=``.
    None (the default): the ``labels=`` the model was called with. Giving both raises
    unless they are the same tensor."""

    return_entropy: bool = False
    """Also return the per-token entropy of ``softmax(logits / T)`` (differentiable)."""

    return_lse: bool = False
    """Also return the per-token log-sum-exp (differentiable; z-loss)."""

    apply_loss_mask: bool = True
    """Tokens where the model's ``loss_mask=`` is 0 are ignored like ``ignore_index``: their
    outputs are 0 and they get no gradient. False: ``loss_mask`` is not looked at."""

    config: LogprobHeadConfig = field(default_factory=LogprobHeadConfig)
    """Temperature, the real ``vocab_size``, ``ignore_index``, ``deterministic``, backend and
    the other options, as for :func:`lp_megatron.install_logprob_head`. With
    ``allow_fallback=False`` a model whose logits lp does not reproduce raises ValueError."""

    def __post_init__(self) -> None:
        if self.labels is not None:
            if not isinstance(self.labels, torch.Tensor):
                raise TypeError(
                    f"OutputContext.labels must be a [b, s] int64 tensor or None, got "
                    f"{type(self.labels).__name__}"
                )
            if self.labels.dtype not in _LABEL_DTYPES or self.labels.dim() != 2:
                raise ValueError(
                    f"OutputContext.labels must be [b, s] int64 (or int32), got "
                    f"{tuple(self.labels.shape)} {self.labels.dtype}"
                )
        for name in ("return_entropy", "return_lse", "apply_loss_mask"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"OutputContext.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.config, LogprobHeadConfig):
            got = type(self.config).__name__
            raise TypeError(f"OutputContext.config must be a LogprobHeadConfig, got {got}")
