"""Model coverage options against fp64: any ``ignore_index``, mixed input dtypes, an
LM-head bias and final-logit softcapping, alone and combined, on both backends (triton
under the interpreter on CPU), under tensor parallelism over gloo and with
``deterministic=True`` bitwise across TP 1 and 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from _parity import check_against_fp64

from lp_kernels import linear_logprob
from lp_testing import (
    RankError,
    assert_bitwise_equal,
    assert_close,
    assert_zero,
    make_problem,
    reference_all,
    run_ranks,
    tolerance,
)

FP32 = tolerance(torch.float32)
BF16 = tolerance(torch.bfloat16)


def _upstream(n: int):
    g = torch.linspace(-1, 1, n)
    return g, g.flip(0), torch.full((n,), 0.3)


def _run(hidden, weight, targets, *, bias=None, device="cpu", **options):
    """Outputs and gradients of one call with every output used (fixed upstream), the inputs
    moved to ``device`` and the results back to the CPU."""
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    bias = None if bias is None else bias.to(device)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    extra = {}
    b = None
    if bias is not None:
        b = bias.detach().clone().requires_grad_()
        extra["bias"] = b
    out = linear_logprob(h, w, targets, return_entropy=True, return_lse=True, **extra, **options)
    g_lp, g_ent, g_lse = (g.to(device) for g in _upstream(targets.numel()))
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    got = {
        "logprob": out.logprob,
        "entropy": out.entropy,
        "lse": out.lse,
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
    }
    if b is not None:
        got["grad_bias"] = b.grad
    return {name: value.cpu() for name, value in got.items()}


def _tp_rank(rank, world, problem, bounds, backend, options, bias=None):
    """One rank of a tensor-parallel call: its shard of the weight (and bias)."""
    start, size = bounds[rank]
    kw = dict(options)
    chunk = kw.pop("vocab_chunk", None)
    config = contextlib.nullcontext()
    if chunk is not None:  # the interpreter's vocabulary chunk
        from lp_kernels.backends.triton.config import config_for, use_config

        base = config_for(problem.hidden.device, problem.hidden.dtype)
        config = use_config(base.replace(backward={"vocab_chunk": chunk}))
    if bias is not None:
        kw["bias"] = bias[start : start + size]
    with config:
        return _run(
            problem.hidden, problem.weight[start : start + size], problem.targets,
            tp_group=dist.group.WORLD, vocab_start=start, backend=backend, **kw,
        )  # fmt: skip


def _tp_gathered(problem, bounds, backend, options, bias=None):
    """Rank 0's outputs and grad_hidden, and the shards' grad_weight (grad_bias) joined."""
    per_rank = run_ranks(_tp_rank, len(bounds), problem, bounds, backend, options, bias)
    for r in range(1, len(bounds)):
        for name in ("logprob", "entropy", "lse", "grad_hidden"):
            assert_bitwise_equal(per_rank[r][name], per_rank[0][name], f"{name} rank {r}")
    got = dict(per_rank[0])
    for name in ("grad_weight", "grad_bias"):
        if name in got:
            got[name] = torch.cat([r[name] for r in per_rank])
    return got


def _check_fp64(got, problem, tol, *, bias=None, softcap=None, names=None):
    g_lp, g_ent, g_lse = _upstream(problem.n)
    extra = {} if bias is None else {"bias": bias}
    if softcap is not None:
        extra["softcap"] = softcap
    truth = reference_all(
        problem.hidden, problem.weight, problem.targets, grad_logprob=g_lp,
        grad_entropy=g_ent, grad_lse=g_lse, **extra, **problem.op_kwargs(),
    )  # fmt: skip
    for name in names or got:
        scale = float(truth[name].abs().max())
        atol = tol * scale + 1e-12  # entropy of a near-one-hot row: ~1e-77 in fp64, 0 in fp32
        assert_close(got[name], truth[name], rtol=tol, atol=atol, name=f"{name} vs fp64")
    ignored = problem.ignored
    for name in ("logprob", "entropy", "lse", "grad_hidden"):
        assert_zero(got[name], where=ignored, name=f"{name} on ignored rows")


# ----------------------------------------------------------------------------- ignore_index


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("ignore_index", [0, 42, 1008], ids=lambda i: f"ii{i}")
def test_ignore_index_may_be_a_real_token_id(ignore_index, deterministic, backend):
    """Rows targeting the id are ignored (zeros, no gradient); the rest match fp64."""
    problem = make_problem(
        37, 64, 1009, ignore_index=ignore_index, ignore_frac=0.25, temperature=0.9, seed=1,
        padded_vocab=1024,
    )  # fmt: skip
    assert int(problem.ignored.sum()) >= 9
    check_against_fp64(
        problem, FP32, entropy=True, lse=True, backend=backend, deterministic=deterministic
    )


def test_ignore_index_real_id_rows_ignored_and_out_of_range_still_checked(backend):
    hidden, weight = torch.randn(6, 16), torch.randn(50, 16)
    targets = torch.tensor([3, 7, 3, 49, 0, 3])
    out = linear_logprob(hidden, weight, targets, ignore_index=3, backend=backend)
    assert out.logprob[[0, 2, 5]].eq(0).all() and out.logprob[[1, 3, 4]].lt(0).all()
    bad = torch.tensor([3, 50, 3, -1, 0, 3])  # 50 and -1 are neither ignored nor ids
    with pytest.raises(ValueError, match=r"2 target\(s\) are outside \[0, 50\)"):
        linear_logprob(hidden, weight, bad, ignore_index=3, backend=backend)
    # an ignore_index no int32 target can equal, and the int64 extremes, are accepted
    t32 = targets.int()
    for ii in (2**40, -(2**63), 2**63 - 1):
        out = linear_logprob(hidden, weight, t32, ignore_index=ii, backend=backend)
        assert out.logprob.lt(0).all()


def test_ignore_index_real_id_tensor_parallel(backend):
    """TP 2 over gloo (both modes) with a real-id ignore_index; deterministic is bitwise
    the single-process result."""
    problem = make_problem(
        29, 24, 1000, ignore_index=600, ignore_frac=0.2, padded_vocab=1024, seed=2
    )
    for det in (False, True):
        opts = {"deterministic": det, "ignore_index": 600, "vocab_size": 1000}
        two = _tp_gathered(problem, [(0, 512), (512, 512)], backend, opts)
        _check_fp64(two, problem, 1e-5)
        if det:
            one = _tp_gathered(problem, [(0, 1024)], backend, opts)
            for name in one:
                assert_bitwise_equal(two[name], one[name], f"{name}: tp2 vs tp1")


# ----------------------------------------------------------------------------- mixed dtypes

MIXED = [
    (torch.bfloat16, torch.float32),  # the common case: a head kept in fp32
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),  # neither is wider: both run in fp32
]


def _mixed_id(pair):
    return "-".join(str(d).removeprefix("torch.") for d in pair)


def _mixed_problem(h_dtype, w_dtype, **kw):
    p = make_problem(37, 64, 1009, padded_vocab=1024, ignore_frac=0.2, temperature=0.8, **kw)
    return dataclasses.replace(p, hidden=p.hidden.to(h_dtype), weight=p.weight.to(w_dtype))


def _mixed_tols(h_dtype, w_dtype):
    """fp32 arithmetic throughout (the wider dtype); the gradients' own rounding on top."""
    return {
        "grad_hidden": 1e-5 if h_dtype == torch.float32 else 8e-3,
        "grad_weight": 1e-5 if w_dtype == torch.float32 else 8e-3,
    }


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("dtypes", MIXED, ids=_mixed_id)
def test_mixed_dtypes_run_in_the_wider_one(dtypes, deterministic, device, backend):
    """fp64 parity at fp32 accuracy; gradients in each input's dtype; bitwise the run on
    the inputs cast up by hand."""
    h_dtype, w_dtype = dtypes
    p = _mixed_problem(h_dtype, w_dtype, seed=5)
    opts = {"backend": backend, "deterministic": deterministic, "device": device}
    opts.update(p.op_kwargs())
    got = _run(p.hidden, p.weight, p.targets, **opts)
    assert got["grad_hidden"].dtype == h_dtype and got["grad_weight"].dtype == w_dtype
    tols = _mixed_tols(h_dtype, w_dtype)
    for name in got:
        _check_fp64(got, p, tols.get(name, 1e-5), names=[name])
    wide = torch.promote_types(h_dtype, w_dtype)
    by_hand = _run(p.hidden.to(wide), p.weight.to(wide), p.targets, **opts)
    for name, value in got.items():
        assert_bitwise_equal(value, by_hand[name].to(value.dtype), name)


