"""Peak memory of one call above what was allocated before it.

On CUDA, ``torch.cuda.max_memory_allocated`` after a reset. On CPU there is no allocator
counter, so :class:`LiveBytes`, a dispatch mode, tracks the storages that ops allocate
while it is active and keeps their running total's maximum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def is_dense(t: object) -> bool:
    """A strided tensor (one whose storage the tracker can weigh)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages allocated while active (CPU stand-in for max_memory_allocated).

    Every op's outputs whose storage is not one of its inputs' (so views and in-place ops of
    existing tensors are not counted) are tracked by weak reference until freed.

    Example:
        >>> with LiveBytes() as tracker:
        ...     x = torch.ones(1024)
        >>> tracker.peak
        4096
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        seen = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if is_dense(t)}
        for t in tree_leaves(out):
            if is_dense(t) and (storage := t.untyped_storage())._cdata not in seen:
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak memory of one call of ``fn`` above what was allocated before it (bytes).

    ``device``: ``"cuda"`` (the current CUDA device's allocator) or ``"cpu"`` (tracked by
    :class:`LiveBytes`).
    """
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as tracker:
        fn()
    return tracker.peak
