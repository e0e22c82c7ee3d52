"""lp-hf on tiny Llama / Qwen2 models (CPU, fp32): parity with the stock logits path.

Every case compares the head's log-probs (and entropy, lse) and the gradient of every
parameter with the stock path of ``_hf_models.stock_logprobs`` (materialized logits ->
log_softmax -> gather, with the same shift and masks) under the same loss.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the GPU hosts may lack it

from _hf_models import assert_grads_close, grads, stock_logprobs, stock_targets, tiny_model

from lp_hf import install_logprob_head, next_token_targets, slice_to_keep

TOL = dict(rtol=1e-4, atol=1e-5)


def _batch(vocab: int, b: int = 3, t: int = 9, seed: int = 1):
    """Ids, labels with -100 holes, and an attention mask with right and left padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    labels[1, 5:7] = -100
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -2:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return ids, labels, mask


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize(
    "arch,tied,vocab",
    [("llama", False, 311), ("llama", True, 512), ("qwen2", False, 1000), ("qwen2", True, 311)],
)
def test_outputs_and_every_grad_match_stock(arch, tied, vocab):
    """Log-prob, entropy and lse at temperature 0.7 with -100 labels and left and right
    padding; one loss over all three; every parameter's gradient (tied: the one shared
    embedding gets both contributions)."""
    ids, labels, mask = _batch(vocab)
    w_lp, w_ent, w_lse = _weights(ids.shape, seed=2)
    temp = 0.7

    stock = tiny_model(arch, tied=tied, vocab=vocab)
    ref = stock_logprobs(stock, ids, labels, attention_mask=mask, temperature=temp)
    ((ref[0] * w_lp + ref[1] * w_ent + ref[2] * w_lse).sum()).backward()
    ref_grads = grads(stock)

    model = tiny_model(arch, tied=tied, vocab=vocab)
    n_params = len(list(model.parameters()))
    head = install_logprob_head(model, temperature=temp)
    out = head.logprobs(ids, labels, attention_mask=mask, return_entropy=True, return_lse=True)
    assert len(list(model.parameters())) == n_params  # nothing registered twice
    assert out.logprob.shape == ids.shape and out.logprob.dtype == torch.float32
    ((out.logprob * w_lp + out.entropy * w_ent + out.lse * w_lse).sum()).backward()

    _, valid = stock_targets(labels, mask)
    for got, want in zip(out, ref, strict=True):
        torch.testing.assert_close(got, want, **TOL)
        assert torch.all(got[~valid] == 0)  # no target: exactly 0
    assert_grads_close(grads(model), ref_grads)  # every parameter takes part


def test_tied_gradient_accumulates_into_the_shared_parameter():
    """With tied embeddings the head's weight gradient and the embedding lookup's gradient
    land in one ``.grad``: equal to the sum of the two computed separately."""
    vocab = 311
    ids, _, _ = _batch(vocab)
    model = tiny_model("llama", tied=True, vocab=vocab)
    weight = model.lm_head.weight
    head = install_logprob_head(model)
    head.logprobs(ids).logprob.sum().backward()
    both = weight.grad.clone()

    # the head's part alone: the same hidden states, detached from the embedding
    hidden = model.model(input_ids=ids).last_hidden_state.detach()
    w = weight.detach().clone().requires_grad_(True)
    targets = next_token_targets(ids)
    logp = torch.log_softmax(hidden @ w.T, dim=-1)
    valid = targets != -100
    logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][valid].sum().backward()
    head_part = w.grad
    looked_up = torch.zeros(vocab, dtype=torch.bool)
    looked_up[ids.unique()] = True
    torch.testing.assert_close(both[~looked_up], head_part[~looked_up], **TOL)
    lookup_part = both[looked_up] - head_part[looked_up]  # the embedding's own gradient
    assert lookup_part.abs().max() > 0.1 * head_part.abs().max()


