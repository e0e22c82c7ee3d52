"""lp-hf under torch-native tensor parallel over gloo, 2 CPU ranks.

``parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})``
leaves ``lm_head.weight`` a ``Shard(0)`` DTensor (the vocabulary split by torch's chunking);
the head passes it to ``linear_logprob``, which reads it as vocabulary shards. Every rank
runs the same batch; its log-probs and entropy must equal a single-process stock run, the
``lm_head`` gradient must be a ``Shard(0)`` DTensor holding this rank's chunk of the stock
gradient, and every other parameter's gradient must equal the stock one. Tied embeddings:
the embedding is parallelized too (``RowwiseParallel``, also ``Shard(0)``) and the head's
weight re-tied to it, so one DTensor gets both gradients. The final-logit transforms go
along: Gemma 2's softcap with a biased head (the bias a ``Shard(0)`` DTensor), Cohere's and
Granite's scales.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the GPU hosts may lack it

from _hf_models import ARCHS, GRAD_REL, grads, stock_logprobs, tiny_model

from lp_testing import run_ranks, set_forkserver_preload

set_forkserver_preload(
    [
        "transformers",
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.gemma2.modeling_gemma2",
        "transformers.models.cohere.modeling_cohere",
        "transformers.models.granite.modeling_granite",
        "lp_kernels",
        "lp_hf",
    ]
)

WORLD = 2
B, T = 3, 8


def _batch(vocab: int):
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return ids, labels, mask


def _loss(logprob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    return -(logprob.sum() + 0.1 * entropy.sum()) / (B * T)


def _model(arch, tied, vocab):
    """The tiny model of a case; gemma2: an untied lm_head with a bias and a softcap;
    cohere, granite: a final-logit scale (a module attribute; a config divisor)."""
    if arch == "gemma2":
        return tiny_model(arch, tied=False, vocab=vocab, attn="eager", softcap=2.0, bias=True)
    if arch == "cohere":
        return tiny_model(arch, tied=tied, vocab=vocab, attn="eager", logit_scale=0.25)
    if arch == "granite":
        return tiny_model(arch, tied=tied, vocab=vocab, attn="eager", logits_scaling=4.0)
    return tiny_model(arch, tied=tied, vocab=vocab)


def _parallelize(model, mesh, tied: bool, output_layouts=None):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"lm_head": ColwiseParallel(output_layouts=output_layouts or Replicate())}
    if tied:  # the embedding shards the same rows (Shard(0)); re-tie after the plan
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def _tp_rank(rank, world, arch, tied, vocab, install_first):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import lp_hf.head
    from lp_hf import install_logprob_head

    mesh = init_device_mesh("cpu", (world,))
    model = _model(arch, tied, vocab)
    if install_first:
        head = install_logprob_head(model)
    _parallelize(model, mesh, tied)
    if not install_first:
        head = install_logprob_head(model)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    assert (weight is model.model.embed_tokens.weight) == tied

    seen = []
    inner = lp_hf.head.linear_logprob

    def spy(hidden, weight, targets, **kwargs):
        seen.append((type(hidden).__name__, type(weight).__name__, tuple(weight.shape)))
        return inner(hidden, weight, targets, **kwargs)

    lp_hf.head.linear_logprob = spy
    ids, labels, mask = _batch(vocab)
    out = head.logprobs(ids, labels, attention_mask=mask, return_entropy=True)
    assert not isinstance(out.logprob, DTensor)
    _loss(out.logprob, out.entropy).backward()
    local = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            local[name] = ("dtensor", p.grad.to_local())
        else:
            local[name] = ("plain", p.grad)
    head.remove()
    return out.logprob, out.entropy, local, seen


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "arch,tied,vocab,install_first",
    [
        ("llama", False, 311, False),
        ("qwen2", True, 500, True),
        ("gemma2", False, 311, False),
        ("cohere", True, 311, True),
        ("granite", False, 500, False),
    ],
    ids=[
        "llama-untied-prime-vocab",
        "qwen2-tied-installed-before-parallelize",
        "gemma2-softcap-and-bias",
        "cohere-scale-tied",
        "granite-scale",
    ],
)
def test_tp_logprobs_and_grads_equal_the_stock_run(arch, tied, vocab, install_first):
    if arch not in ARCHS:
        pytest.skip(f"this transformers lacks {arch}")
    ids, labels, mask = _batch(vocab)
    stock = _model(arch, tied, vocab)
    lp, ent, _ = stock_logprobs(stock, ids, labels, attention_mask=mask)
    _loss(lp, ent).backward()
    full = grads(stock)
    chunk = -(-vocab // WORLD)  # torch's Shard(0): ceil(V / P) rows, the last rank the rest

    results = run_ranks(_tp_rank, WORLD, arch, tied, vocab, install_first, timeout=600)
    for rank, (r_lp, r_ent, local, seen) in enumerate(results):
        torch.testing.assert_close(r_lp, lp.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r_ent, ent.detach(), rtol=1e-4, atol=1e-5)
        # lp got the DTensor weight (global shape) and a Replicate DTensor hidden, once
        assert seen == [("DTensor", "DTensor", (vocab, stock.config.hidden_size))], seen
        assert local.keys() == full.keys()
        head_names = {"model.embed_tokens.weight" if tied else "lm_head.weight", "lm_head.bias"}
        for name, g in full.items():
            kind, got = local[name]
            assert kind == ("dtensor" if name in head_names else "plain"), name
            want = g[rank * chunk : (rank + 1) * chunk] if kind == "dtensor" else g
            scale = float(want.abs().max())
            assert scale > 0, name
            assert got.shape == want.shape, name
            err = float((got - want).abs().max())
            assert err <= GRAD_REL * scale, f"rank {rank} {name}: error {err:.3g} of {scale:.3g}"


def _refused_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from lp_hf import install_logprob_head

    mesh = init_device_mesh("cpu", (world,))
    messages = {}
    # loss-parallel layout: the hook would split the head's [B, T, k] result
    model = tiny_model("llama", vocab=311)
    _parallelize(model, mesh, tied=False, output_layouts=Shard(-1))
    head = install_logprob_head(model)
    ids, labels, mask = _batch(311)
    with pytest.raises(RuntimeError) as info:
        head.logprobs(ids, labels, attention_mask=mask)
    messages["shard-1"] = str(info.value)
    head.remove()
    # transformers' own plan replaces lm_head.forward: refused at install
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    model = tiny_model("llama", vocab=311)
    apply_tensor_parallelism(model, mesh, {"lm_head": "colwise_gather_output"})
    with pytest.raises(ValueError) as info:
        install_logprob_head(model)
    messages["transformers-plan"] = str(info.value)
    return messages


@pytest.mark.timeout(900)
def test_tp_layouts_lp_hf_cannot_take_are_refused_on_every_rank():
    for messages in run_ranks(_refused_rank, WORLD, timeout=600):
        assert "ColwiseParallel(output_layouts=Replicate())" in messages["shard-1"]
        assert "tp_plan" in messages["transformers-plan"]
        assert "parallelize_module" in messages["transformers-plan"]
