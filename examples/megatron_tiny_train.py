"""A few training steps of a tiny megatron-core GPT with the lp log-prob head installed.

The loss is the mean negative log-prob of the next token, computed by
``head.logprobs`` without materializing logits. It runs on CPU by default (one gloo
rank), using the test-only CPU patches of ``lp_testing.megatron_cpu``; on a GPU machine
pass ``--device cuda`` (then no patches are applied).

    python examples/megatron_tiny_train.py --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from lp_megatron import LogprobHeadConfig, install_logprob_head


def build_model(vocab: int, seq: int, device: str):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        share_embeddings_and_output_weights=True,
    )
    return model.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    store = os.path.join(tempfile.mkdtemp(), "store")
    backend = "gloo" if args.device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    patches: contextlib.AbstractContextManager = contextlib.nullcontext()
    if args.device == "cpu":
        from lp_testing.megatron_cpu import MegatronCpuPatches

        patches = MegatronCpuPatches()
    try:
        with patches:
            train(args.steps, args.device)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)


def train(steps: int, device: str) -> None:
    vocab, seq, batch = 128, 32, 8
    model = build_model(vocab, seq, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    # A learnable toy language: each sequence counts up from a random start (mod vocab).
    starts = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = ((starts + torch.arange(seq + 1)) % vocab).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), 1)

    with install_logprob_head(model, LogprobHeadConfig()) as head:
        for step in range(steps):
            hidden = model(inputs, position_ids, mask)  # [b, s, h], no logits
            out = head.logprobs(hidden, labels, return_entropy=True)
            loss = -out.logprob.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            print(
                f"step {step:3d}  loss {loss.item():.4f}  entropy {out.entropy.mean().item():.3f}"
            )


if __name__ == "__main__":
    main()
