"""lp-megatron: the lp fused log-prob head for a megatron-core ``GPTModel``.

Public API:

- :func:`install_logprob_head` — make the model return hidden states where it returned
  logits, and get a :class:`LogprobHead`.
- :class:`LogprobHead` — ``head.logprobs(output, labels)``, ``head.remove()``; a context
  manager.
- :class:`LogprobHeadConfig` — the options (a frozen dataclass).
- :func:`output_processor` — for megatron-core >= 0.18's hook:
  ``model(..., labels=labels, output_processor=output_processor,
  output_processor_context=OutputContext(...))`` returns the log-probs ``[b, s]``.
- :class:`OutputContext` — its per-call options (a frozen dataclass).

Everything but the config is imported on first use (PEP 562), so that building a config
does not import megatron-core (~9 s) or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lp_megatron.config import LogprobHeadConfig

if TYPE_CHECKING:
    from lp_megatron.context import OutputContext
    from lp_megatron.head import LogprobHead, install_logprob_head
    from lp_megatron.processor import output_processor

__all__ = [
    "LogprobHead",
    "LogprobHeadConfig",
    "OutputContext",
    "install_logprob_head",
    "output_processor",
]
__version__ = "0.1.0"

_LAZY = {
    "LogprobHead": "head",
    "install_logprob_head": "head",
    "OutputContext": "context",
    "output_processor": "processor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lp_megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lp_megatron.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
