"""lp-hf: the lp fused log-prob head for Hugging Face ``transformers`` causal LMs.

Public API:

- :func:`install_logprob_head` — make the model's output layer compute lp's per-token
  log-probs (and entropy, log-sum-exp) instead of ``[B, T, V]`` logits; returns a
  :class:`LogprobHead`.
- :class:`LogprobHead` — ``head.logprobs(input_ids, labels, attention_mask, ...)``,
  ``head.paused()``, ``head.remove()``; a context manager.
- :class:`HeadConfig` — the options (a frozen dataclass).
- :func:`model_logit_transform` — the model's final-logit softcap and scale that the head
  computes (:class:`FinalLogitTransform`; the supported classes: :mod:`lp_hf.final_logits`);
  :func:`model_softcap` — its softcap alone.
- :func:`next_token_targets`, :func:`slice_to_keep` — the label shift and masking the
  head applies, for callers that build their own targets.
- :func:`distill_divergence` — a student's divergence to a teacher (forward / reverse
  KL, JSD) per position, from both models' hidden states without logits
  (:class:`DistillOutput`).
"""

from __future__ import annotations

from lp_hf.distill import DistillOutput, distill_divergence
from lp_hf.final_logits import FinalLogitTransform, model_logit_transform, model_softcap
from lp_hf.head import HeadConfig, LogprobHead, install_logprob_head
from lp_hf.targets import next_token_targets, slice_to_keep
from lp_kernels import LogProbOutput

__all__ = [
    "DistillOutput",
    "FinalLogitTransform",
    "HeadConfig",
    "LogProbOutput",
    "LogprobHead",
    "distill_divergence",
    "install_logprob_head",
    "model_logit_transform",
    "model_softcap",
    "next_token_targets",
    "slice_to_keep",
]
__version__ = "0.1.0"
