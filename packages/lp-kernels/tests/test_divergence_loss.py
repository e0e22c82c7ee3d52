"""linear_divergence_loss: the weighted sum of linear_divergence's divergence with its
gradients finished in the forward equals the composed path (the op, the weighted sum,
autograd) within fp32 rounding, on both backends, under gloo TP 2, with masks holding NaN
rows; with deterministic=True it is the composed path, bit for bit; bad weights and a
second backward raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lp_kernels import linear_divergence, linear_divergence_loss
from lp_testing import run_ranks

N, H, HT, V = 37, 24, 40, 1009


def _data(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(N, generator=g) > 0.3
    hidden = torch.randn(N, H, generator=g)
    hidden[~mask] = float("nan")
    return {
        "hidden": hidden,
        "weight": torch.randn(V, H, generator=g) * 0.4,
        "bias": torch.randn(V, generator=g) * 0.2,
        "teacher_hidden": torch.randn(N, HT, generator=g),
        "teacher_weight": torch.randn(V, HT, generator=g) * 0.4,
        "mask": mask,
        "weights": mask.float() / mask.sum(),
    }


def _grads(data: dict, fused: bool, rows=slice(None), **options) -> tuple:
    """``(loss, divergence, grad_hidden, grad_weight, grad_bias)`` after ``(2.5 loss)
    .backward()``; ``rows``: this rank's vocabulary rows."""
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"][rows].clone().requires_grad_()
    b = data["bias"][rows].clone().requires_grad_()
    heads = (h, w, data["teacher_hidden"], data["teacher_weight"][rows])
    options |= {"mask": data["mask"], "bias": b, "softcap": 6.0, "temperature": 0.9}
    if fused:
        out = linear_divergence_loss(*heads, weights=data["weights"], **options)
        loss, div = out.loss, out.divergence
    else:
        div = linear_divergence(*heads, **options).divergence
        loss = (div * data["weights"]).sum()
    (2.5 * loss).backward()
    return loss.detach(), div.detach(), h.grad, w.grad, b.grad


def _assert_close(fused: tuple, composed: tuple) -> None:
    names = ("loss", "divergence", "grad_hidden", "grad_weight", "grad_bias")
    for name, a, b in zip(names, fused, composed, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err < 5e-6, f"{name}: {err:.1e}"


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_equals_composed(kind, backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    data = _data()
    options = {"kind": kind, "beta": 0.3, "chunk_size": 16, "backend": backend}
    fused = _grads(data, True, **options)
    _assert_close(fused, _grads(data, False, **options))
    assert torch.equal(fused[2][~data["mask"]], torch.zeros(int((~data["mask"]).sum()), H))


def test_deterministic_is_the_composed_path_bitwise():
    data = _data(1)
    options = {"kind": "jsd", "beta": 0.4, "deterministic": True, "backend": "torch"}
    for a, b in zip(_grads(data, True, **options), _grads(data, False, **options), strict=True):
        assert torch.equal(a, b)


def _tp_rank(rank, world, data):
    rows = slice(0, 512) if rank == 0 else slice(512, V)
    options = {"kind": "reverse_kl", "tp_group": dist.group.WORLD, "vocab_start": rows.start}
    return _grads(data, True, rows, **options), _grads(data, False, rows, **options)


def test_tensor_parallel_fused_equals_composed():
    data = _data(2)
    for fused, composed in run_ranks(_tp_rank, 2, data, timeout=240):
        _assert_close(fused, composed)


@pytest.mark.parametrize(
    ("weights", "exc", "match"),
    [
        (torch.ones(N, dtype=torch.int64), TypeError, "weights must be None or a float tensor"),
        (torch.ones(N + 1), ValueError, "weights must have hidden's leading shape"),
        (torch.ones(N, requires_grad=True), ValueError, "weights requires grad"),
    ],
    ids=["dtype", "shape", "requires-grad"],
)
def test_bad_weights(weights, exc, match):
    data = _data()
    with pytest.raises(exc, match=match):
        linear_divergence_loss(
            data["hidden"], data["weight"], data["teacher_hidden"], data["teacher_weight"],
            weights=weights,
        )  # fmt: skip


def test_second_backward_raises():
    data = _data()
    hidden = torch.randn(N, H, requires_grad=True)
    out = linear_divergence_loss(
        hidden, data["weight"], data["teacher_hidden"], data["teacher_weight"]
    )
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through one call"):
        out.loss.backward()
