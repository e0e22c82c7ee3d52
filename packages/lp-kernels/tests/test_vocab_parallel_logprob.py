"""vocab_parallel_logprob (logits input): parity, padding, the streaming backward buffer."""

from __future__ import annotations

import pytest
import torch

from lp_kernels import vocab_parallel_logprob
from lp_kernels.core.matmul import scratch
from lp_testing import DTYPES, assert_close, assert_zero, make_problem, reference_from_logits


def _logits(n, v, dtype, device, seed, pad=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, v + pad, generator=g) * 3
    x[:, v:] += 50.0  # padded columns would dominate the softmax if they leaked in
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("tol", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("n", "v", "pad", "chunk"), [(1, 31, 0, None), (37, 1009, 15, 5), (128, 257, 0, 128)]
)
def test_parity(n, v, pad, chunk, tol, device):
    logits = _logits(n, v, tol.dtype, device, seed=n, pad=pad).requires_grad_()
    targets = make_problem(n, 4, v, seed=n, ignore_frac=0.2, device=device).targets
    g = torch.randn(3, n, generator=torch.Generator().manual_seed(1)).to(device)
    out = vocab_parallel_logprob(
        logits,
        targets,
        temperature=0.8,
        vocab_size=v,
        return_entropy=True,
        return_lse=True,
        chunk_size=chunk,
    )
    (out.logprob * g[0] + out.entropy * g[1] + out.lse * g[2]).sum().backward()
    truth = reference_from_logits(
        logits,
        targets,
        grad_logprob=g[0],
        grad_entropy=g[1],
        grad_lse=g[2],
        temperature=0.8,
        vocab_size=v,
    )
    # Inputs are the logits themselves, so fp32 math on them is exact up to fp32 rounding.
    for name in ("logprob", "entropy", "lse"):
        assert_close(getattr(out, name), truth[name], rtol=2e-6, atol=2e-5, name=f"{name}[{tol}]")
    assert logits.grad.dtype == tol.dtype
    eps = torch.finfo(tol.dtype).eps
    scale = float(truth["grad_logits"].abs().max())
    assert_close(
        logits.grad,
        truth["grad_logits"],
        rtol=2 * eps,
        atol=8 * eps * scale,
        name=f"grad_logits[{tol}]",
    )
    assert_zero(logits.grad[:, v:], name="grad of padded columns")
    assert_zero(logits.grad[targets == -100], name="grad of ignored rows")


def test_backward_buffer_is_fully_written(monkeypatch):
    """Prime N and chunk, NaN-poisoned allocations: every element of the gradient is written."""
    monkeypatch.setattr(scratch, "poison", True)
    n, v, pad = 97, 211, 13
    logits = _logits(n, v, torch.float32, "cpu", seed=5, pad=pad).requires_grad_()
    targets = make_problem(n, 4, v, seed=5, ignore_frac=0.1).targets
    out = vocab_parallel_logprob(logits, targets, vocab_size=v, chunk_size=7, return_entropy=True)
    (out.logprob + out.entropy).sum().backward()
    assert torch.isfinite(logits.grad).all(), "unwritten (NaN) elements in the gradient buffer"
    assert torch.isfinite(out.logprob).all() and torch.isfinite(out.entropy).all()
    truth = reference_from_logits(
        logits, targets, grad_logprob=torch.ones(n), grad_entropy=torch.ones(n), vocab_size=v
    )
    assert_close(logits.grad, truth["grad_logits"], rtol=1e-5, atol=1e-6, name="grad_logits")


def test_leading_dims(device):
    logits = _logits(6, 50, torch.float32, device, seed=2).reshape(2, 3, 50).requires_grad_()
    targets = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(0)).to(device)
    out = vocab_parallel_logprob(logits, targets)
    assert out.logprob.shape == (2, 3)
    out.logprob.sum().backward()
    truth = reference_from_logits(logits, targets, grad_logprob=torch.ones(2, 3, device=device))
    assert_close(logits.grad, truth["grad_logits"], rtol=1e-5, atol=1e-6, name="grad_logits")


@pytest.mark.gpu
def test_streaming_backward_peak_memory():
    """Backward peak above the saved state: the gradient plus O(one fp32 chunk), no list + cat."""
    n, v, chunk = 4096, 32000, 256
    logits = _logits(n, v, torch.float32, "cuda", seed=0).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    out = vocab_parallel_logprob(logits, targets, chunk_size=chunk)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.logprob.sum().backward()
    torch.cuda.synchronize()
    grad_bytes = logits.numel() * 4
    chunk_bytes = chunk * v * 4
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= grad_bytes + 3 * chunk_bytes + (8 << 20), (extra, grad_bytes, chunk_bytes)
