"""The choice of a backend.

- ``torch`` (:mod:`lp_kernels.backends.torch`): chunked torch ops, on every device.
- ``triton`` (:mod:`lp_kernels.backends.triton`): the fused kernels, on CUDA; on CPU only
  under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
"""

from __future__ import annotations

import torch

from lp_kernels.backends.platform import triton_importable, triton_interpreting
from lp_kernels.backends.torch.deterministic import LinearLogprobTorchDeterministic
from lp_kernels.backends.torch.linear import LinearLogprobTorch
from lp_kernels.backends.torch.loss import LinearLogprobLossTorch


def concrete_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for ``backend`` (``"auto"``: triton on CUDA devices of
    compute capability >= 8.0 when triton is installed, else torch), checked for
    ``device``. Errors inside a backend propagate; no fallback."""
    if backend == "auto":
        use_triton = (
            device.type == "cuda"
            and triton_importable()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
        return "triton" if use_triton else "torch"
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError(
                "backend='triton' needs the triton package (it ships with CUDA torch)"
            )
        if not (device.type == "cuda" or (device.type == "cpu" and triton_interpreting())):
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {device}); on CPU it runs only "
                "under TRITON_INTERPRET=1 (tests). Use backend='torch' or 'auto'"
            )
    return backend


def resolve_backend(
    backend: str, device: torch.device, *, deterministic: bool = False
) -> type[torch.autograd.Function]:
    """The autograd Function of ``linear_logprob`` for ``backend``."""
    backend = concrete_backend(backend, device)
    if backend == "torch":
        return LinearLogprobTorchDeterministic if deterministic else LinearLogprobTorch
    # imported here: triton is optional, and importing it costs time
    if deterministic:
        from lp_kernels.backends.triton.deterministic import LinearLogprobTritonDeterministic

        return LinearLogprobTritonDeterministic
    from lp_kernels.backends.triton.linear import LinearLogprobTriton

    return LinearLogprobTriton


def resolve_loss_backend(backend: str, device: torch.device) -> type[torch.autograd.Function]:
    """The autograd Function of ``linear_logprob_loss`` (default mode) for ``backend``."""
    if concrete_backend(backend, device) == "torch":
        return LinearLogprobLossTorch
    from lp_kernels.backends.triton.loss import LinearLogprobLossTriton

    return LinearLogprobLossTriton
