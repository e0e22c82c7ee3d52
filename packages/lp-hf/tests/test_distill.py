"""``lp_hf.distill_divergence`` against the materialized logits of both models (CPU, fp32).

The reference is what a trainer writes without lp: ``model(...).logits`` of the student and
of the teacher (each model's own bias, softcap and scale applied by its forward), divided
by the temperatures, ``log_softmax``, and each divergence from its
definition (the JSD's mixture as a ``logsumexp``, as TRL's GKD loss forms it), on the rows
that ``_hf_models.stock_targets`` (an element-by-element loop) says predict a scored token.

Tolerances: the truth is that path with both models in float64. lp computes each row in
fp32 from fp32 hidden states, so its values differ from it by fp32 rounding of sums over
311 terms (``rtol=1e-4, atol=1e-5``); its gradients, which pass through the fp32 models,
must be no worse than 8 x the error of the same materialized path run in fp32 (lp's JSD
gradient, formed from fp32 row sums, sits at about 3 x; the KLs at about 1 x).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import ARCHS, grads, stock_targets, tiny_model

from lp_hf import DistillOutput, distill_divergence
from lp_kernels.losses import distill_loss

TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB = 311
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "distill.py"


def _reference(z_s: torch.Tensor, z_t: torch.Tensor, kind: str, beta: float):
    """``(divergence, student entropy, teacher entropy)`` ``[...]`` from fp64 softmax args."""
    lp, lq = torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1)
    p, q = lp.exp(), lq.exp()
    if kind == "forward_kl":
        div = (q * (lq - lp)).sum(-1)
    elif kind == "reverse_kl":
        div = (p * (lp - lq)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lq + math.log(beta)]), 0)
        div = beta * (q * (lq - lm)).sum(-1) + (1 - beta) * (p * (lp - lm)).sum(-1)
    return div, -(p * lp).sum(-1), -(q * lq).sum(-1)


def _batch(seed: int = 1, left_pad: bool = True):
    """``(ids, attention_mask, completion mask)`` ``[3, 10]``: padding right (and left)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 10), generator=g)
    attn = torch.ones(3, 10, dtype=torch.long)
    attn[1, -3:] = 0  # right padding
    if left_pad:
        attn[2, :2] = 0
    completion = torch.zeros(3, 10, dtype=torch.bool)
    completion[:, 4:] = True  # prompts of 4 tokens
    completion[0, 6] = False  # a hole in a completion
    return ids, attn, completion


