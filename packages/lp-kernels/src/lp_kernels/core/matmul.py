"""GEMMs with fp32 results from fp32/bf16/fp16 operands, and scratch allocation.

Precision policy (both backends): logits come out of the GEMM in fp32 (bf16/fp16
operands, fp32 accumulation, fp32 result; never rounded to the input dtype), and
all softmax math is fp32. The two gradient GEMMs take ``d_logits`` rounded to the
input dtype (as every bf16 training stack does, the materialized path included)
and accumulate in fp32. On CUDA this uses cuBLAS' fp32-output half GEMMs
(``out_dtype``); elsewhere the half operands are widened to fp32 first, which is
exact (a bf16/fp16 value and the product of two are exactly representable in
fp32), so the arithmetic is the same up to summation order.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float32, *_HALF)


def common_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` in one GEMM dtype: the wider of the two (``torch.promote_types``: fp32
    with bf16 or fp16, fp32 for bf16 with fp16), the narrower cast up by a differentiable
    copy, so each gradient comes back in its input's own dtype. Never a cast down.
    Unchanged when the dtypes agree or either is not one lp takes, or the devices differ
    (the argument checks name those)."""
    if a.dtype == b.dtype or a.dtype not in _FLOATS or b.dtype not in _FLOATS:
        return a, b
    if a.device != b.device:
        return a, b
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _native_fp32_out(a: torch.Tensor) -> bool:
    return a.device.type == "cuda" and a.dtype in _HALF and hasattr(torch.ops.aten.mm, "dtype")


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as fp32 with fp32 accumulation; ``a`` and ``b`` share a dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if _native_fp32_out(a):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def addmm_f32_(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool = True
) -> torch.Tensor:
    """``acc += a @ b`` with ``acc`` fp32, in place; ``accumulate=False``: ``acc = a @ b``
    (beta = 0: acc's old contents, NaN included, are never read)."""
    beta = 1 if accumulate else 0
    if a.dtype == torch.float32:
        return acc.addmm_(a, b, beta=beta)
    if _native_fp32_out(a) and hasattr(torch.ops.aten.addmm, "dtype_out"):
        return torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float(), beta=beta)


class _Scratch:
    """Allocates outputs and scratch; tests switch on NaN poisoning to catch unwritten elements."""

    poison: bool = False

    def empty(self, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device):
        if self.poison and dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)


scratch = _Scratch()