def test_mixed_dtypes_tensor_parallel(backend):
    """bf16 hidden, fp32 shards over gloo: deterministic TP 2 is bitwise TP 1."""
    p = _mixed_problem(torch.bfloat16, torch.float32, seed=6)
    opts = {"deterministic": True, **p.op_kwargs()}
    two = _tp_gathered(p, [(0, 512), (512, 512)], backend, opts)
    one = _tp_gathered(p, [(0, 1024)], backend, opts)
    for name in one:
        assert_bitwise_equal(two[name], one[name], f"{name}: tp2 vs tp1")
    assert two["grad_hidden"].dtype == torch.bfloat16
    tols = _mixed_tols(torch.bfloat16, torch.float32)
    for name in two:
        _check_fp64(two, p, tols.get(name, 1e-5), names=[name])
    default = _tp_gathered(p, [(0, 512), (512, 512)], backend, p.op_kwargs())
    for name in default:
        _check_fp64(default, p, tols.get(name, 1e-5), names=[name])


# ----------------------------------------------------------------------------- bias


def _bias(v_pad: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(v_pad, generator=g)).to(dtype)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize(
    ("dtype", "b_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16-fp32bias"],
)  # fmt: skip
def test_bias_matches_fp64(dtype, b_dtype, deterministic, device, backend):
    p = make_problem(
        37, 64, 1009, dtype=dtype, padded_vocab=1024, ignore_frac=0.2, temperature=0.8, seed=7
    )
    bias = _bias(1024, b_dtype)
    opts = {"backend": backend, "deterministic": deterministic, "device": device}
    opts.update(p.op_kwargs())
    got = _run(p.hidden, p.weight, p.targets, bias=bias, **opts)
    assert got["grad_bias"].dtype == b_dtype and got["grad_bias"].shape == (1024,)
    assert_zero(got["grad_bias"][1009:], name="grad_bias of padding columns")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    b_tol = 1e-5 if b_dtype == torch.float32 and dtype == torch.float32 else 2e-2
    _check_fp64(got, p, tol, bias=bias, names=["logprob", "entropy", "lse", "grad_hidden"])
    _check_fp64(got, p, tol, bias=bias, names=["grad_weight"])
    _check_fp64(got, p, b_tol, bias=bias, names=["grad_bias"])
    again = _run(p.hidden, p.weight, p.targets, bias=bias, **opts)
    for name, value in got.items():  # run-to-run bitwise
        assert_bitwise_equal(again[name], value, f"{name} rerun")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "cap5"])
