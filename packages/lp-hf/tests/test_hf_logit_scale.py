"""lp-hf with the final-logit scale of transformers' own classes (CPU, fp32).

Cohere (``logits * self.logit_scale``), Granite (``logits / config.logits_scaling``),
Falcon-H1 (``logits * self.model.lm_head_multiplier``) and HyperCLOVA X (``logits *
config.logits_scaling``) scale what lm_head returned in their forward; MiniCPM3 divides the
hidden states before lm_head (``config.logits_scaling``). The head must give the log-probs,
entropy, lse and every parameter gradient of the model's own logits, put each scale back
after every call (an error included), and refuse a field it does not know the code of.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the GPU hosts may lack it

from _hf_models import ARCHS, assert_grads_close, grads, stock_logprobs, stock_targets, tiny_model

from lp_hf import FinalLogitTransform, install_logprob_head, model_logit_transform
from lp_hf.final_logits import FIELDS

TOL = dict(rtol=1e-4, atol=1e-5)

# arch -> (config field, its value, where the forward reads it, lp's logit_scale); the value
# moves these models' logits (|l| up to ~8) far from where they were
SCALED = {
    "cohere": ("logit_scale", 0.25, "logit_scale", 0.25),
    "cohere2": ("logit_scale", 0.25, "logit_scale", 0.25),
    "cohere2_moe": ("logit_scale", 0.25, "logit_scale", 0.25),
    "cohere_compass": ("logit_scale", 0.25, "logit_scale", 0.25),
    "granite": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "granite_swa": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "granitemoe": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "granitemoe_swa": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "granitemoeshared": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "granitemoehybrid": ("logits_scaling", 4.0, "config.logits_scaling", 0.25),
    "falcon_h1": ("lm_head_multiplier", 3.0, "model.lm_head_multiplier", 3.0),
    "hyperclovax": ("logits_scaling", 0.5, "config.logits_scaling", 0.5),
    # logits_scaling = hidden_size / dim_model_base = 4 divides lm_head's input
    "minicpm3": ("dim_model_base", 8, "config.logits_scaling", None),
}
MULTIPLY, DIVIDE, ATTRIBUTE = "cohere", "granite", "falcon_h1"


def _needs(arch: str) -> None:
    if arch not in ARCHS:
        pytest.skip(f"this transformers lacks {arch}")


def _build(arch: str, value=None, **kwargs) -> torch.nn.Module:
    field, default, _, _ = SCALED[arch]
    return tiny_model(arch, attn="eager", **{field: default if value is None else value}, **kwargs)


def _where(model: torch.nn.Module, arch: str):
    """The value the model's forward reads."""
    value = model
    for part in SCALED[arch][2].split("."):
        value = getattr(value, part)
    return value


def _batch(vocab: int = 311, b: int = 3, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -2:] = 0
    mask[2, :3] = 0
    return ids, labels, mask


def _check_against_stock(build, temp: float = 0.7) -> torch.nn.Module:
    """The head on ``build()`` against the stock path on another ``build()``: outputs and
    every parameter gradient under one loss over logprob, entropy and lse."""
    ids, labels, mask = _batch()
    g = torch.Generator().manual_seed(2)
    w = [torch.randn(ids.shape, generator=g) for _ in range(3)]

    stock = build()
    ref = stock_logprobs(stock, ids, labels, attention_mask=mask, temperature=temp)
    sum(r * wi for r, wi in zip(ref, w, strict=True)).sum().backward()
    ref_grads = grads(stock)

    model = build()
    head = install_logprob_head(model, temperature=temp)
    out = head.logprobs(ids, labels, attention_mask=mask, return_entropy=True, return_lse=True)
    sum(o * wi for o, wi in zip(out, w, strict=True)).sum().backward()
    _, valid = stock_targets(labels, mask)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, **TOL)
        assert torch.all(got[~valid] == 0)
    assert_grads_close(grads(model), ref_grads)
    return model


@pytest.mark.parametrize("arch", list(SCALED))
def test_scaled_families_match_their_own_forward(arch):
    """Every family, tied (Cohere's default) and untied: outputs and gradients of the
    model's own scaled logits; the scale is back after the call, ``paused()`` and a removed
    head give the model's own scaled logits."""
    _needs(arch)
    tied = arch.startswith("cohere")
    model = _check_against_stock(lambda: _build(arch, tied=tied))
    _, value, _, lp_scale = SCALED[arch]
    if arch != "minicpm3":
        assert _where(model, arch) == value  # restored
    assert model_logit_transform(model) == FinalLogitTransform(None, lp_scale)
    head = install_logprob_head(model, temperature=0.7)
    ids = torch.randint(0, 311, (1, 6))
    with head.paused(), torch.no_grad():
        logits = model(ids, use_cache=False).logits
    head.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, logits, rtol=0, atol=0)
        if lp_scale is not None:  # the model's own scale, not switched off
            raw = model.lm_head(model.model(ids, use_cache=False).last_hidden_state)
            torch.testing.assert_close(logits, raw * lp_scale, **TOL)