def test_remove_restores_the_stock_model_bitwise():
    model = tiny_model("qwen2", tied=False, vocab=500)
    ids, _, mask = _batch(500)
    layer = model.lm_head
    before = model(ids, attention_mask=mask).logits
    keys = list(model.state_dict())
    with install_logprob_head(model) as head:
        assert model.get_output_embeddings() is layer and model.lm_head is layer
        assert "forward" in layer.__dict__
        assert list(model.state_dict()) == keys
        assert head.logprobs(ids, attention_mask=mask).logprob.shape == ids.shape
        with pytest.raises(RuntimeError, match=r"head\.logprobs"):
            model(ids)  # a plain call would return no logits
        with head.paused():  # e.g. generation: the stock logits
            assert torch.equal(model(ids, attention_mask=mask).logits, before)
    assert not head.installed
    assert model.lm_head is layer and "forward" not in layer.__dict__
    assert type(layer).forward is torch.nn.Linear.forward
    assert torch.equal(model(ids, attention_mask=mask).logits, before)
    with pytest.raises(RuntimeError, match="removed"):
        head.logprobs(ids)
    head.remove()  # idempotent


def test_install_is_idempotent_and_options_conflict():
    model = tiny_model("llama", vocab=311)
    head = install_logprob_head(model, temperature=0.5)
    assert install_logprob_head(model, temperature=0.5) is head
    with pytest.raises(ValueError, match="other options"):
        install_logprob_head(model, temperature=0.6)
    head.remove()
    assert install_logprob_head(model, temperature=0.6) is not head


@pytest.mark.parametrize(
    "keep",
    [
        3,
        torch.tensor([0, 4, 8]),
        torch.tensor([[1, 2], [5, 7], [0, 8]]),
        torch.tensor([[1, 0, 1, 0, 0, 0, 0, 1, 0]] * 3, dtype=torch.bool),
    ],
    ids=["int", "1d", "2d-int", "2d-bool"],
)
def test_logits_to_keep(keep):
    """Only the kept positions are computed; each equals the full stock run there, and the
    gradients match the stock path restricted to those positions."""
    vocab = 311
    ids, labels, mask = _batch(vocab)
    stock = tiny_model("llama", vocab=vocab)
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        try:  # transformers 4.x slices hidden[:, keep, :]: an error or another shape
            shape = stock(ids, logits_to_keep=keep).logits.shape[:-1]
        except IndexError:
            shape = None
        if shape != slice_to_keep(ids, keep).shape:
            pytest.skip("this transformers' models take no 2-D logits_to_keep")
    full = stock_logprobs(stock, ids, labels, attention_mask=mask)[0]
    want = slice_to_keep(full, keep)
    want.sum().backward()

    model = tiny_model("llama", vocab=vocab)
    head = install_logprob_head(model)
    got = head.logprobs(ids, labels, attention_mask=mask, logits_to_keep=keep).logprob
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)
    got.sum().backward()
    assert_grads_close(grads(model), grads(stock))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_match_separate_sequences(attn):
    """Padding-free packing: three sequences in one ``[1, T]`` row with ``position_ids``
    restarting at 0 and no attention mask. transformers keeps them apart in attention
    (sdpa and eager); each sequence's log-probs equal a separate run of it, the boundary
    positions get 0, and the gradients equal the sum of the separate runs'."""
    vocab = 311
    lengths = [4, 6, 3]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]

    stock = tiny_model("qwen2", vocab=vocab, attn=attn)
    parts = [stock_logprobs(stock, s)[0] for s in seqs]
    want = torch.cat(parts, dim=1)
    sum(p.sum() for p in parts).backward()

    model = tiny_model("qwen2", vocab=vocab, attn=attn)
    head = install_logprob_head(model)
    out = head.logprobs(packed, position_ids=pos, return_entropy=True)
    assert out.logprob.shape == (1, sum(lengths))
    torch.testing.assert_close(out.logprob, want, **TOL)
    ends = torch.tensor(lengths).cumsum(0) - 1
    assert torch.all(out.logprob[0, ends] == 0) and torch.all(out.entropy[0, ends] == 0)
    assert torch.all(out.logprob[0, ends[:-1] + 1] != 0)  # each sequence's first target
    out.logprob.sum().backward()
    assert_grads_close(grads(model), grads(stock))


def test_shift_labels_equal_labels():
    vocab = 311
    ids, labels, mask = _batch(vocab)
    model = tiny_model("llama", vocab=vocab)
    head = install_logprob_head(model)
    a = head.logprobs(ids, labels, attention_mask=mask).logprob
    shifted = next_token_targets(labels, attention_mask=mask)
    b = head.logprobs(ids, attention_mask=mask, shift_labels=shifted).logprob
    assert torch.equal(a, b)


