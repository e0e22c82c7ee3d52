"""The fixed-point GEMM's rounding (lp_kernels.backends.triton.fixed_point), on edge values."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tfix = pytest.importorskip("lp_kernels.backends.triton.fixed_point")


@triton.jit
def _round_kernel(y_ptr, r_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    tl.store(r_ptr + o, tfix.round_to_int64(y), mask=m)


def test_round_to_int64_on_edge_values(device):
    """The fixed-point GEMM's conversion gives exactly round(y), ties to even: ties, powers
    of two around 2^21, 2^22, 2^23, 2^42, negatives, tiny values and magnitudes up to the
    fixed-point bound 2^60."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("the kernel runs under the interpreter on CPU and compiled on CUDA")
    edges = [0.0, 0.5, 1.5, 2.5, -0.5, -1.5, 1e-30, -3e-39, 0.49999997, 8388607.5]
    for k in (21, 22, 23, 41, 42, 43, 59):
        p = 2.0**k
        edges += [p, -p, p + 2.0 ** max(k - 23, -1), p * 1.5, -(p * 1.75)]
    edges += [2.0**21 + 0.5, 2.0**21 + 1.5, -(2.0**22 + 0.5), 2.0**22 + 1.5]  # ties
    edges += [2.0**41 + 2.0**17, -(2.0**42 - 2.0**18), 2.0**60 - 2.0**36]
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(400, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-10, 60, (400,), generator=gen).double()
    )
    y = torch.cat([torch.tensor(edges, dtype=torch.float64), rand]).float().to(device)
    r = torch.empty(y.shape, dtype=torch.int64, device=device)
    block = triton.next_power_of_2(y.numel())
    _round_kernel[(1,)](y, r, y.numel(), BLOCK=block)
    expected = torch.round(y.double()).long()  # exact: every fp32 of |y| < 2^63 is a double
    assert torch.equal(r, expected)
