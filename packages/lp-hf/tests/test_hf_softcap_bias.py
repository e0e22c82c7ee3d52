"""lp-hf with final-logit softcapping and with an LM-head bias (CPU, fp32).

The stock path is the model's own: Gemma2ForCausalLM (and the other Gemma-style classes)
caps what lm_head returned (``c * tanh(logits / c)``) in its forward, and an
``nn.Linear(bias=True)`` head adds its bias; the head must give the same log-probs,
entropy, lse and every parameter gradient (the bias's included).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the GPU hosts may lack it

from _hf_models import (
    ARCHS,
    SOFTCAPPED,
    assert_grads_close,
    grads,
    stock_logprobs,
    stock_targets,
    tiny_model,
)

from lp_hf import install_logprob_head, model_softcap

TOL = dict(rtol=1e-4, atol=1e-5)
CAP = 2.0  # small against these models' logits (|l| up to ~8), so tanh bends them

needs_gemma2 = pytest.mark.skipif("gemma2" not in ARCHS, reason="transformers lacks Gemma2")


def _batch(vocab: int, b: int = 3, t: int = 9, seed: int = 1):
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
    ids, labels, mask = _batch(311)
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


@needs_gemma2
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gemma2_softcap_matches_the_models_own(tied):
    """lp applies the config's cap; the model's own cap is off during the call and back
    after it (the stock path and ``paused()`` use it)."""
    model = _check_against_stock(lambda: tiny_model("gemma2", tied=tied, attn="eager", softcap=CAP))
    assert model.config.final_logit_softcapping == CAP  # restored
    head = install_logprob_head(model, temperature=0.7)
    ids = torch.randint(0, 311, (1, 6))
    with head.paused(), torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert float(logits.abs().max()) <= CAP  # the model capped them itself
    head.remove()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", [a for a in SOFTCAPPED if a != "gemma2"])
def test_other_softcapped_families(arch):
    """The other classes whose forward reads ``config.final_logit_softcapping`` the way
    Gemma 2's does."""
    if arch not in ARCHS:
        pytest.skip(f"this transformers lacks {arch}")
    model = _check_against_stock(lambda: tiny_model(arch, attn="eager", softcap=CAP))
    assert model.config.final_logit_softcapping == CAP
    assert model_softcap(model) == CAP


@needs_gemma2
def test_the_softcap_changes_the_result():
    """The comparison above could fail: on these models the cap moves the log-probs by
    far more than the tolerance."""
    ids, labels, mask = _batch(311)
    capped = stock_logprobs(
        tiny_model("gemma2", attn="eager", softcap=CAP), ids, labels, attention_mask=mask
    )[0]
    plain = stock_logprobs(
        tiny_model("gemma2", attn="eager", softcap=None), ids, labels, attention_mask=mask
    )[0]
    assert float((capped - plain).detach().abs().max()) > 0.1


@needs_gemma2
def test_gemma2_without_softcap():
    """``final_logit_softcapping=None``: no cap on either side."""
    _check_against_stock(lambda: tiny_model("gemma2", attn="eager", softcap=None), temp=1.0)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_linear_head_with_bias(arch):
    """An ``nn.Linear(H, V, bias=True)`` output layer: the bias enters the logits and gets
    its gradient (gemma2: together with the softcap)."""
    if arch not in ARCHS:
        pytest.skip("transformers lacks Gemma2")
    softcap = CAP if arch == "gemma2" else None
    model = _check_against_stock(lambda: tiny_model(arch, attn="eager", softcap=softcap, bias=True))
    assert model.lm_head.bias.grad is not None


@needs_gemma2
def test_model_softcap_reads_and_checks_the_config():
    assert model_softcap(tiny_model("llama", vocab=311)) is None  # LlamaConfig has no field
    model = tiny_model("gemma2", attn="eager", softcap=None)
    assert model_softcap(model) is None
    model.config.final_logit_softcapping = 30.0
    assert model_softcap(model) == 30.0
    for bad in (-1.0, float("inf")):
        model.config.final_logit_softcapping = bad
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            install_logprob_head(model)


@needs_gemma2
def test_softcap_is_restored_after_an_error():
    model = tiny_model("gemma2", attn="eager", softcap=30.0)
    head = install_logprob_head(model)
    ids = torch.randint(0, 311, (2, 5))
    with pytest.raises(ValueError, match="labels must have the shape"):
        head.logprobs(ids, ids[:, :-1])
    with pytest.raises(ValueError, match="outside"):
        head.logprobs(ids, torch.full_like(ids, 311))  # raised inside the model forward
    assert model.config.final_logit_softcapping == 30.0
    assert head.logprobs(ids).logprob.shape == ids.shape
