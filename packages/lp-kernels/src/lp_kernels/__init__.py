"""lp-kernels: fused LM-head log-probs, entropy and log-sum-exp without materialized logits.

Public API:

- :func:`linear_logprob` — from hidden states ``[*, H]`` and the LM-head weight (or
  its tensor-parallel vocabulary shard) ``[V_local, H]``.
- :func:`vocab_parallel_logprob` — the same contract for callers that already hold
  ``[*, V_local]`` logits.
- :class:`LogProbOutput` — the ``(logprob, entropy, lse)`` result.
- :func:`deterministic_tile_for` — the widest ``deterministic_tile`` for TP degrees up to
  a maximum (``deterministic=True``).
"""

from lp_kernels._dist import clear_layout_cache, deterministic_tile_for
from lp_kernels._types import LogProbOutput
from lp_kernels.linear_logprob import linear_logprob
from lp_kernels.vocab_parallel_logprob import vocab_parallel_logprob

__all__ = [
    "LogProbOutput",
    "clear_layout_cache",
    "deterministic_tile_for",
    "linear_logprob",
    "vocab_parallel_logprob",
]
__version__ = "0.1.0"
