"""The fixed-point grad_hidden of deterministic=True (lp_kernels.core.fixed_point)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lp_kernels.core import fixed_point as _fixed_point
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import global_abs_max
from lp_testing import assert_bitwise_equal, make_problem, reference_all


def _params(temperature=1.0):
    return LogprobParams(
        transform=LogitTransform(temperature=temperature), ignore_index=-100,
        return_entropy=True, return_lse=True, vocab_start=0, vocab_size=0, chunk_size=16,
    )  # fmt: skip


def test_exponent_bounds_the_true_gradient_with_headroom():
    """|grad_hidden| * 2^e stays below 2^60 (int64 holds 2^63) and uses most of the range."""
    for seed, t in ((0, 1.0), (1, 0.3), (2, 3.0)):
        p = make_problem(23, 16, 300, seed=seed, ignore_frac=0.2, temperature=t)
        g = torch.linspace(-2, 2, p.n, dtype=torch.float64)
        ignored = p.targets == p.ignore_index
        g_lp, g_ent, g_lse = (torch.where(ignored, 0.0, x).float() for x in (g, g.flip(0), 0.5 * g))
        truth = reference_all(
            p.hidden, p.weight, p.targets, grad_logprob=g_lp, grad_entropy=g_ent,
            grad_lse=g_lse, temperature=t,
        )  # fmt: skip
        lse = truth["lse"].float()
        w_abs = global_abs_max(p.weight, None, 1)
        e, bad = _fixed_point.row_exponents(
            p.hidden, w_abs, lse, ignored, g_lp, g_ent, g_lse, _params(t)
        )
        assert not bad.any()
        scaled = truth["grad_hidden"].abs().amax(dim=1) * torch.exp2(e)
        assert float(scaled.max()) < 2.0**60
        live = ~ignored
        assert float(scaled[live].min()) > 2.0**30  # the bound is loose, but not absurdly


def test_conversion_in_row_blocks_matches_one_block(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**62), 2**62, (37, 11), generator=gen)
    e = torch.randint(-60, 60, (37,), generator=gen).double()
    bad = torch.zeros(37, dtype=torch.bool)
    bad[5] = True
    whole = _fixed_point.from_fixed_point(acc, e, bad, torch.float32)
    monkeypatch.setattr(_fixed_point, "CONVERT_ELEMENTS", 30)  # blocks of 2 rows
    blocks = _fixed_point.from_fixed_point(acc, e, bad, torch.float32)
    assert torch.isnan(whole[5]).all() and torch.isnan(blocks[5]).all()
    keep = ~bad
    assert torch.equal(whole[keep], blocks[keep])
    expected = (acc.double() * torch.exp2(-e)[:, None]).float()
    assert torch.equal(whole[keep], expected[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_conversion_matches_torch_conversion(dtype, device, backend):
    """The triton backend's one-pass conversion gives the torch backend's bits, NaN rows
    included, over the whole range of exponents and of int64 values."""
    if backend != "triton":
        pytest.skip("the triton backend's conversion kernel")
    from lp_kernels.backends.triton.fixed_point import from_fixed_point

    gen = torch.Generator().manual_seed(1)
    n, h = 131, 301  # past one block of rows and of columns, neither a multiple
    acc = torch.randint(-(2**62), 2**62, (n, h), generator=gen)
    acc[:, :7] = torch.randint(-1000, 1000, (n, 7), generator=gen)  # small integers too
    e = torch.randint(-126, 127, (n,), generator=gen).double()
    bad = torch.rand(n, generator=gen) < 0.1
    want = _fixed_point.from_fixed_point(acc, e, bad, dtype)
    inv = torch.exp2(-e).to(device)
    got = from_fixed_point(acc.to(device), inv, bad.to(device), dtype).cpu()
    # NaN rows: NaN, whatever its payload (CUDA and CPU round a float32 NaN to different
    # half-precision NaN bits); every other element: the same bits
    assert bool(bad.any()) and torch.isnan(got[bad]).all() and torch.isnan(want[bad]).all()
    assert_bitwise_equal(got[~bad], want[~bad], f"conversion to {dtype}")


@pytest.mark.parametrize(
    "case",
    ["plain", "bias-softcap", "no-entropy", "lse-only", "int32-real-id", "inf-weight", "nan-bias"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_row_scales_match_row_exponents(case, dtype, device, backend):
    """The triton backend's one-launch row scales (``fixed_point.row_scales``) give
    ``row_exponents``' exponents and NaN rows exactly: 2^e (fp32), 2^-e (fp64) and the bad
    rows, for rows with NaN or infinite hidden states, NaN upstream gradients on ignored
    rows (read raw, zeroed by the kernel), a non-finite lse, N not a multiple of the row
    block and H not one of the column block, the bias and the cap in the bound, and a
    non-finite head."""
    if backend != "triton":
        pytest.skip("the triton backend's row-scales kernel")
    from lp_kernels.backends.triton.fixed_point import row_scales
    from lp_kernels.core.stats import ignored_rows, masked_upstream

    gen = torch.Generator().manual_seed(3)
    n, h, v = 37, 70, 50
    ignore = 7 if case == "int32-real-id" else -100
    hidden = (torch.randn(n, h, generator=gen) * 3).to(dtype)
    # rows 0, 5, 10, ... are ignored
    hidden[1, 5] = float("nan")
    hidden[2, 69] = float("inf")
    hidden[3] = 0.0  # no logit term in the bound
    hidden[10, 0] = float("nan")  # ignored: not a bad row
    weight = (torch.randn(v, h, generator=gen) / 8).to(dtype)
    if case == "inf-weight":
        weight[3, 4] = float("-inf")
    bias = torch.randn(v, generator=gen) if case in ("bias-softcap", "nan-bias") else None
    if case == "nan-bias":
        bias[9] = float("nan")
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[targets == ignore] = ignore + 1  # only rows 0, 5, 10, ... hold the real id
    targets[::5] = ignore
    if case == "int32-real-id":
        targets = targets.int()
    lse = torch.randn(n, generator=gen) * 5
    lse[4] = float("inf")  # a live row
    lse[5] = float("nan")  # an ignored row (5 is a multiple of 5): not bad
    g = [torch.randn(n, generator=gen) * s for s in (1.0, 0.3, 2.0)]
    g[0][3] = 0.0
    g[1][6] = 0.0
    for x in g:
        x[10] = float("nan")  # row 10 is ignored: zeroed, never read as NaN
        x[11] = 1e30  # huge: e at the clamp's bottom
    if case == "no-entropy":
        g[1] = None
    if case == "lse-only":
        g[0] = g[1] = None
    transform = LogitTransform(temperature=0.7, softcap=30.0 if case == "bias-softcap" else None)
    p = LogprobParams(
        transform=transform, ignore_index=ignore, return_entropy=True, return_lse=True,
        vocab_start=0, vocab_size=v, chunk_size=16,
    )  # fmt: skip
    ignored = ignored_rows(targets, ignore)
    masked = masked_upstream(ignored, *g)
    w_abs = global_abs_max(weight, None, 1)
    b_abs = None if bias is None else global_abs_max(bias, None, 1)
    e, bad = _fixed_point.row_exponents(
        hidden.float() if dtype == torch.float32 else hidden, w_abs, lse, ignored, *masked, p,
        b_abs=b_abs,
    )  # fmt: skip
    dev = torch.device(device)

    def on(x):
        return None if x is None else x.to(dev)

    got = row_scales(
        on(hidden), on(weight), on(bias), on(lse), on(targets), tuple(on(x) for x in g), p
    )
    assert_bitwise_equal(got.scale.cpu(), torch.exp2(e).float(), "2^e")
    assert_bitwise_equal(got.inv.cpu(), torch.exp2(-e), "2^-e")
    assert torch.equal(got.bad.cpu() != 0, bad), (got.bad.cpu(), bad)
    if case in ("inf-weight", "nan-bias"):  # every row
        assert bool(bad.all())
    else:
        assert bool(bad[[1, 2, 4]].all()) and not bool(bad[[0, 3, 5, 10, 11]].any())
        assert bool((e[11] == _fixed_point.E_MIN) | (e[11] < 0))


@pytest.mark.parametrize("case", ["finite", "nan"])
def test_head_abs_max_sees_every_earlier_write(case, device, backend):
    """``deterministic=True``'s ``max |W|`` on one GPU is read on a side stream
    (``fixed_point.HeadAbsMax``) beside the backward's first launches: it must see every
    write queued to W before it on the caller's stream (here a non-default one, held back
    by a sleeping kernel, so that the write is still pending when the read is queued), and
    the caller's stream must wait for it; NaN propagates. On CPU it is read at once."""
    if backend != "triton":
        pytest.skip("the triton backend's deterministic mode")
    from lp_kernels.backends.triton.fixed_point import HeadAbsMax
    from lp_kernels.distributed.collectives import global_abs_max

    w = torch.zeros(4099, 257, dtype=torch.bfloat16, device=device)
    value = float("nan") if case == "nan" else -5.0
    stream = torch.cuda.Stream() if device == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None:
            torch.cuda._sleep(50_000_000)  # ~20-50 ms of GPU time before the write
        w[4098, 256] = value
        got = HeadAbsMax(w[:4099]).get()
        out = got * 2  # queued on the caller's stream after the wait
    if stream is not None:
        torch.cuda.synchronize()
    want = global_abs_max(w, None, 1)
    assert got.shape == (1,) and got.dtype == torch.float64
    if case == "nan":
        assert bool(torch.isnan(got).all()) and bool(torch.isnan(want))
    else:
        assert float(got) == 5.0 == float(want) and float(out) == 10.0