def test_bias_gradient_sums_the_d_logits_the_gemms_read(softcap, deterministic, device, backend):
    """grad_bias sums, in fp32, the d_logits that the gradient GEMMs read, rounded to the
    GEMM dtype (design.md), as grad_weight is their product with hidden. With the identity
    as a bf16 hidden (N = H) each grad_weight element is one of those d_logits times 1, so
    grad_weight^T is them, exactly: grad_bias equals their fp64 sums to fp32 accuracy,
    while fp64's own grad_bias (sums of the unrounded values) lies bf16 rounding away."""
    n, v = 64, 300
    gen = torch.Generator().manual_seed(11)
    hidden = torch.eye(n).to(torch.bfloat16)
    weight = (3.0 * torch.randn(v, n, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::7] = -100
    bias = torch.randn(v, generator=gen)  # fp32: grad_bias returned as summed
    opts = {"backend": backend, "device": device, "deterministic": deterministic}
    got = _run(hidden, weight, targets, bias=bias, softcap=softcap, **opts)
    want = got["grad_weight"].double().sum(dim=1)  # the stored d_logits' sums, [V]
    scale = float(want.abs().max())
    assert_close(got["grad_bias"].double(), want, rtol=1e-6, atol=1e-6 * scale,
                 name="grad_bias vs the sums of the d_logits the GEMMs read")  # fmt: skip
    g_lp, g_ent, g_lse = _upstream(n)
    extra = {} if softcap is None else {"softcap": softcap}
    truth = reference_all(
        hidden, weight, targets, grad_logprob=g_lp, grad_entropy=g_ent, grad_lse=g_lse,
        bias=bias, **extra,
    )["grad_bias"]  # fmt: skip
    assert float((truth - want).abs().max()) > 100 * 1e-6 * scale  # the test tells them apart


def test_bias_without_grad_and_ignored_rows_with_large_bias(backend):
    """A bias that makes exp overflow on an ignored row (zero hidden) gives exact zeros;
    a bias that needs no gradient leaves the others unchanged."""
    p = make_problem(20, 16, 300, ignore_frac=0.3, seed=8)
    bias = torch.zeros(300)
    bias[5] = 200.0  # exp(200) overflows fp32
    opts = {"backend": backend, **p.op_kwargs()}
    got = _run(p.hidden, p.weight, p.targets, bias=bias, **opts)
    _check_fp64(got, p, 1e-5, bias=bias)
    h = p.hidden.clone().requires_grad_()
    out = linear_logprob(h, p.weight, p.targets, bias=bias, backend=backend, **p.op_kwargs())
    out.logprob.sum().backward()
    assert torch.isfinite(h.grad).all()


@pytest.mark.parametrize("rows, cols", [(1, 5), (16, 128), (37, 300), (70, 1029)])
def test_bias_gradient_column_sums_add_rows_in_order(rows, cols, device):
    """The triton backend's column sums (``backward.add_column_sums``): ``out += part.sum(0)``
    with the rows added to +0.0 one after another, then to ``out`` once, bit for bit, for
    row counts below, at and past the rows it loads at a time and widths past its block."""
    pytest.importorskip("triton")
    from lp_kernels.backends.triton.backward import add_column_sums

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if (device == "cpu") != interpreting:
        pytest.skip("triton runs CPU tensors only under TRITON_INTERPRET=1, CUDA ones without")
    gen = torch.Generator().manual_seed(rows * cols)
    part = (torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 6, cols)).to(device)
    base = torch.randn(cols + 3, generator=gen).to(device)
    out = base.clone()
    add_column_sums(out[:cols], part)
    acc = torch.zeros(cols, device=device)
    for row in part:
        acc = acc + row
    assert torch.equal(out[:cols], base[:cols] + acc)
    assert torch.equal(out[cols:], base[cols:])  # past V: untouched


