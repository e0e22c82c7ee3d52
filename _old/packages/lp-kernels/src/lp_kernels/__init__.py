"""lp-kernels: fused LM-head log-probs, entropy and log-sum-exp without materialized logits.

Public API:

- :func:`linear_logprob` — from hidden states ``[*, H]`` and the LM-head weight (or
  its tensor-parallel vocabulary shard) ``[V_local, H]``.
- :func:`vocab_parallel_logprob` — the same contract for callers that already hold
  ``[*, V_local]`` logits.
- :class:`LogProbOutput` — the ``(logprob, entropy, lse)`` result.
- :func:`default_deterministic_tile` and :func:`deterministic_tile_for` — the tile
  width of ``deterministic=True``: ``linear_logprob``'s default, and the widest tile
  whose grid holds the shards of TP degrees up to a maximum.
"""

from lp_kernels._types import LogProbOutput
from lp_kernels.distributed.layout import clear_layout_cache
from lp_kernels.linear_logprob import linear_logprob
from lp_kernels.tiles import default_deterministic_tile, deterministic_tile_for
from lp_kernels.vocab_parallel_logprob import vocab_parallel_logprob

__all__ = [
    "LogProbOutput",
    "clear_layout_cache",
    "default_deterministic_tile",
    "deterministic_tile_for",
    "linear_logprob",
    "vocab_parallel_logprob",
]
__version__ = "0.1.0"