def _checkpointed(model):
    """transformers' activation checkpointing of the decoder layers (its 5.x name first)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        assert model.is_activation_checkpointing
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert model.is_gradient_checkpointing
    return model


def test_gradient_checkpointing_of_decoder_layers():
    """transformers' gradient checkpointing (decoder layers, train mode) recomputes the
    layers in backward but never the output layer: gradients still match the stock path."""
    vocab = 311
    ids, labels, mask = _batch(vocab)
    stock = _checkpointed(tiny_model("llama", vocab=vocab).train())
    stock_logprobs(stock, ids, labels, attention_mask=mask)[0].sum().backward()
    model = _checkpointed(tiny_model("llama", vocab=vocab).train())
    head = install_logprob_head(model)
    head.logprobs(ids, labels, attention_mask=mask).logprob.sum().backward()
    assert_grads_close(grads(model), grads(stock))


def test_next_token_targets_rules():
    labels = torch.tensor([[5, 6, 7, -100, 9, 10], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]])
    i = -100
    assert next_token_targets(labels).tolist() == [[6, 7, i, 9, 10, i], [2, 3, 4, 5, 6, i]]
    assert next_token_targets(labels, attention_mask=mask).tolist() == [
        [6, 7, i, 9, 10, i],
        [i, 3, 4, 5, i, i],
    ]
    assert next_token_targets(labels, position_ids=pos).tolist() == [
        [6, 7, i, 9, 10, i],
        [i, 3, 4, 5, 6, i],
    ]
    assert next_token_targets(labels, position_ids=pos[:1]).tolist() == [
        [6, 7, i, 9, 10, i],
        [2, 3, i, 5, 6, i],
    ]


def test_errors_name_the_problem():
    model = tiny_model("llama", vocab=311)
    ids = torch.randint(0, 311, (2, 5))
    with pytest.raises(TypeError, match="get_output_embeddings"):
        install_logprob_head(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="temperature"):
        install_logprob_head(model, temperature=0.0)
    with pytest.raises(ValueError, match="ignore_index"):
        install_logprob_head(model, ignore_index=3)
    with pytest.raises(ValueError, match="backend"):
        install_logprob_head(model, backend="cuda")

    scaled = tiny_model("llama", vocab=311)
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        install_logprob_head(scaled)

    head = install_logprob_head(model)
    with pytest.raises(ValueError, match="labels must have the shape"):
        head.logprobs(ids, ids[:, :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        head.logprobs(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match="labels must be an integer"):
        head.logprobs(ids, ids.float())
    with pytest.raises(ValueError, match="temperature"):
        head.logprobs(ids, temperature=-1.0)
    with pytest.raises(ValueError, match=r"outside \[0, 311\)"):  # lp_kernels: an id >= V
        head.logprobs(ids, torch.full_like(ids, 311))
    assert head._call is None  # the per-call record is cleared after an error


def test_post_processed_logits_are_refused(monkeypatch):
    """A model that changes the output layer's result (here: scales it) is caught at the
    first call, not returned as log-probs."""
    model = tiny_model("llama", vocab=311)
    head = install_logprob_head(model)
    inner = type(model).forward

    def scaled(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    monkeypatch.setattr(type(model), "forward", scaled)
    with pytest.raises(RuntimeError, match="changed what its output layer returned"):
        head.logprobs(torch.randint(0, 311, (1, 4)))


def test_recompute_of_the_output_layer_raises():
    """A checkpointed region that contains the output layer recomputes it in backward,
    after the per-call record is cleared: that raises, it never runs with stale targets."""
    from torch.utils.checkpoint import checkpoint

    model = tiny_model("llama", vocab=311)
    head = install_logprob_head(model)
    inner = head._layer_forward
    model.lm_head.__dict__["forward"] = lambda h: checkpoint(inner, h, use_reentrant=False)
    out = head.logprobs(torch.randint(0, 311, (2, 5)))
    with pytest.raises(RuntimeError, match="activation checkpoint"):
        out.logprob.sum().backward()
    model.lm_head.__dict__["forward"] = inner
    head.remove()
    assert "forward" not in model.lm_head.__dict__