# Masked columns: scattered, or whole leading blocks and splits (the first 600 of 900 columns:
# on the interpreter's config two 256-column blocks and more), which a row's online softmax
# meets before any finite logit.
MASKS = {"scattered": (300, [3, 150, 299]), "leading": (900, list(range(600)))}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "cap5"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_bias_minus_inf_masks_its_columns(mask, softcap, deterministic, backend):
    """``-inf`` bias entries drop their columns out of the softmax: logprob, lse and their
    gradients equal fp64's over the other columns, and the masked columns' grad_bias and
    grad_weight rows are exact zeros (the cap keeps ``-inf``; its slope there is 0)."""
    gen = torch.Generator().manual_seed(21)
    v, masked = MASKS[mask]
    n, h_dim = 37, 64
    hidden, weight = torch.randn(n, h_dim, generator=gen), torch.randn(v, h_dim, generator=gen)
    bias = torch.randn(v, generator=gen)
    bias[masked] = float("-inf")
    keep = [j for j in range(v) if j not in masked]
    targets = torch.tensor(keep)[torch.randint(0, len(keep), (n,), generator=gen)]
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    out = linear_logprob(
        h, w, targets, bias=b, softcap=softcap, backend=backend, return_lse=True,
        deterministic=deterministic,
    )  # fmt: skip
    (out.logprob.sum() + 0.3 * out.lse.sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = h64 @ w64.T + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits[:, keep], dim=1)
    logprob = logits.gather(1, targets[:, None])[:, 0] - lse
    (logprob.sum() + 0.3 * lse.sum()).backward()
    for name, got, want in (
        ("logprob", out.logprob, logprob),
        ("lse", out.lse, lse),
        ("grad_hidden", h.grad, h64.grad),
        ("grad_weight", w.grad, w64.grad),
    ):
        want = want.detach().float()
        assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), name=name)
    assert_zero(b.grad, where=torch.isinf(bias), name="grad_bias of masked columns")
    assert_zero(w.grad, where=torch.isinf(bias), name="grad_weight rows of masked columns")


