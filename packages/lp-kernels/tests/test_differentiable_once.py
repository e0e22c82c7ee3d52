"""lp's ops are differentiable once: asking for a graph of a backward is a clear error.

``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty) and an upstream
gradient that itself requires grad would otherwise get a gradient whose second-order part
is silently zero. Every backward of every backend, both modes, and
``vocab_parallel_logprob`` raise ``RuntimeError`` naming the limit.
"""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_logprob, vocab_parallel_logprob

N, H, V = 6, 16, 300
MATCH = "lp's ops are differentiable once"


def _linear(backend, deterministic, device):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(device).requires_grad_()
    w = torch.randn(V, H, generator=g).to(device).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    out = linear_logprob(
        h, w, t, return_entropy=True, return_lse=True, backend=backend,
        deterministic=deterministic, deterministic_tile=128 if deterministic else None,
    )  # fmt: skip
    return out, (h, w)


def _logits(deterministic, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, V, generator=g).to(device).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    return vocab_parallel_logprob(x, t, return_entropy=True, deterministic=deterministic), (x,)


def _cases(backend, deterministic, device):
    yield _linear(backend, deterministic, device)
    if backend == "torch":
        yield _logits(deterministic, device)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_create_graph_raises(backend, deterministic, device):
    for out, inputs in _cases(backend, deterministic, device):
        loss = out.logprob.sum() + out.entropy.sum()
        with pytest.raises(RuntimeError, match=MATCH):
            torch.autograd.grad(loss, inputs[0], create_graph=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_upstream_gradient_requiring_grad_raises(backend, deterministic, device):
    for out, inputs in _cases(backend, deterministic, device):
        upstream = torch.randn(N, device=device, requires_grad=True)
        with pytest.raises(RuntimeError, match=MATCH):
            torch.autograd.grad(out.logprob, inputs, grad_outputs=upstream)


def test_first_order_gradient_unchanged(device):
    """The guard reads only grad mode and flags: a plain backward gives the same bits."""
    out, (h, w) = _linear("torch", False, device)
    gh, gw = torch.autograd.grad(out.logprob.sum(), (h, w), retain_graph=True)
    gh2, gw2 = torch.autograd.grad(out.logprob.sum(), (h, w))
    assert torch.equal(gh, gh2) and torch.equal(gw, gw2)
    assert not gh.requires_grad
