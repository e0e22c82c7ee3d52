"""Save and restore torch's process-global numerics settings around a test.

Tests of determinism and precision flip global switches (float32 matmul precision,
deterministic algorithms, the default dtype, thread count); a test that leaves one flipped
silently changes every test after it. :func:`preserved_torch_globals` snapshots them and
puts back, on exit, each one that changed.

torch >= 2.9 has two TF32 APIs (``allow_tf32`` flags and ``fp32_precision`` strings) and
refuses to read a legacy flag after the new API was used. So the new-API strings are saved
when they exist, the legacy flags only otherwise, and nothing unchanged is written back.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["preserved_torch_globals"]


def _attr(path: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """Getter and setter for an attribute ``torch.<path>``, or None if it does not exist."""
    owner_path, _, leaf = path.rpartition(".")
    try:
        owner = operator.attrgetter(owner_path)(torch)
        getattr(owner, leaf)
    except (AttributeError, RuntimeError):
        return None
    return (lambda: getattr(owner, leaf)), (lambda value: setattr(owner, leaf, value))


def _knobs() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Every global this module restores, in restore order, as name -> (get, set)."""
    knobs: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "float32_matmul_precision": (
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
        "deterministic_algorithms": (
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
    }
    new_api = hasattr(torch.backends, "fp32_precision")
    paths = (
        [
            "backends.fp32_precision",
            "backends.cuda.matmul.fp32_precision",
            "backends.cudnn.fp32_precision",
            "backends.cudnn.conv.fp32_precision",
            "backends.cudnn.rnn.fp32_precision",
        ]
        if new_api
        else ["backends.cuda.matmul.allow_tf32", "backends.cudnn.allow_tf32"]
    )
    paths += [
        "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        "backends.cudnn.deterministic",
        "backends.cudnn.benchmark",
        "utils.deterministic.fill_uninitialized_memory",
    ]
    for path in paths:
        accessors = _attr(path)
        if accessors is not None:
            knobs[path] = accessors
    return knobs


@contextlib.contextmanager
def preserved_torch_globals() -> Iterator[None]:
    """Restore torch's global numerics settings on exit (each one only if it changed).

    Covers float32 matmul precision, TF32 / reduced-precision-reduction flags,
    deterministic algorithms (and warn-only), cuDNN deterministic/benchmark,
    ``fill_uninitialized_memory``, the default dtype and the intra-op thread count.

    Example:
        >>> with preserved_torch_globals():
        ...     torch.use_deterministic_algorithms(True)
        >>> torch.are_deterministic_algorithms_enabled()
        False
    """
    knobs = _knobs()
    saved: dict[str, Any] = {}
    for name, (get, _) in knobs.items():
        with contextlib.suppress(RuntimeError):  # a legacy flag after new-API use
            saved[name] = get()
    try:
        yield
    finally:
        for name, value in saved.items():
            get, put = knobs[name]
            with contextlib.suppress(RuntimeError):
                if get() == value:
                    continue
            put(value)
