"""GRPO-style policy-gradient steps with lp-kernels alone (no Megatron).

Each step samples a group of completions per prompt from a tiny causal LM, scores them
with a toy verifiable reward (the share of even token ids), normalizes the rewards
within each group (GRPO's advantages), and then takes a few clipped policy-gradient
updates with a KL penalty to a frozen reference model and an entropy bonus: the
ready-made ``lp_kernels.losses.grpo`` loss, averaged per completion then over
completions (``token_weights``). The rollout's log-probs come from
``lp_kernels.linear_logprob``; each update is one ``lp_kernels.linear_logprob_loss`` call
on the last hidden states and the LM-head weight, which returns the loss with its
gradients finished in the forward (three GEMMs): no ``[tokens, vocab]`` logits anywhere
in the update.

What lp's reproducibility buys here: the log-probs recorded at rollout time and those
recomputed by the first update are bitwise equal, so the policy ratio starts at exactly
1 (printed as ``max|ratio-1|``), although one pass is ``linear_logprob`` without
gradients and the other ``linear_logprob_loss`` with them, on the same rows (the loss
op's log-probs are its forward statistics, the same as ``linear_logprob``'s). (Under
``torch.compile`` lp keeps its bits too, but the model's compiled forward is Inductor's:
the rollout's log-probs must then come from the same compiled forward for the ratio to
start at 1.)

    python examples/grpo_step.py --steps 5          # CPU: the torch backend
    python examples/grpo_step.py --device cuda      # GPU: the triton backend
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from lp_kernels import linear_logprob, linear_logprob_loss
from lp_kernels.losses import grpo, kl_k3, token_weights


class TinyLM(nn.Module):
    """Embeddings, a causal mixing layer (a running mean of the prefix), two residual MLPs
    and an RMS norm; ``head`` is the LM-head weight ``[V, H]``, used by lp directly."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(2 * hidden, hidden)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(2)
        )
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Parameter(0.02 * torch.randn(vocab, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[B, S, H]`` (position s sees tokens ``[0, s]``)."""
        x = self.embed(tokens)
        steps = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)[:, None]
        prefix = x.cumsum(dim=1) / steps
        x = x + self.mix(torch.cat([x, prefix], dim=-1))
        for mlp in self.mlps:
            x = x + mlp(x)
        return self.norm(x)


@torch.no_grad()
def sample(model: TinyLM, prompts: torch.Tensor, new_tokens: int, group: int) -> torch.Tensor:
    """``group`` completions per prompt, sampled token by token: ``[P * group, S]``.

    The toy model is small enough to take full logits here; a real trainer samples with
    its inference engine."""
    tokens = prompts.repeat_interleave(group, dim=0)
    for _ in range(new_tokens):
        logits = model(tokens)[:, -1] @ model.head.T
        tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    return tokens


def completion_rows(model: TinyLM, tokens: torch.Tensor, completion: int):
    """The hidden states ``[B, C, H]`` that predict the completion tokens, and those tokens
    ``[B, C]`` (the targets)."""
    hidden = model(tokens[:, :-1])[:, -completion:]
    return hidden, tokens[:, -completion:]


def token_logprobs(model: TinyLM, tokens: torch.Tensor, completion: int):
    """lp's log-prob of each completion token given its prefix: ``[B, C]``."""
    hidden, targets = completion_rows(model, tokens, completion)
    return linear_logprob(hidden, model.head, targets).logprob


def grpo_update(model, tokens, completion, loss_fn, per_token):
    """The update's loss (the GRPO loss summed over the weighted tokens, differentiable) and
    its detached per-token log-probs and entropy ``[B, C]``, in one lp call."""
    hidden, targets = completion_rows(model, tokens, completion)
    return linear_logprob_loss(hidden, model.head, targets, loss_fn, per_token=per_token)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=503)  # a prime: no tile divides it
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=12)
    ap.add_argument("--updates", type=int, default=4, help="policy updates per rollout")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    policy = TinyLM(args.vocab, args.hidden).to(args.device)
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    # clip 0.2, k3 KL to the reference with beta 0.04, and an entropy bonus
    loss_fn = grpo(entropy_coef=1e-3)
    prompts = torch.randint(0, args.vocab, (args.prompts, 4), device=args.device)
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'max|ratio-1|':>13} {'kl':>9} {'entropy':>8}")
    for step in range(args.steps):
        tokens = sample(policy, prompts, args.completion, args.group)
        completion = tokens[:, -args.completion :]
        reward = (completion % 2 == 0).float().mean(dim=1)  # toy verifiable reward
        grouped = reward.view(args.prompts, args.group)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        with torch.no_grad():  # recorded at rollout time
            old_lp = token_logprobs(policy, tokens, args.completion)
            ref_lp = token_logprobs(reference, tokens, args.completion)
        per_token = {
            "old_logprob": old_lp,
            "ref_logprob": ref_lp,
            "advantages": adv.reshape(-1, 1).expand_as(old_lp),  # one per completion
            # GRPO's aggregation: the mean over each completion's tokens, then over completions
            "weights": token_weights(torch.ones_like(completion), "seq-mean-token-mean"),
        }
        for update in range(args.updates):
            out = grpo_update(policy, tokens, args.completion, loss_fn, per_token)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            if update == 0:  # before any update of this rollout: the ratio is exactly 1
                ratio_dev = (out.logprob - old_lp).exp().sub(1).abs().max()
                kl = kl_k3(out.logprob, ref_lp).mean()
                print(
                    f"{step:>4} {reward.mean().item():>7.3f} {out.loss.item():>9.4f} "
                    f"{ratio_dev.item():>13.1e} {kl.item():>9.2e} {out.entropy.mean().item():>8.3f}"
                )


if __name__ == "__main__":
    main()
