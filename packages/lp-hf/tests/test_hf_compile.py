"""lp-hf's head under ``torch.compile(fullgraph=True)``: the model's training forward and
backward compile in one graph with lp's custom op inside, and give eager mode's bits.

The compiler is ``aot_eager``: it runs the model's own operations as eager mode does, so
every output and gradient can be compared bit for bit (Inductor would regenerate the
decoder's kernels, whose bits are not lp's to keep).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the GPU hosts may lack it

from _hf_models import grads, tiny_model

from lp_hf import install_logprob_head

testing = pytest.importorskip("torch._dynamo.testing")
VOCAB = 311


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batches():
    """Two batches of one shape: ids, labels with -100 holes, right and left padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (3, 9), generator=g)
        labels = ids.clone()
        labels[0, 3] = -100
        labels[1, 5:7] = -100
        mask = torch.ones(3, 9, dtype=torch.long)
        mask[1, -2:] = 0
        mask[2, :3] = 0
        weights = [torch.randn(3, 9, generator=g) for _ in range(3)]
        out.append((ids, labels, mask, weights))
    return out


def _steps(mode: str, counter=None) -> list:
    """Two training steps' outputs and every parameter's gradient; ``mode``: ``"eager"``,
    ``"model"`` (``model.compile``) or ``"logprobs"`` (``torch.compile(head.logprobs)``)."""
    model = tiny_model("llama", vocab=VOCAB)
    head = install_logprob_head(model, temperature=0.7, backend="torch")
    logprobs = head.logprobs
    if mode == "model":
        model.compile(backend=counter, fullgraph=True)
    elif mode == "logprobs":
        logprobs = torch.compile(head.logprobs, backend=counter, fullgraph=True)
    results = []
    for ids, labels, mask, (w_lp, w_ent, w_lse) in _batches():
        model.zero_grad()
        out = logprobs(ids, labels, attention_mask=mask, return_entropy=True, return_lse=True)
        ((out.logprob * w_lp + out.entropy * w_ent + out.lse * w_lse).sum()).backward()
        results.append((list(out), grads(model)))
    return results


@pytest.mark.parametrize("mode", ["model", "logprobs"])
def test_fullgraph_training_step_has_eager_bits(mode):
    """Log-prob, entropy, lse and every parameter's gradient ``torch.equal`` to eager mode's,
    for two steps that share one compiled graph (no recompile for new data)."""
    eager = _steps("eager")
    counter = testing.CompileCounterWithBackend("aot_eager")
    compiled = _steps(mode, counter)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled for two steps"
    for step, ((out_e, grads_e), (out_c, grads_c)) in enumerate(zip(eager, compiled, strict=True)):
        for name, a, b in zip(("logprob", "entropy", "lse"), out_e, out_c, strict=True):
            assert torch.equal(a, b), f"step {step}: {name}"
        for name, g in grads_e.items():
            assert torch.equal(g, grads_c[name]), f"step {step}: grad of {name}"
