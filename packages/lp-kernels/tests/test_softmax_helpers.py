"""The triton backend's jit helpers of the logit transform, the online softmax and d_logits
(``lp_kernels.backends.triton.softmax``), each through a small test kernel, against fp64 on
awkward inputs: a vocabulary that is no multiple of the block, large, tiny and non-finite
logits, every combination of temperature, logit_scale and softcap, with and without
entropy. The full kernels are tested through the public ops; these pin the helpers' own
contracts."""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.softmax import (
    cap_constants,
    cap_value,
    dlogits_block,
    softmax_finish,
    softmax_update,
    transform_args,
)
from lp_kernels.core.transform import LogitTransform

ROWS, BLOCK_V = 16, 64
TRANSFORMS = {
    "plain": LogitTransform(),
    "temperature": LogitTransform(temperature=0.7),
    "scale": LogitTransform(logit_scale=0.25),
    "cap": LogitTransform(softcap=3.0),
    "all": LogitTransform(temperature=1.3, softcap=5.0, logit_scale=2.0),
}


def _on(device: str) -> None:
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("the helpers run under the interpreter on CPU, compiled on CUDA")


def _z64(l: torch.Tensor, t: LogitTransform) -> torch.Tensor:
    """The transform in fp64: ``c tanh(s l / c) / T``; the cap keeps an infinite logit."""
    x = l.double() * (t.logit_scale or 1.0)
    if t.softcap is not None:
        x = torch.where(torch.isinf(x), x, t.softcap * torch.tanh(x / t.softcap))
    return x * t.inv_temperature


