"""Public result type and the frozen option bundle every autograd Function takes.

Non-tensor options reach a ``torch.autograd.Function`` as one frozen dataclass so
that ``backward`` returns a short tuple (``d_hidden, d_weight, None, None``), not one
``None`` per scalar option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lp_kernels.core.tiles import TileOwnership, tile_ownership
from lp_kernels.core.transform import LogitTransform


class _Outputs(NamedTuple):
    logprob: torch.Tensor
    """``log softmax(z)[target]`` with ``z = logits / temperature`` over the real vocabulary."""
    entropy: torch.Tensor | None
    """``-sum softmax(z) * log_softmax(z)``, or None unless ``return_entropy=True``."""
    lse: torch.Tensor | None
    """``logsumexp(z)``, or None unless ``return_lse=True``."""


class LogProbOutput(_Outputs):
    """What :func:`lp_kernels.linear_logprob` and :func:`lp_kernels.vocab_parallel_logprob` return.

    A named triple ``(logprob, entropy, lse)`` (it unpacks as one) with the ``extras=``
    statistics as attributes. Every field has the leading shape of ``targets`` and dtype
    float32 (``is_top1``: bool). Rows whose target is ``ignore_index`` hold 0 (False) in
    every field and receive no gradient.
    """

    log_sum_sq_probs: torch.Tensor | None = None
    """``log sum_v softmax(z)_v^2`` (detached), or None unless asked in ``extras``."""
    mean_logit: torch.Tensor | None = None
    """The mean of ``z`` over the real vocabulary (detached), or None unless asked."""
    is_top1: torch.Tensor | None = None
    """bool: the target is the first column of the row's largest ``z``, or None unless
    asked."""

    def __new__(
        cls,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        *,
        log_sum_sq_probs: torch.Tensor | None = None,
        mean_logit: torch.Tensor | None = None,
        is_top1: torch.Tensor | None = None,
    ) -> LogProbOutput:
        self = super().__new__(cls, logprob, entropy, lse)
        self.log_sum_sq_probs = log_sum_sq_probs
        self.mean_logit = mean_logit
        self.is_top1 = is_top1
        return self


class LossOutput(NamedTuple):
    """What :func:`lp_kernels.linear_logprob_loss` returns.

    ``loss`` is the differentiable fp32 scalar; the per-token fields have the leading
    shape of ``targets``, are float32 and carry no gradient (metrics). Rows whose target
    is ``ignore_index`` hold 0 in every per-token field and add nothing to ``loss``.
    """

    loss: torch.Tensor
    """``sum_n loss_fn(...)[n]`` over the rows that are not ignored (fp32, 0-d)."""
    token_loss: torch.Tensor
    """Each row's ``loss_fn`` value (detached)."""
    logprob: torch.Tensor
    """``log softmax(z)[target]`` (detached), as :class:`LogProbOutput`'s."""
    entropy: torch.Tensor | None
    """The entropy of ``softmax(z)`` (detached), or None when it was not computed."""
    lse: torch.Tensor
    """``logsumexp(z)`` (detached)."""


class DivergenceOutput(NamedTuple):
    """What :func:`lp_kernels.linear_divergence` and
    :func:`lp_kernels.vocab_parallel_divergence` return: each field float32 with the
    leading shape of the student's input, 0 on rows outside ``mask``."""

    divergence: torch.Tensor
    """The per-row divergence of the call's ``kind`` (differentiable into the student)."""
    student_entropy: torch.Tensor
    """``-sum p log p`` of the student's distribution (detached)."""
    teacher_entropy: torch.Tensor
    """``-sum q log q`` of the teacher's distribution (detached)."""


class TopkDivergenceOutput(NamedTuple):
    """What :func:`lp_kernels.linear_topk_divergence` returns: ``[*]`` float32 each, 0 on
    masked rows, the same on every rank."""

    divergence: torch.Tensor
    """The divergence of the ``kind`` and ``tail`` asked (differentiable)."""
    student_mass: torch.Tensor | None
    """``sum_S p``: the student's full-vocabulary probability of the k ids (detached);
    None for ``tail="renormalize"``, which never computes the log-sum-exp."""
    teacher_mass: torch.Tensor
    """``sum_S exp(teacher_logprobs)`` (detached)."""


class DivergenceLossOutput(NamedTuple):
    """What :func:`lp_kernels.linear_divergence_loss` returns: ``loss`` a differentiable
    fp32 scalar, the per-row fields ``[*]`` fp32 without gradient, 0 outside ``mask``."""

    loss: torch.Tensor
    """``sum_n weights[n] divergence[n]`` (fp32, 0-d)."""
    divergence: torch.Tensor
    """Each row's divergence (detached)."""
    student_entropy: torch.Tensor
    """``-sum p log p`` of the student's distribution (detached)."""
    teacher_entropy: torch.Tensor
    """``-sum q log q`` of the teacher's distribution (detached)."""


@dataclass(frozen=True)
class LogprobParams:
    """Resolved, validated options of one call (internal; built by the public functions)."""

    transform: LogitTransform
    """The map from a raw logit to the softmax argument (``core.transform``)."""
    ignore_index: int
    """Target value marking rows that produce zeros and no gradient."""
    return_entropy: bool
    """Compute the entropy and its gradient."""
    return_lse: bool
    """Return the log-sum-exp (a gradient reaches it only when it is returned)."""
    vocab_start: int
    """Global token id of this rank's first weight row (0 without tensor parallelism)."""
    vocab_size: int
    """Real global vocabulary; ids >= vocab_size are padding and never enter the softmax."""
    chunk_size: int
    """Token rows per step of the torch paths (a memory knob). A row's results do not
    depend on it on CPU; on CUDA cuBLAS picks kernels by shape, so the deterministic
    mode takes it from the tile (the same on every layout), never from the shard."""
    tp_group: Any = None
    """The ``torch.distributed`` group the vocabulary is sharded over, or None."""
    tp_size: int = 1
    """Number of ranks in ``tp_group`` (1 without it)."""
    reduce_grad_hidden: bool = True
    """Sum ``grad_hidden`` over ``tp_group`` in backward; False returns this rank's partial."""
    max_v_local: int = 0
    """Rows of the largest shard in ``tp_group`` (sizes the per-split statistics exchange)."""
    shard_starts: tuple[int, ...] = (0,)
    """Global start of every rank's shard, in rank order."""
    shard_sizes: tuple[int, ...] = ()
    """Rows of every rank's shard, in rank order."""
    tp_rank: int = 0
    """This rank's index in ``tp_group``."""
    deterministic: bool = False
    """Tensor-parallel invariant mode (see lp_kernels.backends.torch.deterministic)."""
    extras: tuple[str, ...] = ()
    """The ``extras=`` statistics asked for (``core.extras.EXTRAS`` order); computed in the
    forward without gradient."""
    deterministic_tile: int = 128
    """Width of the global vocabulary tiles of ``deterministic=True`` (a multiple of 128):
    the unit of the forward's ordered merge and of grad_hidden's fixed-point sum."""

    def tile_ownership(self) -> TileOwnership:
        """This rank's :class:`~lp_kernels.distributed.halo.TileOwnership`
        (``deterministic=True``)."""
        sizes = self.shard_sizes or (self.vocab_size,)
        return tile_ownership(
            self.shard_starts, sizes, self.vocab_size, self.deterministic_tile, self.tp_rank
        )

    def local_real_columns(self, v_local: int) -> int:
        """How many of this rank's ``v_local`` weight rows are real (below ``vocab_size``)."""
        return max(0, min(v_local, self.vocab_size - self.vocab_start))
