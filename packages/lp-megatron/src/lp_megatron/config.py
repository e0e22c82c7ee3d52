"""``LogprobHeadConfig``: the options of the lp log-prob head for a Megatron GPTModel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class LogprobHeadConfig:
    """Options of :func:`lp_megatron.install_logprob_head`; ``LogprobHeadConfig()`` is the
    common case.

    Example:
        >>> from lp_megatron import LogprobHeadConfig
        >>> LogprobHeadConfig(temperature=0.7, vocab_size=50257).backend
        'auto'
    """

    backend: Backend = "auto"
    """lp_kernels backend: ``"torch"`` (chunked torch ops), ``"triton"`` (fused kernel,
    CUDA), or ``"auto"`` (triton on CUDA devices of compute capability >= 8.0, else torch)."""

    chunk_size: int | None = None
    """Token rows per step of the vocabulary loop (a memory knob). None = the backend
    default, which never depends on the number of tokens."""

    temperature: float = 1.0
    """Logits are divided by it (> 0) before the softmax; the weight is not copied."""

    vocab_size: int | None = None
    """The real (unpadded) global vocabulary. Megatron pads the output layer to a multiple
    of ``make_vocab_size_divisible_by * TP``; ids ``>= vocab_size`` are padding and never
    enter the softmax. None = every row of the (padded) output layer is a real token."""

    ignore_index: int = -100
    """Label value of tokens to skip: their log-prob is 0 and they get no gradient."""

    deterministic: bool = False
    """Passed to ``lp_kernels.linear_logprob`` (or ``vocab_parallel_logprob`` on the
    fallback path) as ``deterministic=``: tensor-parallel invariance (the same bits for
    any TP degree; Megatron's vocabulary padding to 128 x TP meets its 128-aligned shard
    rule). For one hidden state, the log-probs, entropy, lse and the output layer's weight
    gradient are the same bits at every TP degree; so is the hidden state's gradient
    without sequence parallel. With it, the head returns each rank's partial gradient
    and Megatron's reduce-scatter sums them, so those bits are Megatron's. (Megatron's
    decoder layers do not give the same hidden state at every TP degree themselves.)
    Provided by both backends, on CPU and on GPUs."""

    deterministic_tile: int | None = None
    """Passed as ``deterministic_tile=`` with ``deterministic=True``: the width of the global
    vocabulary tiles (a multiple of 128), or None for ``linear_logprob``'s default (about an
    eighth of the vocabulary, ``lp_kernels.default_deterministic_tile``). The bits depend
    on it and are the same for every TP degree with one tile; wider tiles cost less. The
    fallback path (``vocab_parallel_logprob``) takes 128 for None."""

    validate: bool = True
    """Check label ids against the vocabulary (one host sync per call). False = no host
    sync at all."""

    allow_fallback: bool = True
    """When the model post-processes its logits in a way the head does not reproduce
    (MuP output scaling, multi-token prediction or a non-standard output layer; a
    ``ColumnParallelLinear`` bias is reproduced, passed to lp as ``bias=``):
    True keeps the stock output layer and warns once (``head.logprobs`` then takes the
    logits); False raises ValueError at install."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size <= 0
        ):
            raise ValueError(
                f"chunk_size must be None (backend default) or a positive int, "
                f"got {self.chunk_size!r}"
            )
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a positive float, got {self.temperature!r}")
        if not self.temperature > 0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be > 0 and finite, got {self.temperature!r}; use 1.0 for "
                "the model's own distribution"
            )
        if self.vocab_size is not None and (
            isinstance(self.vocab_size, bool)
            or not isinstance(self.vocab_size, int)
            or self.vocab_size <= 0
        ):
            raise ValueError(
                f"vocab_size must be None (every output row is a token) or the real "
                f"vocabulary size > 0, got {self.vocab_size!r}"
            )
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if not -(2**63) <= self.ignore_index < 2**63:
            raise ValueError(f"ignore_index must fit in int64, got {self.ignore_index!r}")
        tile = self.deterministic_tile
        bad_tile = isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0 or tile % 128
        if tile is not None and bad_tile:
            raise ValueError(
                f"deterministic_tile must be None or a positive multiple of 128, got {tile!r}"
            )
        for name in ("deterministic", "validate", "allow_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
