"""lp-megatron: the lp fused log-prob head for a megatron-core ``GPTModel``.

Public API:

- :func:`install_logprob_head` — make the model return hidden states where it returned
  logits, and get a :class:`LogprobHead`.
- :class:`LogprobHead` — ``head.logprobs(output, labels)``, ``head.remove()``; a context
  manager.
- :class:`LogprobHeadConfig` — the options (a frozen dataclass).

``LogprobHead`` and ``install_logprob_head`` are imported on first use (PEP 562), so that
building a config does not import megatron-core (~9 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lp_megatron.config import LogprobHeadConfig

if TYPE_CHECKING:
    from lp_megatron.head import LogprobHead, install_logprob_head

__all__ = ["LogprobHead", "LogprobHeadConfig", "install_logprob_head"]
__version__ = "0.1.0"

_LAZY = {"LogprobHead": "head", "install_logprob_head": "head"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lp_megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lp_megatron.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
