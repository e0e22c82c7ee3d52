"""The choice of a backend (and the one place lp reads ``TRITON_INTERPRET``).

- ``torch`` (:mod:`lp_kernels.backends.torch`): chunked torch ops, on every device.
- ``triton`` (:mod:`lp_kernels.backends.triton`): the fused kernels, on CUDA; on CPU only
  under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from lp_kernels.backends.torch.deterministic import LinearLogprobTorchDeterministic
from lp_kernels.backends.torch.linear import LinearLogprobTorch


def triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    """Whether the triton package is installed (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(
    backend: str, device: torch.device, *, deterministic: bool = False
) -> type[torch.autograd.Function]:
    """The autograd Function for ``backend``. Errors inside a backend propagate; no fallback."""
    if backend == "auto":
        use_triton = (
            device.type == "cuda"
            and triton_importable()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
        backend = "triton" if use_triton else "torch"
    if backend == "torch":
        return LinearLogprobTorchDeterministic if deterministic else LinearLogprobTorch
    if not triton_importable():
        raise RuntimeError("backend='triton' needs the triton package (it ships with CUDA torch)")
    if not (device.type == "cuda" or (device.type == "cpu" and triton_interpreting())):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}); on CPU it runs only under "
            "TRITON_INTERPRET=1 (tests). Use backend='torch' or 'auto'"
        )
    # imported here: triton is optional, and importing it costs time
    if deterministic:
        from lp_kernels.backends.triton.deterministic import LinearLogprobTritonDeterministic

        return LinearLogprobTritonDeterministic
    from lp_kernels.backends.triton.function import LinearLogprobTriton

    return LinearLogprobTriton