def _logits(v: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw fp32 logits ``[ROWS, v]`` at several scales (row r spans about 4^(r % 6) / 64) and
    a target per row."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.tensor([4.0 ** (r % 6) / 64 for r in range(ROWS)])[:, None]
    l = torch.randn(ROWS, v, generator=g) * spread
    targets = torch.randint(0, v, (ROWS,), generator=g)
    return l.to(device), targets.to(device)


@triton.jit
def _stats_kernel(
    l_ptr,
    t_ptr,
    out_ptr,
    V,
    scale,
    cap,
    inv_cap,
    inv_t,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """One program: the rows' partial ``(m, s, a, t)`` over ``V`` columns in blocks."""
    o_r = tl.arange(0, ROWS)
    b_cols = tl.arange(0, BLOCK_V)
    k_e, k_z, k_a, k_t = cap_constants(cap, inv_cap, inv_t)
    b_m = tl.full([ROWS], float("-inf"), tl.float32)
    b_s = tl.zeros([ROWS], tl.float32)
    b_a = tl.zeros([ROWS], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        m_v = (v0 + b_cols) < V
        b_l = tl.load(l_ptr + o_r[:, None] * V + v0 + b_cols[None, :], mask=m_v[None, :])
        b_m, b_s, b_a = softmax_update(
            b_m, b_s, b_a, b_l, None, b_cols, v0, V, scale, inv_t, k_e, k_z, k_a, k_t,
            ENTROPY=ENTROPY, CAP=CAP, SCALE=SCALE,
        )  # fmt: skip
    b_lt = tl.load(l_ptr + o_r * V + tl.load(t_ptr + o_r))
    b_m, b_t = softmax_finish(b_m, b_lt, scale, cap, inv_cap, inv_t, k_z, ENTROPY, CAP, SCALE)
    tl.store(out_ptr + o_r * 4, b_m)
    tl.store(out_ptr + o_r * 4 + 1, b_s)
    tl.store(out_ptr + o_r * 4 + 2, b_a)
    tl.store(out_ptr + o_r * 4 + 3, b_t)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("entropy", [False, True], ids=["lp", "ent"])
@pytest.mark.parametrize("v", [1, 63, 200])
def test_online_softmax_partials(name, entropy, v, device):
    """softmax_update over the blocks of a row, then softmax_finish: the row's ``m`` (the
    maximum of z), ``s = sum e^(z - m)``, ``a = sum e^(z - m) (z - m)`` (with entropy) and the
    target's z, whatever the transform; the last block's columns past V are masked."""
    _on(device)
    t = TRANSFORMS[name]
    l, targets = _logits(v, device, seed=v)
    out = torch.empty(ROWS, 4, device=device)
    _stats_kernel[(1,)](
        l, targets, out, v, ROWS=ROWS, BLOCK_V=BLOCK_V, ENTROPY=entropy, **transform_args(t)
    )
    z = _z64(l, t)
    m = z.amax(1)
    e = torch.exp(z - m[:, None])
    want = [m, e.sum(1), (e * (z - m[:, None])).sum(1), z.gather(1, targets[:, None])[:, 0]]
    m_got, s_got, a_got, t_got = out.double().unbind(1)
    # z to a few fp32 ulps of the row's largest |z| (the capped terms' absolute error)
    eps = 8 * 2.0**-24 * (z.abs().amax(1) + (t.softcap or 0.0) * t.inv_temperature + 1)
    s_w, a_w = want[1], want[2]
    assert torch.all((m_got - want[0]).abs() <= eps), (m_got - want[0]).abs().max()
    assert torch.all((s_got - s_w).abs() <= (2 * eps + 1e-6) * s_w), (s_got - s_w).abs().max()
    assert torch.all((t_got - want[3]).abs() <= eps), (t_got - want[3]).abs().max()
    if entropy:
        tol = 1e-6 * a_w.abs() + 2 * eps * (s_w + a_w.abs())
        assert torch.all((a_got - a_w).abs() <= tol), (a_got - a_w).abs().max()
    else:
        assert torch.equal(a_got, torch.zeros_like(a_got))  # returned as it came


def test_online_softmax_keeps_non_finite_logits(device):
    """``-inf`` logits (a bias' masked columns) add nothing, also where they fill whole
    blocks before the first finite logit; a row all ``-inf`` reports ``m = -inf, s = 0``; a
    ``+inf`` logit makes ``m = +inf``; NaN stays NaN."""
    _on(device)
    v = 3 * BLOCK_V + 5
    l = torch.randn(ROWS, v).to(device)
    l[0, 5] = float("-inf")
    l[1, :] = float("-inf")
    l[2, 3] = float("inf")
    l[3, 9] = float("nan")
    l[4, : 2 * BLOCK_V + 1] = float("-inf")  # two whole blocks and one column of the third
    targets = torch.full((ROWS,), v - 1, dtype=torch.long, device=device)
    for t in (TRANSFORMS["plain"], TRANSFORMS["all"]):
        for entropy in (False, True):
            out = torch.empty(ROWS, 4, device=device)
            _stats_kernel[(1,)](
                l, targets, out, v, ROWS=ROWS, BLOCK_V=BLOCK_V, ENTROPY=entropy,
                **transform_args(t),
            )  # fmt: skip
            for row in (0, 4):
                z = _z64(l[row], t)
                eps = 8 * 2.0**-24 * (z[z > -math.inf].abs().max() + (t.softcap or 0.0) + 1)
                s_want = torch.exp(z - z.amax()).sum()
                assert abs(out[row, 1].double() - s_want) <= (2 * eps + 1e-6) * s_want, row
                assert abs(out[row, 0].double() - z.amax()) <= eps, row
            assert out[1, 0] == float("-inf") and out[1, 1] == 0
            assert out[2, 0] == float("inf")
            assert torch.isnan(out[3, 1])


@triton.jit
def _cap_value_kernel(l_ptr, out_ptr, slope_ptr, cap, inv_cap, N: tl.constexpr):
    o = tl.arange(0, N)
    value, slope = cap_value(tl.load(l_ptr + o), cap, inv_cap)
    tl.store(out_ptr + o, value)
    tl.store(slope_ptr + o, slope)


def test_cap_value_accuracy_and_pass_through(device):
    """``c tanh(l / c)`` and its slope ``1 - tanh^2`` to a few fp32 ulps across the series'
    bound (``|l / c| = 1/8``), tiny and huge logits, signed zeros; infinities and NaN pass
    through as the logit."""
    _on(device)
    cap = 7.0
    edge = cap / 8
    values = [0.0, -0.0, 1e-30, -1e-20, 1e-4, edge * 0.999, edge, edge * 1.001, -edge, 0.5]
    values += [3.0, -6.9, 7.0, 20.0, -60.0, 1e4, -3e38, float("inf"), float("-inf"), float("nan")]
    n = triton.next_power_of_2(len(values))
    l = torch.tensor(values + [0.0] * (n - len(values)), device=device)
    value, slope = torch.empty_like(l), torch.empty_like(l)
    _cap_value_kernel[(1,)](l, value, slope, cap, 1.0 / cap, N=n)
    th = torch.tanh(l.double() / cap)
    finite = torch.isfinite(l)
    err = (value.double() - cap * th).abs()[finite]
    assert torch.all(err <= 4 * 2.0**-24 * (cap * th).abs()[finite] + 1e-38)
    assert torch.all(torch.signbit(value[:2]) == torch.signbit(l[:2]))  # +0.0 and -0.0
    assert torch.all((slope.double() - (1 - th * th)).abs()[finite] <= 2e-7)
    assert value[-3 - (n - len(values))] == float("inf")
    assert value[-2 - (n - len(values))] == float("-inf")
    assert torch.isnan(value[len(values) - 1])


@triton.jit
def _dlogits_kernel(
    l_ptr,
    t_ptr,
    lse_ptr,
    glp_ptr,
    glse_ptr,
    mean_ptr,
    gent_ptr,
    out_ptr,
    V,
    scale,
    cap,
    inv_cap,
    inv_t,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    o_r = tl.arange(0, ROWS)
    b_cols = tl.arange(0, BLOCK_V)
    b_t = tl.load(t_ptr + o_r)
    b_lse = tl.load(lse_ptr + o_r)
    b_glp = tl.load(glp_ptr + o_r)
    b_glse = tl.load(glse_ptr + o_r)
    b_mean = tl.load(mean_ptr + o_r)
    b_gent = tl.load(gent_ptr + o_r)
    for v0 in range(0, V, BLOCK_V):
        m_v = (v0 + b_cols) < V
        p = o_r[:, None] * V + v0 + b_cols[None, :]
        b_l = tl.load(l_ptr + p, mask=m_v[None, :], other=0.0)
        b_dl = dlogits_block(
            b_l, b_t, b_lse, b_glp, b_glse, b_mean, b_gent, v0, scale, cap, inv_cap, inv_t,
            BLOCK_V, ENTROPY, HAS_LP, CAP, SCALE,
        )  # fmt: skip
        tl.store(out_ptr + p, b_dl, mask=m_v[None, :])


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("entropy", [False, True], ids=["lp", "ent"])
@pytest.mark.parametrize("has_lp", [False, True], ids=["lse", "lp+lse"])
def test_dlogits_block_is_the_gradient(name, entropy, has_lp, device):
    """dlogits_block: the gradient of ``g_lp logprob + g_ent entropy + g_lse lse`` with
    respect to the raw logits (fp64 autograd through the transform), over blocks that cut
    the vocabulary (V = 150 in blocks of 64)."""
    _on(device)
    t, v = TRANSFORMS[name], 150
    l, targets = _logits(v, device, seed=11)
    g = torch.Generator().manual_seed(5)
    g_lp, g_ent, g_lse = (torch.randn(ROWS, generator=g).to(device) for _ in range(3))
    if not has_lp:
        g_lp = torch.zeros_like(g_lp)
    if not entropy:
        g_ent = torch.zeros_like(g_ent)
    l64 = l.double().requires_grad_()
    z = _z64(l64, t)
    lse = torch.logsumexp(z, 1)
    p = torch.exp(z - lse[:, None])
    mean = (p * z).sum(1)
    logprob = z.gather(1, targets[:, None])[:, 0] - lse
    loss = (g_lp.double() * logprob + g_ent.double() * (lse - mean) + g_lse.double() * lse).sum()
    (want,) = torch.autograd.grad(loss, l64)
    out = torch.empty_like(l)
    _dlogits_kernel[(1,)](
        l, targets, lse.detach().float(), g_lp, g_lse, mean.detach().float(), g_ent, out, v,
        ROWS=ROWS, BLOCK_V=BLOCK_V, ENTROPY=entropy, HAS_LP=has_lp, **transform_args(t),
    )  # fmt: skip
    err = (out.double() - want).abs().max()
    assert float(err) <= 1e-5 * float(want.abs().max()) + 1e-7, float(err)


@pytest.mark.parametrize(
    "t, want",
    [
        (LogitTransform(), {"scale": 1.0, "cap": 1.0, "inv_t": 1.0, "SCALE": False, "CAP": False}),
        (
            LogitTransform(temperature=0.5, softcap=30.0, logit_scale=0.125),
            {"scale": 0.125, "cap": 30.0, "inv_t": 2.0, "SCALE": True, "CAP": True},
        ),
        (LogitTransform.checked(logit_scale=1.0), {"scale": 1.0, "SCALE": False}),  # no step
    ],
)
def test_transform_args(t, want):
    """The kernels' arguments from the host's spec: absent steps as 1.0 with their flag off."""
    got = transform_args(t)
    assert got["inv_cap"] == 1.0 / got["cap"] and not math.isnan(got["inv_t"])
    assert {k: got[k] for k in want} == want
