"""One GRPO step on a tiny Hugging Face ``transformers`` model, with lp and through the logits.

A Qwen2 model with a large vocabulary (32k) and a tiny hidden size is built from a config
(no download). The step:

1. rollout: ``group`` completions per prompt, sampled token by token from the policy
   (``with head.paused():`` gives the stock logits of the last position only,
   ``logits_to_keep=1``);
2. a toy verifiable reward (the share of even token ids in the completion) and GRPO's
   group-normalized advantages;
3. log-probs recorded at rollout (policy, no grad) and under a frozen reference model;
4. the update: clipped ratio surrogate, k3 KL to the reference, entropy bonus, over the
   completion tokens; backward; an AdamW step.

The same step runs twice from the same weights and the same rollout: once through lp
(``lp_hf.install_logprob_head``: no ``[B, T, V]`` logits anywhere) and once through the
model's logits (``log_softmax`` -> gather). It prints both losses and gradient norms, the
largest gradient difference, ``max|ratio - 1|`` of the update (0 with lp: the rollout's
and the update's log-probs are the same bits), and the peak memory of the
update (forward + backward) of each: on CUDA ``torch.cuda.max_memory_allocated``, on CPU
the peak of live tensor storage bytes seen by ``lp_bench.memory.LiveBytes`` (a
``TorchDispatchMode``).

    python examples/hf_grpo.py                     # CPU, vocab 32000
    python examples/hf_grpo.py --device cuda --dtype bfloat16 --vocab 151936 --hidden 1024
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lp_bench.memory import LiveBytes
from lp_hf import install_logprob_head

CLIP, BETA, ENT_COEF = 0.2, 0.04, 1e-3


def peak_bytes(run: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """``(run(), peak bytes allocated during it above what was live before)``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        value = run()
        torch.cuda.synchronize(device)
        return value, torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as tracker:
        value = run()
    return value, tracker.peak


def build_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=args.tied,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype))
    return model.eval()  # no dropout; gradients still flow


@torch.no_grad()
def rollout(model, head, prompts: torch.Tensor, new_tokens: int, group: int) -> torch.Tensor:
    """``group`` sampled completions per prompt: ``[P * group, prompt + new_tokens]``."""
    tokens = prompts.repeat_interleave(group, dim=0)
    with head.paused():  # the stock logits, of the last position only
        for _ in range(new_tokens):
            logits = model(tokens, logits_to_keep=1, use_cache=False).logits[:, -1].float()
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    return tokens


def logits_path(model, tokens: torch.Tensor, labels: torch.Tensor):
    """Through the model's logits: ``(logprob, entropy)`` ``[B, T]`` fp32, position t
    scoring labels t + 1 (0 where the label is -100)."""
    logits = model(tokens, use_cache=False).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    valid = targets != -100
    lp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp * valid, ent * valid


def grpo_loss(logprob, entropy, old_lp, ref_lp, adv, mask):
    """Token-mean GRPO loss over the completion tokens and ``max|ratio - 1|``."""
    ratio = torch.exp(logprob - old_lp)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    log_r = ref_lp - logprob  # k3 estimator of KL(policy || reference), per token
    kl = torch.exp(log_r) - log_r - 1
    per_token = -surrogate + BETA * kl - ENT_COEF * entropy
    loss = (per_token * mask).sum() / mask.sum()
    return loss, ((ratio - 1).abs() * mask).max()


def grad_norm(model) -> float:
    return float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters())))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--completion", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-size", type=int, default=None, help="lp's token rows per step")
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    policy = build_model(args)
    reference = copy.deepcopy(policy).requires_grad_(False)
    stock_policy = copy.deepcopy(policy)  # the logits path starts from the same weights
    head = install_logprob_head(policy, chunk_size=args.chunk_size)
    ref_head = install_logprob_head(reference, chunk_size=args.chunk_size)

    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g)
    torch.manual_seed(args.seed + 2)
    tokens = rollout(policy, head, prompts.to(device), args.completion, args.group)
    labels = tokens.clone()
    labels[:, : args.prompt_len] = -100  # score the completion only
    mask = torch.zeros(tokens.shape, device=device)
    mask[:, args.prompt_len - 1 : -1] = 1  # positions that predict a completion token

    reward = (tokens[:, args.prompt_len :] % 2 == 0).float().mean(dim=1)
    grouped = reward.view(args.prompts, args.group)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    adv = adv.reshape(-1, 1)

    results: dict[str, Any] = {}
    for name, model in (("lp", policy), ("logits", stock_policy)):
        with torch.no_grad():  # recorded at rollout time
            if name == "lp":
                old_lp = head.logprobs(tokens, labels).logprob
                ref_lp = ref_head.logprobs(tokens, labels).logprob
            else:
                old_lp = logits_path(model, tokens, labels)[0]
                with ref_head.paused():
                    ref_lp = logits_path(reference, tokens, labels)[0]

        def update(name=name, model=model, old_lp=old_lp, ref_lp=ref_lp):
            if name == "lp":
                out = head.logprobs(tokens, labels, return_entropy=True)
                logprob, entropy = out.logprob, out.entropy
            else:
                logprob, entropy = logits_path(model, tokens, labels)
            loss, ratio_dev = grpo_loss(logprob, entropy, old_lp, ref_lp, adv, mask)
            loss.backward()
            return loss.detach(), ratio_dev.detach()

        (loss, ratio_dev), peak = peak_bytes(update, device)
        results[name] = {
            "loss": float(loss),
            "grad_norm": grad_norm(model),
            "max_ratio_dev": float(ratio_dev),
            "peak_bytes": peak,
            "grads": {n: p.grad.detach().float().clone() for n, p in model.named_parameters()},
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()

    worst = max(
        float((results["lp"]["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        for n, g in results["logits"]["grads"].items()
    )
    results["max_rel_grad_diff"] = worst
    n_tokens = tokens.numel()
    print(
        f"tiny Qwen2: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{tokens.shape[0]} sequences x {tokens.shape[1]} tokens ({n_tokens}), {args.dtype}, "
        f"{device.type}; mean reward {reward.mean().item():.3f}"
    )
    print(f"{'path':>7} {'loss':>12} {'grad norm':>12} {'max|ratio-1|':>13} {'peak MiB':>9}")
    for name in ("logits", "lp"):
        r = results[name]
        print(
            f"{name:>7} {r['loss']:>12.7f} {r['grad_norm']:>12.6f} {r['max_ratio_dev']:>13.1e} "
            f"{r['peak_bytes'] / 2**20:>9.1f}"
        )
    saved = results["logits"]["peak_bytes"] - results["lp"]["peak_bytes"]
    ratio = results["logits"]["peak_bytes"] / max(results["lp"]["peak_bytes"], 1)
    print(f"largest gradient difference, relative to the tensor's max: {worst:.1e}")
    print(f"update peak memory: lp saves {saved / 2**20:.1f} MiB ({ratio:.1f}x less)")
    head.remove()
    ref_head.remove()
    return results


if __name__ == "__main__":
    main()