@pytest.mark.parametrize(
    ("layout", "tile"),
    [([(0, 512), (512, 512)], None), ([(0, 384), (384, 640)], 256), ([(0, 384), (384, 640)], -256)],
    ids=["even", "uneven-halo", "uneven-halo-tile-per-chunk"],
)
def test_bias_tensor_parallel(layout, tile, backend):
    """Each rank its bias shard; deterministic TP 2 (a tile crossing the bound: the bias'
    halo and its gradient travel with the weight's; with one tile per backward chunk, a
    256-column vocabulary chunk, the halo's grad_bias goes back to its shard) is bitwise
    TP 1."""
    p = make_problem(29, 24, 1000, padded_vocab=1024, ignore_frac=0.2, temperature=0.9, seed=9)
    bias = _bias(1024, seed=1)
    opts = {"deterministic": True, "deterministic_tile": tile and abs(tile), **p.op_kwargs()}
    if tile is not None and tile < 0:
        opts["vocab_chunk"] = 256
    two = _tp_gathered(p, layout, backend, opts, bias)
    one = _tp_gathered(p, [(0, 1024)], backend, opts, bias)
    for name in one:
        assert_bitwise_equal(two[name], one[name], f"{name}: tp2 vs tp1")
    _check_fp64(two, p, 1e-5, bias=bias)
    default = _tp_gathered(p, layout, backend, p.op_kwargs(), bias)
    _check_fp64(default, p, 1e-5, bias=bias)


def _bad_bias_rank(rank, world):
    p = make_problem(4, 8, 256, seed=0)
    start = 128 * rank
    bias = torch.zeros(128 if rank == 0 else 127)  # rank 1's bias misses an entry
    linear_logprob(
        p.hidden, p.weight[start : start + 128], p.targets, bias=bias,
        tp_group=dist.group.WORLD, vocab_start=start,
    )  # fmt: skip


def test_bias_that_does_not_fit_its_shard_raises_on_every_rank():
    with pytest.raises(RankError) as info:
        run_ranks(_bad_bias_rank, 2, timeout=120)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and "its bias must be 1-D [V_local]" in text


# ----------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [4.0, 30.0], ids=lambda c: f"cap{c:g}")
def test_softcap_matches_fp64(softcap, dtype, deterministic, device, backend):
    """z = c tanh(l / c) / T, the cap first: every output and both gradients against fp64
    (logits of std 3 scaled so that a cap of 4 bends them), temperature != 1, padding and
    ignored rows."""
    p = make_problem(
        37, 64, 1009, dtype=dtype, padded_vocab=1024, ignore_frac=0.2, temperature=0.7,
        seed=11, scale=3.0 if softcap > 10 else 6.0,
    )  # fmt: skip
    opts = {"backend": backend, "deterministic": deterministic, "softcap": softcap}
    opts["device"] = device
    got = _run(p.hidden, p.weight, p.targets, **opts, **p.op_kwargs())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _check_fp64(got, p, tol, softcap=softcap)
    # the cap changes the answer (the test would pass without it otherwise)
    plain = reference_all(p.hidden, p.weight, p.targets, **p.op_kwargs())
    capped = reference_all(p.hidden, p.weight, p.targets, softcap=softcap, **p.op_kwargs())
    assert float((plain["logprob"] - capped["logprob"]).abs().max()) > 10 * tol


def test_softcap_baseline_ratio(backend):
    """No worse than 4 x the materialized fp32 path's error (torch.tanh in fp32)."""
    p = make_problem(64, 128, 4097, ignore_frac=0.1, temperature=0.8, seed=12, scale=5.0)
    check_against_fp64(p, FP32, entropy=True, lse=True, backend=backend, softcap=10.0)


