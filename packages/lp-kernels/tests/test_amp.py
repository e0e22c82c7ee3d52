"""lp's ops under ``torch.autocast``: inputs cast as ``F.linear``'s would be; lp's own
math untouched, forward and backward (``lp_kernels.core.amp``).

Without the autocast guard, autocast casts the torch backend's internal fp32 GEMMs
down to bf16 (measured on CPU: logprob off by 3e-2 with fp32 inputs); these tests fail
that way.
"""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_logprob, vocab_parallel_logprob
from lp_testing import assert_bitwise_equal, make_problem

NAMES = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")


def _step(hidden, weight, targets, g, *, autocast=None, hidden_dtype=None, **kwargs):
    """Outputs and gradients of a per-token loss; ``autocast`` = its dtype, or None."""
    h = hidden.detach().clone().to(hidden_dtype or hidden.dtype).requires_grad_()
    w = weight.detach().clone().requires_grad_()
    device_type = hidden.device.type
    with torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
        out = linear_logprob(h, w, targets, return_entropy=True, return_lse=True, **kwargs)
        # the backward inside the region too: on CPU it then runs with autocast on
        (g * out.logprob - 0.25 * out.entropy + g.flip(0) * out.lse).sum().backward()
    return (*out, h.grad, w.grad)


def _dtypes(device):
    return [torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


def _case(device, deterministic, dtype):
    p = make_problem(
        41, 32, 1031, dtype=dtype, device=device, seed=4, ignore_frac=0.1, padded_vocab=1152
    )
    g = torch.linspace(-1.0, 1.0, p.targets.numel(), device=device)
    kwargs = dict(vocab_size=p.vocab_size, temperature=0.8, deterministic=deterministic)
    if deterministic:
        kwargs["deterministic_tile"] = 256
    return p, g, kwargs


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_fp32_inputs_are_cast_like_linear(device, backend, deterministic):
    """fp32 hidden and weight under autocast give the bits of lp on the cast inputs,
    and fp32 gradients equal to that run's, widened (the casts' backward)."""
    p, g, kwargs = _case(device, deterministic, torch.float32)
    for dtype in _dtypes(device):
        cast = _step(
            p.hidden.to(dtype), p.weight.to(dtype), p.targets, g, backend=backend, **kwargs
        )
        auto = _step(p.hidden, p.weight, p.targets, g, autocast=dtype, backend=backend, **kwargs)
        assert auto[3].dtype == auto[4].dtype == torch.float32  # the leaves' own dtype
        for name, a, b in zip(NAMES, auto, cast, strict=True):
            assert_bitwise_equal(a, b.float(), f"{name} under {dtype} autocast")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_low_precision_inputs_keep_their_bits(device, backend, deterministic):
    """Inputs already in the autocast dtype: autocast changes no bit, backward included."""
    p, g, kwargs = _case(device, deterministic, torch.bfloat16)
    plain = _step(p.hidden, p.weight, p.targets, g, backend=backend, **kwargs)
    auto = _step(
        p.hidden, p.weight, p.targets, g, autocast=torch.bfloat16, backend=backend, **kwargs
    )
    for name, a, b in zip(NAMES, auto, plain, strict=True):
        assert_bitwise_equal(a, b, name)


def test_mixed_dtypes_follow_autocast(device):
    """bf16 hidden with an fp32 weight: lp's rule without autocast (the wider dtype, fp32,
    hidden cast up), F.linear's cast with it."""
    p, g, kwargs = _case(device, False, torch.float32)
    mixed = _step(p.hidden, p.weight, p.targets, g, hidden_dtype=torch.bfloat16, **kwargs)
    wide = _step(p.hidden.bfloat16().float(), p.weight, p.targets, g, **kwargs)
    assert mixed[3].dtype == torch.bfloat16 and mixed[4].dtype == torch.float32
    for name, a, b in zip(NAMES, mixed, wide, strict=True):
        assert_bitwise_equal(a, b.to(a.dtype), f"{name} without autocast")
    auto = _step(
        p.hidden,
        p.weight,
        p.targets,
        g,
        hidden_dtype=torch.bfloat16,
        autocast=torch.bfloat16,
        **kwargs,
    )
    cast = _step(p.hidden.bfloat16(), p.weight.bfloat16(), p.targets, g, **kwargs)
    for name, a, b in zip(NAMES, auto, cast, strict=True):
        assert_bitwise_equal(a, b.to(a.dtype), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_op_ignores_autocast(device, dtype):
    """vocab_parallel_logprob takes the logits in their own dtype, fp32 math, autocast or not."""
    p = make_problem(41, 32, 1031, dtype=dtype, device=device, seed=5, padded_vocab=1152)
    logits = (p.hidden.float() @ p.weight.float().T).to(dtype)
    g = torch.linspace(-1.0, 1.0, p.targets.numel(), device=device)

    def run(enabled):
        x = logits.detach().clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=enabled):
            out = vocab_parallel_logprob(
                x, p.targets, vocab_size=p.vocab_size, return_entropy=True, return_lse=True
            )
            (g * out.logprob - 0.25 * out.entropy + g.flip(0) * out.lse).sum().backward()
        return (*out, x.grad)

    for name, a, b in zip(
        ("logprob", "entropy", "lse", "grad_logits"), run(True), run(False), strict=True
    ):
        assert_bitwise_equal(a, b, name)
