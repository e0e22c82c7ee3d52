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
- :mod:`lp_testing.plugin`: pytest markers ``gpu``/``multigpu`` and fixtures.

The names below are imported on first use (PEP 562), so that importing the pytest plugin
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lp_testing.compare import (
        ErrorReport,
        assert_bitwise_equal,
        assert_close,
        assert_zero,
        error_report,
    )
    from lp_testing.dist import (
        InsufficientDevicesError,
        RankError,
        gloo_cuda_via_host,
        run_ranks,
        set_forkserver_preload,
        spawn,
    )
    from lp_testing.megatron_cpu import MegatronCpuPatches
    from lp_testing.problems import (
        AWKWARD_SHAPES,
        DTYPES,
        Problem,
        Shape,
        Tolerance,
        make_problem,
        nan_tensor,
        random_upstream,
        shard,
        split_vocab,
        tolerance,
    )
    from lp_testing.reference import (
        materialized_baseline,
        materialized_baseline_from_logits,
        reference_all,
        reference_chunked,
        reference_from_logits,
        reference_grads,
        reference_outputs,
    )
    from lp_testing.state import preserved_torch_globals

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ["ErrorReport", "assert_bitwise_equal", "assert_close", "assert_zero", "error_report"],
        "compare",
    ),
    **dict.fromkeys(
        [
            "InsufficientDevicesError",
            "RankError",
            "gloo_cuda_via_host",
            "run_ranks",
            "set_forkserver_preload",
            "spawn",
        ],
        "dist",
    ),
    "MegatronCpuPatches": "megatron_cpu",
    **dict.fromkeys(
        [
            "AWKWARD_SHAPES",
            "DTYPES",
            "Problem",
            "Shape",
            "Tolerance",
            "make_problem",
            "nan_tensor",
            "random_upstream",
            "shard",
            "split_vocab",
            "tolerance",
        ],
        "problems",
    ),
    **dict.fromkeys(
        [
            "materialized_baseline",
            "materialized_baseline_from_logits",
            "reference_all",
            "reference_chunked",
            "reference_from_logits",
            "reference_grads",
            "reference_outputs",
        ],
        "reference",
    ),
    "preserved_torch_globals": "state",
}

__all__ = [
    "AWKWARD_SHAPES",
    "DTYPES",
    "ErrorReport",
    "InsufficientDevicesError",
    "MegatronCpuPatches",
    "Problem",
    "RankError",
    "Shape",
    "Tolerance",
    "assert_bitwise_equal",
    "assert_close",
    "assert_zero",
    "error_report",
    "gloo_cuda_via_host",
    "make_problem",
    "materialized_baseline",
    "materialized_baseline_from_logits",
    "nan_tensor",
    "preserved_torch_globals",
    "random_upstream",
    "reference_all",
    "reference_chunked",
    "reference_from_logits",
    "reference_grads",
    "reference_outputs",
    "run_ranks",
    "set_forkserver_preload",
    "shard",
    "spawn",
    "split_vocab",
    "tolerance",
]
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
