"""Test-only patches that let a tiny megatron-core ``GPTModel`` run on CPU over gloo.

TEST SUPPORT ONLY: these patches replace functions of ``torch.cuda`` and of
megatron-core for the lifetime of a :class:`MegatronCpuPatches` (or between
:meth:`~MegatronCpuPatches.apply` and :meth:`~MegatronCpuPatches.restore`). Apply them
inside each spawned rank, never at import, never in a production process.

The patches (see ENVIRONMENT.md, "megatron-core on CPU (gloo)"):

1. ``torch.cuda.current_device`` returns ``"cpu"``: Megatron allocates buffers and
   parameters on ``torch.cuda.current_device()``.
2. Megatron's CUDA RNG tracker works on the CPU generator: ``torch.cuda.get_rng_state``
   / ``torch.cuda.manual_seed`` and megatron's private ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` are pointed at the CPU generator, so
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work.
3. Sequence parallel only: megatron's torch norm wrapper (``WrappedTorchNorm``, which
   refuses ``sequence_parallel``) builds a plain ``torch.nn.LayerNorm`` / ``RMSNorm``
   whose parameters carry ``sequence_parallel = config.sequence_parallel`` (the tag
   Megatron's gradient finalization uses to all-reduce them over the TP group).
4. Pipeline schedules and DDP gradient sync only (``comm=True``, with the CPU patches).
   What Megatron's communication code expects of CUDA:
   - the pipeline schedules allocate their token counter with
     ``torch.zeros(..., device="cuda")``;
   - the point-to-point code calls ``torch.cuda.synchronize()``;
   - a tied output layer on the last stage is moved with ``Tensor.cuda()`` before its
     first all-reduce;
   - ``DistributedDataParallel``'s gradient sync waits on ``torch.cuda.current_stream()``.

   Under the patch, the schedules module sees a ``torch`` whose ``zeros`` maps
   ``"cuda"`` to the CPU; ``torch.cuda.synchronize`` does nothing; ``Tensor.cuda`` returns
   the tensor itself; and ``torch.cuda.current_stream()`` returns a stream stand-in whose
   waits do nothing (CPU work is synchronous).

Example::

    with MegatronCpuPatches():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(123)
        model = GPTModel(...)
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["MegatronCpuPatches"]

_MISSING = object()


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _plain_norm_new(
    cls: type,
    config: Any,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
) -> torch.nn.Module:
    """``WrappedTorchNorm.__new__`` without the sequence-parallel refusal; tags the params."""
    if config.normalization == "LayerNorm":
        norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
    elif config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
    else:
        raise ValueError(f"test patch supports LayerNorm and RMSNorm, not {config.normalization}")
    for param in norm.parameters():
        param.sequence_parallel = bool(config.sequence_parallel)
    return norm


class _TorchOnCpu:
    """``torch`` as megatron's pipeline schedules see it under patch 4."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuStream:
    """``torch.cuda.current_stream()`` under patch 4: waits are no-ops on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    wait_event = wait_stream = synchronize = _no_op


def _same_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


class MegatronCpuPatches:
    """Context manager (or explicit ``apply()`` / ``restore()``) for the CPU test patches.

    Args:
        sequence_parallel_norm: also apply patch 3 (the norm swap). It only matters for
            models built with ``sequence_parallel=True``; it is harmless otherwise.
        cpu: apply patches 1 and 2 (CPU device and RNG). ``cpu=False`` keeps only patch 3,
            for GPU test ranks without transformer-engine or apex, whose local layer spec
            otherwise refuses sequence parallelism.
        comm: with ``cpu``, also apply patch 4, for Megatron's pipeline schedules and
            DistributedDataParallel's gradient sync.
    """

    def __init__(
        self, sequence_parallel_norm: bool = True, *, cpu: bool = True, comm: bool = False
    ) -> None:
        self.sequence_parallel_norm = sequence_parallel_norm
        self.cpu = cpu
        self.comm = comm
        self._saved: list[tuple[Any, str, Any]] = []

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def apply(self) -> MegatronCpuPatches:
        """Install the patches; returns ``self``. Raises if already applied."""
        if self._saved:
            raise RuntimeError("MegatronCpuPatches already applied; call restore() first")
        if self.cpu:
            random = importlib.import_module("megatron.core.tensor_parallel.random")
            self._set(torch.cuda, "current_device", lambda: "cpu")
            self._set(torch.cuda, "get_rng_state", _cpu_get_rng_state)
            self._set(torch.cuda, "manual_seed", _cpu_manual_seed)
            self._set(random, "_get_cuda_rng_state", _cpu_get_rng_state)
            self._set(random, "_set_cuda_rng_state", _cpu_set_rng_state)
        if self.cpu and self.comm:
            schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
            self._set(schedules, "torch", _TorchOnCpu())
            self._set(torch.cuda, "synchronize", _no_op)
            self._set(torch.Tensor, "cuda", _same_tensor)
            self._set(torch.cuda, "current_stream", _CpuStream)
        if self.sequence_parallel_norm:
            torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
            self._set(torch_norm.WrappedTorchNorm, "__new__", staticmethod(_plain_norm_new))
        return self

    def restore(self) -> None:
        """Undo every patch, in reverse order."""
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def __enter__(self) -> MegatronCpuPatches:
        return self.apply()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()
