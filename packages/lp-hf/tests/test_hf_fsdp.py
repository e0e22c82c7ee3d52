"""lp-hf under FSDP2 (``fully_shard``) over gloo, 2 CPU ranks, data parallel.

Each rank runs its own rows of one global batch through the sharded model with the head
installed. After backward each rank's sharded gradient (``p.grad.to_local()``) must equal
its shard (``torch.chunk`` along dim 0, FSDP2's layout) of the full-model gradient of a
single-process stock run on the whole batch, whose loss is the mean of the ranks' losses
(FSDP2 averages gradients over the ranks).
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
        "lp_kernels",
        "lp_hf",
    ]
)

WORLD = 2
ROWS = 2  # per rank
T = 8


def _global_batch(vocab: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (WORLD * ROWS, T), generator=g)
    labels = ids.clone()
    labels[0, 2] = -100
    labels[3, 4] = -100
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    mask[2, :2] = 0
    return ids, labels, mask


def _loss(logprob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A per-rank loss; over the whole batch it is summed, so ranks scale it by WORLD
    to undo FSDP2's average."""
    return -(logprob.sum() + 0.1 * entropy.sum()) / (WORLD * ROWS * T)


def _model(arch, tied, vocab):
    """The tiny model of a case; gemma2: an untied lm_head with a bias and a softcap;
    cohere: a final-logit scale (a module attribute, on the class fully_shard makes)."""
    if arch == "gemma2":
        return tiny_model(arch, tied=False, vocab=vocab, attn="eager", softcap=2.0, bias=True)
    if arch == "cohere":
        return tiny_model(arch, tied=tied, vocab=vocab, attn="eager", logit_scale=0.25)
    return tiny_model(arch, tied=tied, vocab=vocab)


def _fsdp_rank(rank, world, arch, tied, vocab, install_first):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import lp_hf.head
    from lp_hf import install_logprob_head

    mesh = init_device_mesh("cpu", (world,))
    model = _model(arch, tied, vocab)
    if install_first:
        head = install_logprob_head(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if not tied:  # tied: the weight is the embedding's, sharded with the root
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not install_first:
        head = install_logprob_head(model)
    assert model.get_output_embeddings() is head.layer
    assert isinstance(model.lm_head.weight, DTensor)  # sharded outside forward

    seen = []
    inner = lp_hf.head.linear_logprob

    def spy(hidden, weight, targets, **kwargs):
        seen.append((isinstance(weight, DTensor), tuple(weight.shape)))
        return inner(hidden, weight, targets, **kwargs)

    lp_hf.head.linear_logprob = spy
    ids, labels, mask = _global_batch(vocab)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    out = head.logprobs(ids[rows], labels[rows], attention_mask=mask[rows], return_entropy=True)
    (_loss(out.logprob, out.entropy) * world).backward()
    local = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        local[name] = p.grad.to_local()
    still_sharded = isinstance(model.lm_head.weight, DTensor)
    head.remove()
    return out.logprob, out.entropy, local, seen, still_sharded


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "arch,tied,vocab,install_first",
    [
        ("llama", False, 311, False),
        ("qwen2", True, 500, True),
        ("gemma2", False, 311, False),
        ("cohere", True, 311, False),
    ],
    ids=[
        "llama-untied-prime-vocab",
        "qwen2-tied-installed-before-sharding",
        "gemma2-softcap-and-bias",
        "cohere-scale-tied",
    ],
)
def test_fsdp2_sharded_grads_equal_the_full_model_shards(arch, tied, vocab, install_first):
    if arch not in ARCHS:
        pytest.skip(f"this transformers lacks {arch}")
    ids, labels, mask = _global_batch(vocab)
    stock = _model(arch, tied, vocab)
    lp, ent, _ = stock_logprobs(stock, ids, labels, attention_mask=mask)
    _loss(lp, ent).backward()
    full = grads(stock)

    results = run_ranks(_fsdp_rank, WORLD, arch, tied, vocab, install_first, timeout=600)
    for rank, (r_lp, r_ent, local, seen, still_sharded) in enumerate(results):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.testing.assert_close(r_lp, lp[rows].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r_ent, ent[rows].detach(), rtol=1e-4, atol=1e-5)
        # lp saw FSDP's all-gathered weight, a plain [V, H] tensor, once
        assert seen == [(False, (vocab, stock.config.hidden_size))], seen
        assert still_sharded  # and the parameter is the sharded DTensor again after it
        assert local.keys() == full.keys()
        for name, g in full.items():
            want = g.chunk(WORLD, dim=0)[rank]
            scale = float(g.abs().max())
            assert scale > 0, name
            assert local[name].shape == want.shape, name
            err = float((local[name] - want).abs().max())
            assert err <= GRAD_REL * scale, f"rank {rank} {name}: error {err:.3g} of {scale:.3g}"
