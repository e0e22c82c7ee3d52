"""The fp64 references against hand computations and finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from lp_testing import (
    assert_close,
    make_problem,
    materialized_baseline,
    materialized_baseline_from_logits,
    reference_all,
    reference_from_logits,
    reference_grads,
    reference_outputs,
)
from lp_testing.reference import OUTPUTS, reference_extras


def test_outputs_match_hand_computation() -> None:
    hidden = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]])
    weight = torch.tensor([[0.1, 0.2], [-0.3, 0.4], [0.5, -0.6], [9.0, 9.0]])  # row 3: padding
    targets = torch.tensor([2, -100, 0])
    temperature = 0.5
    out = reference_outputs(
        hidden, weight, targets, temperature=temperature, vocab_size=3, ignore_index=-100
    )
    for i in (0, 2):
        z = [
            sum(h * w for h, w in zip(hidden[i].tolist(), row, strict=True)) / temperature
            for row in weight[:3].tolist()
        ]
        lse = math.log(sum(math.exp(x) for x in z))
        p = [math.exp(x - lse) for x in z]
        entropy = -sum(pi * math.log(pi) for pi in p)
        assert out["logprob"][i].item() == pytest.approx(z[int(targets[i])] - lse, rel=1e-12)
        assert out["lse"][i].item() == pytest.approx(lse, rel=1e-12)
        assert out["entropy"][i].item() == pytest.approx(entropy, rel=1e-12)
    for name in OUTPUTS:
        assert out[name].dtype == torch.float64
        assert out[name][1].item() == 0.0  # the ignored row


class _Reference(torch.autograd.Function):
    """reference_outputs forward, reference_grads backward: gradcheck compares the two."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, options):  # type: ignore[override]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.options = options
        out = reference_outputs(hidden, weight, targets, **options)
        return out["logprob"], out["entropy"], out["lse"]

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_lse):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        gh, gw = reference_grads(
            hidden,
            weight,
            targets,
            grad_logprob=g_logprob,
            grad_entropy=g_entropy,
            grad_lse=g_lse,
            **ctx.options,
        )
        return gh, gw, None, None


def test_grads_match_finite_differences() -> None:
    p = make_problem((2, 2), 5, 6, padded_vocab=8, ignore_frac=0.25, temperature=0.7, seed=3)
    hidden = p.hidden.double().requires_grad_()
    weight = p.weight.double().requires_grad_()
    assert bool(p.ignored.any())
    assert torch.autograd.gradcheck(
        lambda h, w: _Reference.apply(h, w, p.targets, p.op_kwargs()),
        (hidden, weight),
        fast_mode=True,
    )


