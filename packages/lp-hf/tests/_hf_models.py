"""Tiny transformers causal LMs built from a config (no download) and the stock log-prob path.

The stock path is what a trainer does without lp: ``model(...).logits`` ``[B, T, V]`` ->
``log_softmax(logits / T)`` -> gather the next token, with the causal-LM shift and masks
written out here independently of ``lp_hf.targets``.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
try:  # Gemma 2: final-logit softcapping in the model's forward, after lm_head
    from transformers import Gemma2Config, Gemma2ForCausalLM

    ARCHS["gemma2"] = (Gemma2Config, Gemma2ForCausalLM)
except ImportError:  # pragma: no cover - an old transformers
    pass


def tiny_model(
    arch: str = "llama",
    *,
    tied: bool = False,
    vocab: int = 311,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    softcap: float | None = None,
    bias: bool = False,
) -> torch.nn.Module:
    """A randomly initialised 2-layer model; the same seed gives the same weights.

    ``softcap``: gemma2's ``final_logit_softcapping`` (its forward applies it after
    lm_head). ``bias``: lm_head becomes an ``nn.Linear(H, V, bias=True)`` (untied only).
    """
    config_cls, model_cls = ARCHS[arch]
    extra = {}
    if arch == "gemma2":
        extra = dict(head_dim=hidden // 4, final_logit_softcapping=softcap)
    elif softcap is not None:
        raise ValueError(f"{arch} applies no final-logit softcap")
    if bias and tied:
        raise ValueError("a biased lm_head is untied")
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attn_implementation=attn,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    if bias:
        model.lm_head = torch.nn.Linear(hidden, vocab, bias=True)
    model = model.to(dtype)
    with torch.no_grad():  # a visible scale: random init gives near-uniform softmaxes
        model.get_output_embeddings().weight.normal_(0.0, 0.5)
        if bias:
            model.lm_head.bias.normal_(0.0, 1.0)
    model.eval()  # no dropout; gradients still flow
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def stock_targets(
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets [B, T], valid [B, T])`` on ``labels``' device: position t scores label t + 1
    where valid (an element-by-element loop, on host copies)."""
    device = labels.device
    labels = labels.cpu()
    attention_mask = None if attention_mask is None else attention_mask.cpu()
    position_ids = None if position_ids is None else position_ids.cpu()
    b, t = labels.shape
    targets = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        for j in range(t - 1):
            ok = int(labels[i, j + 1]) != ignore_index
            if attention_mask is not None:
                ok = ok and bool(attention_mask[i, j]) and bool(attention_mask[i, j + 1])
            if position_ids is not None:
                pos = position_ids[0 if position_ids.shape[0] == 1 else i]
                ok = ok and int(pos[j + 1]) - int(pos[j]) == 1
            if ok:
                targets[i, j] = labels[i, j + 1]
                valid[i, j] = True
    return targets.to(device), valid.to(device)


def stock_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprob, entropy, lse)`` ``[B, T]`` fp32 through the materialized logits; 0 where
    no target."""
    labels = input_ids if labels is None else labels
    targets, valid = stock_targets(labels, attention_mask, position_ids)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    lse = torch.logsumexp(z, dim=-1)
    zero = torch.zeros_like(lp)
    return (
        torch.where(valid, lp, zero),
        torch.where(valid, ent, zero),
        torch.where(valid, lse, zero),
    )


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (a clone; zeros for a parameter without one)."""
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


GRAD_REL = 2e-5
"""Gradient tolerance relative to each tensor's largest entry: fp32 stock and lp each sit
about 1.5e-6 of the max away from an fp64 run of the stock path on these models."""


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names; every gradient within ``GRAD_REL`` of its largest entry; none all-zero."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        scale = float(w.abs().max())
        assert scale > 0, f"{name}: no gradient reached it"
        err = float((got[name] - w).abs().max())
        assert err <= GRAD_REL * scale, f"{name}: max error {err:.3g}, max |grad| {scale:.3g}"
