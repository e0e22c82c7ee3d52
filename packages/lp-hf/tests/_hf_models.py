"""Tiny transformers causal LMs built from a config (no download) and the stock log-prob path.

The stock path is what a trainer does without lp: ``model(...).logits`` ``[B, T, V]`` ->
``log_softmax(logits / T)`` -> gather the next token, with the causal-LM shift and masks
written out here independently of ``lp_hf.targets``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}
"""arch -> (config class, model class, config fields of a tiny model beside tiny_model's)."""

_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 4}
_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8}
_OPTIONAL = {  # arch -> (config class, model class, fields); absent from older transformers
    # the final-logit softcap after lm_head: config.final_logit_softcapping (SOFTCAPPED)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {"hidden_size_per_layer_input": 8, "global_head_dim": 8},
    ),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {}),
    "beam": ("BeamConfig", "BeamForCausalLM", {}),
    # a scale after lm_head: the module attribute logit_scale (multiplies)
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {"layer_types": ["sliding_attention", "full_attention"]},
    ),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {}),
    "cohere_compass": (
        "CohereCompassTextConfig",
        "CohereCompassForCausalLM",
        {"rope_parameters": {"full_attention": _ROPE}},
    ),
    # config.logits_scaling (divides)
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", _MOE),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", _MOE),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", _MOE),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {**_MOE, **_MAMBA, "mamba_d_head": 16, "layer_types": ["mamba", "attention"]},
    ),
    # the inner model's lm_head_multiplier (multiplies)
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {**_MAMBA, "mamba_d_head": 8, "mamba_d_ssm": 32, "head_dim": 8},
    ),
    # config.logits_scaling (multiplies)
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {}),
    # config.logits_scaling divides the hidden states before lm_head
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", {**_MLA, "num_key_value_heads": 4}),
}
SOFTCAPPED = ("gemma2", "gemma3", "gemma4", "vaultgemma", "nanochat", "beam")
"""The archs whose forward applies ``config.final_logit_softcapping`` (tiny_model's
``softcap``)."""
for _arch, (_config, _model, _fields) in _OPTIONAL.items():
    if hasattr(transformers, _config) and hasattr(transformers, _model):
        ARCHS[_arch] = (getattr(transformers, _config), getattr(transformers, _model), _fields)


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
    **fields: Any,
) -> torch.nn.Module:
    """A randomly initialised 2-layer model; the same seed gives the same weights.

    ``softcap``: ``final_logit_softcapping`` of the ``SOFTCAPPED`` archs (their forward
    applies it after lm_head). ``bias``: lm_head becomes an ``nn.Linear(H, V, bias=True)``
    (untied only).
    ``fields``: other config fields (e.g. ``logits_scaling=4.0`` of granite).
    """
    config_cls, model_cls, extra = ARCHS[arch]
    extra = dict(extra, **fields)
    if arch in SOFTCAPPED:
        extra.update(head_dim=hidden // 4, final_logit_softcapping=softcap)
    elif softcap is not None:
        raise ValueError(f"{arch} applies no final-logit softcap")
    if arch == "gemma4":  # its per-layer embeddings take the token ids too
        extra["vocab_size_per_layer_input"] = vocab
    if bias and tied:
        raise ValueError("a biased lm_head is untied")
    config = config_cls(
        **{
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": tied,
            "attn_implementation": attn,
            **extra,
        }
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
