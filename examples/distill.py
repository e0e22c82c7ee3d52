"""Distill a tiny Hugging Face student from a larger teacher with lp: no logits anywhere.

Both models are random Qwen2 models built from a config (no download): the student with
hidden size 32, the teacher with 64 and a sharper head, over one vocabulary. Each step,
``lp_hf.distill_divergence`` runs both decoders, and lp computes the per-position
divergence of the student's next-token distribution from the teacher's over the completion
tokens, straight from the hidden states and the two LM-head weights;
``lp_kernels.losses.distill_loss`` takes its token mean, and AdamW updates the student.
The teacher runs under ``torch.no_grad()`` and gets no gradient.

    uv run python examples/distill.py                          # CPU, a few seconds
    uv run python examples/distill.py --device cuda --vocab 151936 --kind forward_kl
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lp_hf import distill_divergence
from lp_kernels.losses import distill_loss


def build_model(vocab: int, hidden: int, seed: int, head_std: float | None = None):
    """A random 2-layer Qwen2 causal LM; ``head_std``: redraw its LM head with that std."""
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if head_std is not None:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    return model.eval()  # no dropout; the student's gradients still flow


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--kind", default="reverse_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    ap.add_argument("--beta", type=float, default=0.5, help="jsd's teacher weight")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--completion", type=int, default=24)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    student = build_model(args.vocab, 32, args.seed).to(device, dtype)
    teacher = build_model(args.vocab, 64, args.seed + 1, head_std=0.3).to(device, dtype)
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)

    g = torch.Generator().manual_seed(args.seed + 2)
    length = args.prompt_len + args.completion
    ids = torch.randint(0, args.vocab, (args.batch, length), generator=g).to(device)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    completion[:, args.prompt_len :] = True  # distill the completion tokens only

    losses = []
    for step in range(args.steps):
        out = distill_divergence(
            student,
            teacher,
            ids,
            mask=completion,
            kind=args.kind,
            beta=args.beta,
            temperature=args.temperature,
        )
        loss = distill_loss(out.divergence, out.mask)  # token mean over the completions
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            rows = int(out.mask.sum())
            mib = rows * args.vocab * 4 * 2 / 2**20  # fp32 logits of both models
            print(
                f"{args.kind}: {rows} rows of {ids.numel()} positions x vocab {args.vocab} "
                f"({mib:.1f} MiB of fp32 student + teacher logits, never materialized), "
                f"{args.dtype} on {device.type}"
            )
            print(f"{'step':>4} {'loss':>10} {'student H':>10} {'teacher H':>10}")
        ent_s = float(distill_loss(out.student_entropy, out.mask))  # mean entropies
        ent_t = float(distill_loss(out.teacher_entropy, out.mask))
        print(f"{step:>4} {losses[-1]:>10.5f} {ent_s:>10.4f} {ent_t:>10.4f}")
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
