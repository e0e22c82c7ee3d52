"""lp-kernels: fused LM-head log-probs, entropy and log-sum-exp without materialized logits.

Public API:

- :func:`linear_logprob` — from hidden states ``[*, H]`` and the LM-head weight (or
  its tensor-parallel vocabulary shard) ``[V_local, H]``.
- :func:`vocab_parallel_logprob` — the same contract for callers that already hold
  ``[*, V_local]`` logits.
- :func:`linear_logprob_loss` — a per-token loss of those log-probs (RL objectives,
  ready-made in :mod:`lp_kernels.losses`) with its gradients finished in the forward:
  three GEMMs per step instead of four.
- :func:`linear_divergence` — distillation: the forward KL, reverse KL or generalized JSD
  between a student head and a teacher head, per row, over the whole vocabulary;
  :func:`vocab_parallel_divergence` from the student's logits and the teacher's log-probs;
  :class:`DivergenceOutput` their result; :func:`linear_divergence_loss` a weighted sum of
  the divergence with its gradients finished in the forward (:class:`DivergenceLossOutput`).
- :func:`linear_topk_divergence` — distillation from a teacher's top-k payload (ids and
  log-probs; renormalized, with a tail bucket, unnormalized or truncated), per row
  (:class:`TopkDivergenceOutput`).
- :class:`LogProbOutput` — the ``(logprob, entropy, lse)`` result; :class:`LossOutput`
  the loss op's.
- :func:`default_deterministic_tile` and :func:`deterministic_tile_for` — the tile
  width of ``deterministic=True``: ``linear_logprob``'s default, and the widest tile
  whose grid holds the shards of TP degrees up to a maximum.
"""

from lp_kernels.core.tiles import default_deterministic_tile, deterministic_tile_for
from lp_kernels.core.types import (
    DivergenceLossOutput,
    DivergenceOutput,
    LogProbOutput,
    LossOutput,
    TopkDivergenceOutput,
)
from lp_kernels.distributed.layout import clear_layout_cache
from lp_kernels.divergence import (
    linear_divergence,
    linear_divergence_loss,
    linear_topk_divergence,
    vocab_parallel_divergence,
)
from lp_kernels.ops import linear_logprob, linear_logprob_loss, vocab_parallel_logprob

__all__ = [
    "DivergenceLossOutput",
    "DivergenceOutput",
    "LogProbOutput",
    "LossOutput",
    "TopkDivergenceOutput",
    "clear_layout_cache",
    "default_deterministic_tile",
    "deterministic_tile_for",
    "linear_divergence",
    "linear_divergence_loss",
    "linear_logprob",
    "linear_logprob_loss",
    "linear_topk_divergence",
    "vocab_parallel_divergence",
    "vocab_parallel_logprob",
]
__version__ = "0.1.0"