def test_grads_zero_on_ignored_rows_and_padding() -> None:
    p = make_problem(9, 8, 20, padded_vocab=24, ignore_frac=0.3, seed=1)
    up = p.upstream()
    gh, gw = reference_grads(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    assert gh.shape == p.hidden.shape and gw.shape == p.weight.shape
    assert gh[p.ignored].abs().max() == 0
    assert gh[~p.ignored].abs().min() > 0
    assert gw[20:].abs().max() == 0
    # Each upstream gradient alone; their sum is the combined gradient (linearity).
    parts = [
        reference_grads(p.hidden, p.weight, p.targets, **{k: v}, **p.op_kwargs())
        for k, v in up.items()
    ]
    assert torch.allclose(sum(g[0] for g in parts), gh, rtol=1e-12, atol=1e-14)
    assert torch.allclose(sum(g[1] for g in parts), gw, rtol=1e-12, atol=1e-14)


def test_padding_and_temperature() -> None:
    p = make_problem(11, 16, 30, padded_vocab=32, temperature=0.6, seed=2)
    full = reference_outputs(p.hidden, p.weight, p.targets, **p.op_kwargs())
    cut = reference_outputs(p.hidden, p.weight[:30].double() / 0.6, p.targets)
    for name in OUTPUTS:
        assert torch.allclose(full[name], cut[name], rtol=1e-12, atol=1e-12)
    # The padding rows are large: including them would change the result a lot.
    wrong = reference_outputs(p.hidden, p.weight.double() / 0.6, p.targets)
    assert (wrong["lse"] - full["lse"]).abs().max() > 1.0


def test_leading_shape_and_from_logits() -> None:
    p = make_problem((3, 4), 8, 13, padded_vocab=16, ignore_frac=0.2, seed=4, temperature=1.3)
    up = p.upstream()
    truth = reference_all(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    assert truth["logprob"].shape == (3, 4) and truth["grad_hidden"].shape == (3, 4, 8)
    logits = (p.hidden.double() @ p.weight.double().T).requires_grad_()
    from_logits = reference_from_logits(logits, p.targets, **up, **p.op_kwargs())
    for name in OUTPUTS:
        assert torch.allclose(from_logits[name], truth[name], rtol=1e-12, atol=1e-12)
    g = from_logits["grad_logits"]
    assert g.shape == (3, 4, 16) and g[..., 13:].abs().max() == 0
    assert torch.allclose(g @ p.weight.double(), truth["grad_hidden"], rtol=1e-10, atol=1e-12)
    assert from_logits["grad_logits"] is not None and logits.grad is None
    assert reference_from_logits(logits, p.targets)["grad_logits"] is None


def test_baseline_fp32_close_and_bf16_worse() -> None:
    p = make_problem(40, 64, 300, ignore_frac=0.1, seed=5)
    up = p.upstream()
    truth = reference_all(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    base32 = materialized_baseline(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    pb = p.to(dtype=torch.bfloat16)
    base16 = materialized_baseline(pb.hidden, pb.weight, pb.targets, **up, **pb.op_kwargs())
    assert base16["grad_hidden"].dtype == torch.bfloat16
    assert base16["grad_weight"].dtype == torch.bfloat16
    assert base16["logprob"].dtype == torch.float32
    for name in (*OUTPUTS, "grad_hidden", "grad_weight"):
        assert_close(base32[name], truth[name], atol=1e-5, rtol=1e-5, name=name)
        err32 = (base32[name].double() - truth[name]).abs().max()
        # bf16 truth differs from fp32 truth (rounded inputs): compare each to its own.
        truth16 = reference_all(pb.hidden, pb.weight, pb.targets, **up, **pb.op_kwargs())[name]
        err16 = (base16[name].double() - truth16).abs().max()
        assert err16 > 10 * err32, name
    assert base16["logprob"][pb.ignored].abs().max() == 0


def test_baseline_from_logits() -> None:
    p = make_problem(6, 8, 10, padded_vocab=12, ignore_frac=0.3, seed=6, temperature=0.9)
    logits = (p.hidden @ p.weight.T).to(torch.bfloat16)
    up = p.upstream()
    base = materialized_baseline_from_logits(logits, p.targets, **up, **p.op_kwargs())
    truth = reference_from_logits(logits, p.targets, **up, **p.op_kwargs())
    assert base["grad_logits"].dtype == torch.bfloat16
    for name in (*OUTPUTS, "grad_logits"):
        assert_close(base[name], truth[name], atol=2e-2, rtol=2e-2, name=name)


def test_rejects_bad_inputs() -> None:
    p = make_problem(4, 8, 10, padded_vocab=12)
    bad = p.targets.clone()
    bad[0] = 10  # padding column: out of the real vocabulary
    with pytest.raises(
        ValueError, match=r"1 targets are neither ignore_index \(-100\) nor in \[0, 10\)"
    ):
        reference_outputs(p.hidden, p.weight, bad, vocab_size=10)
    with pytest.raises(ValueError, match="one value per row"):
        reference_grads(p.hidden, p.weight, p.targets, grad_logprob=torch.tensor(1.0))
    with pytest.raises(ValueError, match="at least one"):
        reference_grads(p.hidden, p.weight, p.targets)
    with pytest.raises(ValueError, match="leading shape"):
        reference_outputs(p.hidden, p.weight, p.targets[:3])


# ----------------------------------------------------------------------------- reference_chunked


CHUNKED_GRADS = {
    "all": ("grad_logprob", "grad_entropy", "grad_lse"),
    "logprob": ("grad_logprob",),
    "entropy+lse": ("grad_entropy", "grad_lse"),
}


@pytest.mark.parametrize("grads", list(CHUNKED_GRADS), ids=list(CHUNKED_GRADS))
@pytest.mark.parametrize("rows", [3, 1000], ids=["rows3", "rows1000"])
def test_reference_chunked_equals_reference_all(grads: str, rows: int) -> None:
    """Closed-form gradient, blocks of rows: the autograd truth to fp64 rounding."""
    from lp_testing import reference_chunked

    p = make_problem(
        (2, 5), 16, 97, padded_vocab=104, ignore_frac=0.3, temperature=0.7, dtype=torch.bfloat16
    )
    up = {k: v for k, v in p.upstream().items() if k in CHUNKED_GRADS[grads]}
    truth = reference_all(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    got = reference_chunked(p.hidden, p.weight, p.targets, **up, **p.op_kwargs(), rows=rows)
    assert got.keys() == truth.keys()
    assert truth["grad_bias"] is None and got["grad_bias"] is None  # no bias given
    for key, want in truth.items():
        if want is None:
            continue
        assert got[key].dtype == torch.float64 and got[key].shape == want.shape, key
        torch.testing.assert_close(got[key], want, rtol=1e-12, atol=1e-12, msg=key)
    assert torch.equal(got["grad_weight"][97:], torch.zeros(7, 16, dtype=torch.float64))
    ignored = p.targets == p.ignore_index
    assert ignored.any() and not got["grad_hidden"][ignored].any()


def test_reference_chunked_fp32_and_without_gradients() -> None:
    from lp_testing import reference_chunked

    p = make_problem(37, 32, 301, ignore_frac=0.1)
    up = p.upstream()
    truth = reference_all(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    got = reference_chunked(
        p.hidden, p.weight, p.targets, **up, **p.op_kwargs(), dtype=torch.float32, rows=8
    )
    for key, want in truth.items():
        if key == "grad_bias":
            assert want is None and got[key] is None
            continue
        assert got[key].dtype == torch.float32, key
        err = float((got[key].double() - want).norm() / want.norm())
        assert err < 1e-5, (key, err)  # fp32 rounding, not a different formula
    bare = reference_chunked(p.hidden, p.weight, p.targets, **p.op_kwargs())
    assert bare["grad_hidden"] is None and bare["grad_weight"] is None
    torch.testing.assert_close(bare["logprob"], truth["logprob"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": 0}, "rows must be >= 1"),
        ({"dtype": torch.float16}, "dtype must be torch.float64 or float32"),
        ({"vocab_size": 500}, "vocab_size must be in"),
        ({"softcap": 0.0}, "softcap must be a finite number > 0"),
        ({"softcap": float("nan")}, "softcap must be a finite number > 0"),
        ({"bias": torch.zeros(10)}, r"bias must be \[V_pad\] = 11"),
    ],
    ids=["rows-zero", "fp16", "vocab-too-big", "softcap-zero", "softcap-nan", "bias-shape"],
)
def test_reference_chunked_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    from lp_testing import reference_chunked

    p = make_problem(4, 8, 11)
    with pytest.raises(ValueError, match=message):
        reference_chunked(p.hidden, p.weight, p.targets, **kwargs)


@pytest.mark.parametrize("grads", list(CHUNKED_GRADS), ids=list(CHUNKED_GRADS))
@pytest.mark.parametrize(
    ("bias", "softcap"),
    [(True, None), (False, 1.5), (True, 1.5)],
    ids=["bias", "cap1.5", "bias+cap1.5"],
)
def test_reference_chunked_bias_and_softcap_equal_reference_all(grads, bias, softcap) -> None:
    """The closed form with a bias and a cap (``dl = dz (1 - tanh^2) / T``, grad_bias the
    column sum of dl): the autograd truth to fp64 rounding, across blocks of rows, with
    padding columns, ignored rows and a temperature; a cap small enough to bend the logits."""
    from lp_testing import reference_chunked

    p = make_problem(
        (2, 5), 16, 97, padded_vocab=104, ignore_frac=0.3, temperature=0.7, dtype=torch.bfloat16
    )
    b = torch.linspace(-1.5, 1.5, 104).to(torch.bfloat16) if bias else None
    up = {k: v for k, v in p.upstream().items() if k in CHUNKED_GRADS[grads]}
    kw = {"bias": b, "softcap": softcap, **p.op_kwargs()}
    truth = reference_all(p.hidden, p.weight, p.targets, **up, **kw)
    got = reference_chunked(p.hidden, p.weight, p.targets, **up, **kw, rows=3)
    plain = reference_all(p.hidden, p.weight, p.targets, **up, **p.op_kwargs())
    assert got.keys() == truth.keys()
    assert (got["grad_bias"] is None) == (not bias)
    for key, want in truth.items():
        if want is None:
            continue
        assert got[key].dtype == torch.float64 and got[key].shape == want.shape, key
        torch.testing.assert_close(got[key], want, rtol=1e-12, atol=1e-12, msg=key)
        if plain[key] is not None:  # the options change every output and gradient
            assert not torch.allclose(want, plain[key]), key
    assert torch.equal(got["grad_weight"][97:], torch.zeros(7, 16, dtype=torch.float64))
    if bias:
        assert torch.equal(got["grad_bias"][97:], torch.zeros(7, dtype=torch.float64))
    fp32 = reference_chunked(p.hidden, p.weight, p.targets, **up, **kw, dtype=torch.float32)
    for key, want in truth.items():
        if want is not None:
            assert fp32[key].dtype == torch.float32, key
            err = float((fp32[key].double() - want).norm() / want.norm())
            assert err < 1e-5, (key, err)


@pytest.mark.parametrize("softcap", [None, 2.5], ids=["nocap", "cap2.5"])
def test_reference_bias_and_softcap_agree_with_the_logits_reference(softcap) -> None:
    """reference_all with a bias and a cap equals reference_from_logits on the materialized
    raw logits ``h W^T + b``; grad_bias is the column sum of the logits gradient and
    grad_hidden its product with W; padding columns get zero."""
    from lp_testing import make_problem, reference_all, reference_from_logits

    p = make_problem(9, 8, 40, padded_vocab=48, ignore_frac=0.2, temperature=0.7, seed=3)
    bias = torch.linspace(-2, 2, 48)
    g = torch.linspace(-1, 1, 9)
    grads = {"grad_logprob": g, "grad_entropy": g.flip(0), "grad_lse": 0.3 + 0 * g}
    got = reference_all(
        p.hidden, p.weight, p.targets, bias=bias, softcap=softcap, **grads, **p.op_kwargs()
    )
    logits = p.hidden.double() @ p.weight.double().T + bias.double()
    via = reference_from_logits(logits, p.targets, softcap=softcap, **grads, **p.op_kwargs())
    for name in OUTPUTS:
        torch.testing.assert_close(got[name], via[name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["grad_bias"], via["grad_logits"].sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        got["grad_hidden"], via["grad_logits"] @ p.weight.double(), rtol=1e-12, atol=1e-12
    )
    assert bool((got["grad_bias"][40:] == 0).all())


def test_reference_softcap_is_tanh_before_temperature() -> None:
    from lp_testing import reference_from_logits

    logits = torch.tensor([[3.0, -1.0, 0.5]], dtype=torch.float64)
    got = reference_from_logits(logits, torch.tensor([0]), softcap=2.0, temperature=0.5)
    z = 2.0 * torch.tanh(logits / 2.0) / 0.5
    torch.testing.assert_close(got["logprob"], z.log_softmax(-1)[:, 0])
    with pytest.raises(ValueError, match="bias must be"):
        from lp_testing import reference_all

        reference_all(torch.ones(1, 2), torch.ones(3, 2), torch.tensor([0]), bias=torch.ones(2))


def test_reference_extras_hand_computation() -> None:
    z = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, -2.0], [5.0, 1.0, 0.0, 0.0]])
    targets = torch.tensor([0, 2, -100])
    out = reference_extras(z, targets)
    p = torch.softmax(z[1].double(), -1)
    assert math.isclose(float(out["log_sum_sq_probs"][0]), -math.log(4), rel_tol=1e-12)
    assert math.isclose(float(out["log_sum_sq_probs"][1]), math.log(float((p * p).sum())))
    assert out["mean_logit"].tolist() == [0.0, 1.25, 0.0]  # the ignored row: 0
    assert out["is_top1"].tolist() == [True, False, False]  # a tie: the first column wins