@pytest.mark.parametrize("arch", [MULTIPLY, DIVIDE, ATTRIBUTE, "hyperclovax", "minicpm3"])
def test_the_scale_changes_the_result(arch):
    """The comparisons above could fail: on these models the scale moves the log-probs by
    far more than the tolerance (a neutral value is the unscaled model)."""
    _needs(arch)
    ids, labels, mask = _batch()
    neutral = 32 if arch == "minicpm3" else 1.0  # dim_model_base = hidden_size
    with torch.no_grad():
        scaled = stock_logprobs(_build(arch), ids, labels, attention_mask=mask)[0]
        plain = stock_logprobs(_build(arch, neutral), ids, labels, attention_mask=mask)[0]
    assert float((scaled - plain).abs().max()) > 0.1


@pytest.mark.parametrize("arch", [MULTIPLY, DIVIDE, ATTRIBUTE])
def test_the_scale_is_restored_after_an_error(arch):
    """An error inside the model forward (lp's label check, raised in lm_head's forward)
    leaves the model's own scale in place; the next call works."""
    _needs(arch)
    model = _build(arch)
    head = install_logprob_head(model)
    ids = torch.randint(0, 311, (2, 5))
    with pytest.raises(ValueError, match="outside"):
        head.logprobs(ids, torch.full_like(ids, 311))
    assert _where(model, arch) == SCALED[arch][1]
    assert head._call is None
    assert head.logprobs(ids).logprob.shape == ids.shape


def test_cohere_reads_the_attribute_its_forward_reads():
    """CohereForCausalLM copies ``config.logit_scale`` to ``self.logit_scale`` at init and
    multiplies by the copy: a later change of the config field changes nothing, one of
    the attribute changes the logits; the head follows the attribute either way."""
    _needs(MULTIPLY)

    def build():
        model = _build(MULTIPLY)
        model.config.logit_scale = 7.0  # not read by the forward
        model.logit_scale = 0.5
        return model

    model = _check_against_stock(build)
    assert model.logit_scale == 0.5 and model.config.logit_scale == 7.0
    assert model_logit_transform(model).logit_scale == 0.5


def test_logits_to_keep_with_a_scale():
    _needs(DIVIDE)
    ids, labels, mask = _batch()
    stock = _build(DIVIDE)
    want = stock_logprobs(stock, ids, labels, attention_mask=mask)[0][:, -3:]
    head = install_logprob_head(_build(DIVIDE))
    got = head.logprobs(ids, labels, attention_mask=mask, logits_to_keep=3).logprob
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("field", FIELDS)
def test_fields_on_unlisted_classes_are_refused(field):
    """A post-processing field set on a class whose forward lp-hf has not read (Llama's
    ignores them all) is refused at install and at a call, naming the field."""
    model = tiny_model("llama")
    setattr(model.config, field, 0.5)
    with pytest.raises(ValueError, match=field):
        install_logprob_head(model)
    with pytest.raises(ValueError, match=field):
        model_logit_transform(model)
    setattr(model.config, field, None)
    head = install_logprob_head(model)
    setattr(model.config, field, 0.5)  # set after install
    with pytest.raises(ValueError, match=field):
        head.logprobs(torch.randint(0, 311, (1, 4)))
    setattr(model.config, field, 1.0)
    if field == "final_logit_softcapping":  # a cap of 1 is a cap
        with pytest.raises(ValueError, match=field):
            head.logprobs(torch.randint(0, 311, (1, 4)))
    else:  # a scale of 1 is none
        head.logprobs(torch.randint(0, 311, (1, 4)))


def test_fields_a_listed_class_does_not_read_are_refused():
    for arch, field in ((MULTIPLY, "logits_scaling"), (DIVIDE, "final_logit_softcapping")):
        _needs(arch)
        model = _build(arch)
        setattr(model.config, field, 2.0)
        with pytest.raises(ValueError, match=field):
            install_logprob_head(model)


def test_bad_scale_values_name_the_field():
    _needs(MULTIPLY)
    _needs(DIVIDE)
    _needs(ATTRIBUTE)
    cases = [
        (_build(MULTIPLY), "logit_scale", -1.0, ValueError),
        (_build(MULTIPLY), "logit_scale", None, TypeError),  # the forward would fail
        (_build(MULTIPLY), "logit_scale", "0.25", TypeError),
        (_build(DIVIDE), "config.logits_scaling", 0.0, ValueError),
        (_build(ATTRIBUTE), "model.lm_head_multiplier", float("nan"), ValueError),
        (_build(ATTRIBUTE), "model.lm_head_multiplier", True, TypeError),
    ]
    for model, path, value, error in cases:
        *parents, name = path.split(".")
        holder = model
        for part in parents:
            holder = getattr(holder, part)
        good = getattr(holder, name)
        setattr(holder, name, value)
        with pytest.raises(error, match=name):
            install_logprob_head(model)
        setattr(holder, name, good)
        head = install_logprob_head(model)
        setattr(holder, name, value)  # set after install: the call raises, before the model
        with pytest.raises(error, match=name):
            head.logprobs(torch.randint(0, 311, (1, 4)))
        assert getattr(holder, name) is value and head._call is None


def test_other_changes_of_a_scaled_result_are_refused(monkeypatch):
    """With the scale switched to 1 the model returns a copy of the head's result, which
    must hold its values bit for bit: anything else raises."""
    _needs(MULTIPLY)
    model = _build(MULTIPLY)
    head = install_logprob_head(model)
    inner = type(model).forward

    def doubled(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    monkeypatch.setattr(type(model), "forward", doubled)
    with pytest.raises(RuntimeError, match="changed what its output layer returned"):
        head.logprobs(torch.randint(0, 311, (1, 4)))
    assert model.logit_scale == SCALED[MULTIPLY][1]
