"""lp-testing: test support for lp.

- :mod:`lp_testing.dist`: :func:`run_ranks` / :func:`spawn` start gloo (CPU) or NCCL (GPU)
  ranks, return their results, re-raise their tracebacks, turn hangs into timeouts;
  :func:`gloo_cuda_via_host` lets gloo ranks share one GPU (test-only).
- :mod:`lp_testing.problems`: :func:`make_problem`, :func:`split_vocab`, :func:`shard`,
  :data:`AWKWARD_SHAPES`, :data:`DTYPES` (with tolerances).
- :mod:`lp_testing.reference`: fp64 truths (outputs and gradients) and the plain
  materialized-logits baseline.
- :mod:`lp_testing.compare`: :func:`assert_close` (relative to the baseline's error),
  :func:`assert_bitwise_equal`, :func:`assert_zero`, :func:`error_report`.
- :mod:`lp_testing.megatron_cpu`: :class:`MegatronCpuPatches`, the test-only patches that
  run a tiny megatron-core GPTModel on CPU (apply inside each rank).
- :mod:`lp_testing.trainers`: :func:`import_trainer`, a trainer import that skips, or fails
  under ``LP_TRAINERS_REQUIRED=1`` (the adapters nox session).
- :mod:`lp_testing.plugin`: pytest markers ``gpu``/``multigpu`` and fixtures.

The package exports every name in those modules' ``__all__`` (read from their
source); each is imported on first use (PEP 562), so that importing the pytest
plugin does not import torch.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lp_testing.compare import *  # noqa: F403
    from lp_testing.dist import *  # noqa: F403
    from lp_testing.megatron_cpu import *  # noqa: F403
    from lp_testing.problems import *  # noqa: F403
    from lp_testing.reference import *  # noqa: F403
    from lp_testing.state import *  # noqa: F403
    from lp_testing.trainers import *  # noqa: F403

_MODULES = ("compare", "dist", "megatron_cpu", "problems", "reference", "state", "trainers")
"""The submodules whose ``__all__`` names this package exports."""


def _public_names(module: str) -> list[str]:
    """``lp_testing.<module>.__all__``, read from its source without importing it (torch)."""
    source = Path(__file__).with_name(f"{module}.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))  # type: ignore[union-attr, arg-type]
    raise ImportError(f"lp_testing.{module} has no literal __all__")


_EXPORTS: dict[str, str] = {name: module for module in _MODULES for name in _public_names(module)}
"""Exported name -> the submodule that defines it (imported on first use)."""

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lp_testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lp_testing.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
