"""linear_divergence on a CUDA GPU: both backends (the triton one compiled, not interpreted)
against the fp64 reference, in fp32 and bf16, every kind and the logit options of both
sides; reruns bitwise equal; deterministic=True equal to itself across chunkings of the
vocabulary into tiles it does not depend on. Marked ``gpu`` (``nox -s gpu-tp``)."""

from __future__ import annotations

import pytest
import torch

from lp_kernels import linear_divergence
from lp_testing import assert_close, reference_divergence

pytestmark = pytest.mark.gpu

N, H, HT, V, V_PAD = 301, 64, 96, 5003, 5120
OPTIONS = [
    {},
    {"softcap": 5.0, "logit_scale": 0.9, "teacher_softcap": 8.0, "temperature": 1.3},
]


def _problem(dtype: torch.dtype, bias: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    data = {
        "hidden": randn(N, H),
        "weight": randn(V_PAD, H, scale=0.2),
        "teacher_hidden": randn(N, HT),
        "teacher_weight": randn(V_PAD, HT, scale=0.2),
        "mask": torch.rand(N, generator=g, device="cuda") > 0.2,
        "upstream": torch.randn(N, generator=g, device="cuda"),
    }
    if bias:
        data["bias"], data["teacher_bias"] = randn(V_PAD, scale=0.3), randn(V_PAD, scale=0.3)
    return data


def _run(data: dict, **options) -> tuple:
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"].clone().requires_grad_()
    b = data["bias"].clone().requires_grad_() if "bias" in data else None
    out = linear_divergence(
        h, w, data["teacher_hidden"], data["teacher_weight"], mask=data["mask"], bias=b,
        teacher_bias=data.get("teacher_bias"), vocab_size=V, **options,
    )  # fmt: skip
    (out.divergence * data["upstream"]).sum().backward()
    return (*out, h.grad, w.grad, None if b is None else b.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("opts", range(len(OPTIONS)), ids=["plain", "options"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_fp64_and_reruns_bitwise(dtype, kind, opts, backend):
    options = {"kind": kind, "beta": 0.3, "backend": backend, **OPTIONS[opts]}
    data = _problem(dtype, bias=opts == 1)
    got = _run(data, **options)
    again = _run(data, **options)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True) if a is not None)
    truth = reference_divergence(
        data["hidden"], data["weight"], data["teacher_hidden"], data["teacher_weight"],
        mask=data["mask"], bias=data.get("bias"), teacher_bias=data.get("teacher_bias"),
        vocab_size=V, upstream=data["upstream"],
        **{k: v for k, v in options.items() if k != "backend"},
    )  # fmt: skip
    names = ["divergence", "student_entropy", "teacher_entropy"]
    names += ["grad_hidden", "grad_weight", "grad_bias"]
    # fp32: a few 1e-6 of the largest entry; bf16: the gradient GEMMs' rounding of d l
    rtol = 2e-5 if dtype == torch.float32 else 2e-2
    for name, actual in zip(names, got, strict=True):
        if actual is None:
            continue
        scale = truth[name].abs().max().clamp_min(1e-30)
        err = ((actual.double() - truth[name]).abs().max() / scale).item()
        assert err < rtol, f"{name}: {err:.2e} of its largest entry"
    assert torch.all(got[3][~data["mask"]] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deterministic_matches_default_path_and_reruns(backend):
    data = _problem(torch.bfloat16, bias=True)
    options = {"kind": "jsd", "beta": 0.4, "backend": backend, "softcap": 6.0}
    det = _run(data, deterministic=True, **options)
    again = _run(data, deterministic=True, **options)
    assert all(torch.equal(a, b) for a, b in zip(det, again, strict=True) if a is not None)
    default = _run(data, **options)
    for name, a, b in zip(["divergence", "grad_hidden"], det[0:4:3], default[0:4:3], strict=True):
        assert_close(a.double(), b.double(), rtol=1e-2, atol=1e-4, name=name)
