"""The fixed-point GEMM's rounding primitives (triton_deterministic), on edge values."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tdet = pytest.importorskip("lp_kernels.backends.triton_deterministic")


@triton.jit
def _round_both_kernel(y_ptr, q_ptr, r_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    q1, q2, q3 = tdet._split_rint(y)
    q = (q1.to(tl.int64) << 42) + (q2.to(tl.int64) << 21) + q3.to(tl.int64)
    tl.store(q_ptr + o, q, mask=m)
    tl.store(r_ptr + o, tdet._round_to_int64(y, INTERPRET), mask=m)


def test_split_rounding_equals_round_to_int64(device):
    """The experimental split rounding (FIXED_CONVERT="split": three int32 parts from fp32
    magic-constant adds) and the one-instruction conversion both give exactly round(y),
    ties to even: ties, powers of two around each split point, negatives, tiny values and
    magnitudes up to the fixed-point bound 2^60."""
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
    q = torch.empty(y.shape, dtype=torch.int64, device=device)
    r = torch.empty_like(q)
    block = triton.next_power_of_2(y.numel())
    _round_both_kernel[(1,)](y, q, r, y.numel(), BLOCK=block, INTERPRET=device == "cpu")
    expected = torch.round(y.double()).long()  # exact: every fp32 of |y| < 2^63 is a double
    assert torch.equal(q, expected)
    assert torch.equal(r, expected)