def _labels(ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(~completion, -100)


def _pair(student_kw: dict, teacher_kw: dict):
    """A fresh student and teacher from the same seeds each time."""
    return tiny_model(vocab=VOCAB, seed=0, **student_kw), tiny_model(
        vocab=VOCAB, seed=7, **teacher_kw
    )


def _optional(*archs: str):
    missing = [a for a in archs if a not in ARCHS]
    return pytest.mark.skipif(bool(missing), reason=f"transformers lacks {missing}")


CASES = [
    pytest.param("forward_kl", {}, {"hidden": 48}, {}, id="fkl-llama-teacher-h48"),
    pytest.param(
        "reverse_kl",
        {"arch": "qwen2", "bias": True},
        {"arch": "llama", "bias": True, "hidden": 64},
        {"temperature": 0.7},
        id="rkl-qwen2-bias-T0.7",
    ),
    pytest.param(
        "jsd",
        {"tied": True},
        {"arch": "qwen2", "hidden": 48},
        {"beta": 0.3, "temperature": 1.3, "teacher_temperature": 0.8},
        id="jsd-beta0.3-tied-two-temperatures",
    ),
    pytest.param(
        "jsd",
        {"arch": "gemma2", "attn": "eager", "softcap": 2.0},
        {"arch": "granite", "attn": "eager", "logits_scaling": 4.0, "hidden": 48},
        {},
        id="jsd-gemma2-softcap-granite-scale-right-padded",
        marks=_optional("gemma2", "granite"),
    ),
]


def _materialized(student, teacher, ids, attn, valid, kind, options):
    """The trainer's path in the models' dtype: ``(divergence, entropies...)`` ``[B, T]``,
    0 where not ``valid``."""
    temp = options.get("temperature", 1.0)
    t_temp = options.get("teacher_temperature") or temp
    z_s = student(input_ids=ids, attention_mask=attn, use_cache=False).logits / temp
    with torch.no_grad():
        z_t = teacher(input_ids=ids, attention_mask=attn, use_cache=False).logits / t_temp
    values = _reference(z_s, z_t, kind, options.get("beta", 0.5))
    return [torch.where(valid, v, 0.0) for v in values]


def _assert_grads_no_worse(got: dict, base: dict, truth: dict, k: float = 8.0) -> None:
    """Every gradient within ``k`` x the fp32 materialized path's error from fp64 (plus
    1e-6 of the tensor's largest entry, for a baseline that happens to round exactly)."""
    assert got.keys() == truth.keys()
    for name, want in truth.items():
        scale = float(want.abs().max())
        assert scale > 0, f"{name}: no gradient reached it"
        err = float((got[name].double() - want).abs().max())
        base_err = float((base[name].double() - want).abs().max())
        assert (
            err <= k * base_err + 1e-6 * scale
        ), f"{name}: error {err:.3g}, fp32 materialized {base_err:.3g}, max |grad| {scale:.3g}"


@pytest.mark.parametrize("kind, student_kw, teacher_kw, options", CASES)
def test_matches_the_materialized_logits(kind, student_kw, teacher_kw, options):
    """Values against fp64; gradients no worse than 8 x the fp32 materialized path's."""
    # transformers' eager attention in float64 (the truth run) turns left padding into NaN
    ids, attn, completion = _batch(left_pad=student_kw.get("attn") != "eager")
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    _, valid = stock_targets(_labels(ids, completion), attention_mask=attn)
    runs = {}
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        student, teacher = (m.to(dtype) for m in _pair(student_kw, teacher_kw))
        ref = _materialized(student, teacher, ids, attn, valid, kind, options)
        (ref[0] * weights).sum().backward()
        runs[name] = ref, grads(student)

    student, teacher = _pair(student_kw, teacher_kw)
    out = distill_divergence(
        student, teacher, ids, attention_mask=attn, mask=completion, kind=kind, **options
    )
    assert isinstance(out, DistillOutput)
    assert torch.equal(out.mask, valid)
    names = ("divergence", "student entropy", "teacher entropy")
    for got, want, name in zip(out[:3], runs["fp64"][0], names, strict=True):
        assert got.dtype == torch.float32 and got.shape == ids.shape, name
        torch.testing.assert_close(got.double(), want.detach(), **TOL, msg=name)
        assert torch.equal(got[~valid], torch.zeros_like(got[~valid])), name
    assert not out.student_entropy.requires_grad and not out.teacher_entropy.requires_grad
    (out.divergence * weights).sum().backward()
    _assert_grads_no_worse(grads(student), runs["fp32"][1], runs["fp64"][1])
    assert all(p.grad is None for p in teacher.parameters())  # requires_grad, yet none


def test_packed_sequences_and_no_mask():
    """``[1, T]`` packed rows: no position predicts across a boundary; mask=None scores
    every other position."""
    student, teacher = _pair({}, {"hidden": 48})
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    out = distill_divergence(student, teacher, ids, position_ids=pos, kind="forward_kl")
    _, valid = stock_targets(ids, position_ids=pos)
    assert torch.equal(out.mask, valid) and int(valid.sum()) == 9
    z_s = student(input_ids=ids, position_ids=pos, use_cache=False).logits.double()
    z_t = teacher(input_ids=ids, position_ids=pos, use_cache=False).logits.double()
    want = torch.where(valid, _reference(z_s, z_t, "forward_kl", 0.5)[0], 0.0)
    torch.testing.assert_close(out.divergence.double(), want, **TOL)


def test_distill_loss_of_the_output_is_the_token_mean():
    student, teacher = _pair({}, {})
    ids, attn, completion = _batch()
    out = distill_divergence(student, teacher, ids, attention_mask=attn, mask=completion)
    loss = distill_loss(out.divergence, out.mask)
    want = out.divergence[out.mask].sum() / out.mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert loss > 0 and loss.requires_grad


def test_an_empty_mask_gives_zeros_and_a_zero_loss():
    student, teacher = _pair({}, {})
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    out = distill_divergence(student, teacher, ids, mask=torch.zeros(2, 6, dtype=torch.bool))
    assert not out.mask.any() and torch.equal(out.divergence, torch.zeros(2, 6))
    loss = distill_loss(out.divergence, out.mask)
    loss.backward()
    assert loss.item() == 0.0


def test_teacher_with_another_vocabulary_is_refused():
    student = tiny_model(vocab=VOCAB)
    teacher = tiny_model(vocab=VOCAB + 2, seed=7)
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(ValueError, match=r"teacher's vocabulary differs.*313 rows.*311"):
        distill_divergence(student, teacher, ids)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, "mask must have input_ids'"),
        ({"mask": torch.ones(2, 6)}, TypeError, "mask must be a bool"),
        ({"softcap": 3.0}, TypeError, "sets .*softcap"),
        ({"teacher_bias": None}, TypeError, "teacher_bias"),
        ({"kind": "kl"}, ValueError, "kind"),
    ],
    ids=["mask-shape", "float-mask", "softcap", "teacher-bias", "kind"],
)
def test_bad_arguments(kwargs, error, match):
    student, teacher = _pair({}, {})
    ids = torch.randint(0, VOCAB, (2, 6))
    with pytest.raises(error, match=match):
        distill_divergence(student, teacher, ids, **kwargs)


@_optional("minicpm3")
def test_a_model_that_scales_the_head_input_is_refused():
    student = tiny_model(vocab=VOCAB)
    teacher = tiny_model("minicpm3", vocab=VOCAB, seed=7, attn="eager", dim_model_base=8)
    with pytest.raises(ValueError, match=r"logits_scaling=4\.0.*output layer's input"):
        distill_divergence(student, teacher, torch.randint(0, VOCAB, (2, 6)))


@pytest.mark.skipif(not EXAMPLE.exists(), reason="the examples/ folder of the repository")
def test_distill_example_loss_goes_down():
    spec = importlib.util.spec_from_file_location("distill_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()) as text:
        losses = module.main(["--steps", "6"])
    assert len(losses) == 6, text.getvalue()
    assert losses[-1] < 0.9 * losses[0], text.getvalue()