def test_every_option_together_tensor_parallel(backend):
    """Softcap, bias, a bf16 hidden with an fp32 head, a real-id ignore_index, padding and
    temperature, TP 2 over gloo with a tile crossing the shard bound: deterministic is
    bitwise TP 1, and both modes match fp64."""
    p = _mixed_problem(torch.bfloat16, torch.float32, seed=13)
    targets = torch.where(p.ignored, 500, p.targets)  # ignored rows now target id 500
    p = dataclasses.replace(p, targets=targets, ignore_index=500)
    assert int(p.ignored.sum()) >= 1
    bias = _bias(1024, torch.bfloat16, seed=2)
    opts = {"softcap": 5.0, "deterministic": True, "deterministic_tile": 256, **p.op_kwargs()}
    layout = [(0, 384), (384, 640)]
    two = _tp_gathered(p, layout, backend, opts, bias)
    one = _tp_gathered(p, [(0, 1024)], backend, opts, bias)
    for name in one:
        assert_bitwise_equal(two[name], one[name], f"{name}: tp2 vs tp1")
    tols = {**_mixed_tols(torch.bfloat16, torch.float32), "grad_bias": 8e-3}
    opts.pop("deterministic")
    default = _tp_gathered(p, layout, backend, opts, bias)
    for got in (two, default):
        for name in got:
            _check_fp64(got, p, tols.get(name, 1e-5), bias=bias, softcap=5.0, names=[name])


def test_softcap_keeps_non_finite_rows_nan(backend):
    p = make_problem(8, 16, 300, seed=14)
    hidden = p.hidden.clone()
    hidden[2, 3] = float("inf")
    out = linear_logprob(hidden, p.weight, p.targets, softcap=3.0, backend=backend)
    assert torch.isnan(out.logprob[2]) and torch.isfinite(out.logprob[[0, 1, 3]]).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "det"])
def test_vocab_parallel_softcap_matches_fp64(deterministic):
    from lp_kernels import vocab_parallel_logprob
    from lp_testing import reference_from_logits

    g = torch.Generator().manual_seed(15)
    logits = 8.0 * torch.randn(19, 640, generator=g)
    targets = torch.randint(0, 600, (19,), generator=g)
    targets[4] = -100
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprob(
        x, targets, softcap=6.0, temperature=0.9, vocab_size=600, return_entropy=True,
        return_lse=True, deterministic=deterministic,
    )  # fmt: skip
    g_lp, g_ent, g_lse = _upstream(19)
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    truth = reference_from_logits(
        logits, targets, grad_logprob=g_lp, grad_entropy=g_ent, grad_lse=g_lse, softcap=6.0,
        temperature=0.9, vocab_size=600,
    )  # fmt: skip
    for name, got in (*zip(("logprob", "entropy", "lse"), out, strict=True),
                      ("grad_logits", x.grad)):  # fmt: skip
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=1e-5, atol=1e-5 * scale, name=name)
    # a masked (-inf) column stays masked under the cap (logprob and lse; the entropy of
    # masked logits is the masked-vocabulary work's, not the cap's)
    masked = logits.clone()
    masked[:, 7] = float("-inf")
    x = masked.requires_grad_()
    out = vocab_parallel_logprob(x, targets, softcap=6.0, vocab_size=600, return_lse=True,
                                 deterministic=deterministic)  # fmt: skip
    (out.logprob * g_lp).sum().backward()
    kept = torch.cat([logits[:, :7], logits[:, 8:600]], dim=1)
    truth = reference_from_logits(kept, torch.where(targets > 7, targets - 1, targets),
                                  softcap=6.0)  # fmt: skip
    ok = (targets != 7) & (targets != -100)
    assert_close(out.lse[ok], truth["lse"][ok], rtol=1e-5, atol=1e-5, name="masked lse")
    assert bool((x.grad[:, 7] == 0).all())


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [(0.0, ValueError, "softcap must be None or finite and > 0"),
     (-1.0, ValueError, "softcap must be None or finite and > 0"),
     (float("inf"), ValueError, "softcap must be None or finite and > 0"),
     (True, TypeError, "softcap must be None or a Python float"),
     (torch.tensor(3.0), TypeError, "softcap must be None or a Python float")],
)  # fmt: skip
def test_softcap_errors(value, exc, match):
    with pytest.raises(exc, match=match):
        linear_logprob(torch.randn(3, 8), torch.randn(20, 8), torch.zeros(3, dtype=torch.long),
                       softcap=value)  # fmt: skip
