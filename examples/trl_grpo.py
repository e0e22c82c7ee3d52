"""TRL's GRPOTrainer with lp as its fused LM head: the one line, ``use_lp(trainer)``.

A tiny random Qwen2 and an in-process word-level tokenizer (nothing is downloaded) are
trained for a few GRPO steps twice from the same weights and seed: once with TRL's own
fused head, once after ``lp_hf.trl.use_lp(trainer)``. It prints each run's per-step loss
and the largest parameter difference after training, and exits 1 if lp's kernel was
not the one that ran or the two runs drift apart by more than fp32 rounding.

    pip install "lp-hf[trl]"            # or, in this repository: uv run nox -s adapters
    python examples/trl_grpo.py         # CPU, about a minute
    python examples/trl_grpo.py --device cuda --vocab 151936 --hidden 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

PROMPTS = ["w3 w5 w7", "w2 w4", "w9 w1 w8 w6", "w11 w12"]


def tokenizer(vocab: int):
    """A word-level tokenizer over ``w1`` .. ``w{vocab - 2}`` with ``<pad>`` and ``<eos>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 1 for i in range(1, vocab - 1)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def save_model(path: str, vocab: int, hidden: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def reward(completions: list[str], **kwargs) -> list[float]:
    """A reward that varies between completions, so the advantages are not zero."""
    return [float(sum(map(ord, text)) % 7) for text in completions]


def train(model_dir: str, args: argparse.Namespace, out_dir: str, lp: bool):
    """``args.steps`` GRPO steps; returns (the logged losses, the trained parameters, the
    number of lp kernel calls)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import lp_hf.trl

    calls = []
    original = lp_hf.trl.linear_logprob

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)

    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=args.steps,
        learning_rate=1e-2,
        beta=0.04,  # a reference model, with its own fused head
        bf16=False,
        use_cpu=args.device == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer(args.vocab),
    )
    if lp:
        trainer = lp_hf.trl.use_lp(trainer)  # the one line
    lp_hf.trl.linear_logprob = counted  # count lp's kernel calls (the module's own name)
    try:
        trainer.train()
    finally:
        lp_hf.trl.linear_logprob = original
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    params = {k: v.detach().float().cpu() for k, v in trainer.model.named_parameters()}
    return losses, params, len(calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(f"{tmp}/model", args.vocab, args.hidden)
        stock, stock_params, stock_calls = train(f"{tmp}/model", args, f"{tmp}/a", lp=False)
        mine, lp_params, lp_calls = train(f"{tmp}/model", args, f"{tmp}/b", lp=True)
    drift = max((lp_params[k] - stock_params[k]).abs().max().item() for k in stock_params)
    print(f"TRL's fused head: losses {[f'{x:.6f}' for x in stock]}")
    print(f"lp (use_lp):      losses {[f'{x:.6f}' for x in mine]}, {lp_calls} lp kernel calls")
    print(f"largest parameter difference after {args.steps} steps: {drift:.2e}")
    ok = stock_calls == 0 and lp_calls > 0 and drift < 1e-4 and len(mine) == len(stock)
    print("ok" if ok else "FAILED: lp did not run, or the runs differ beyond fp32 rounding")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
