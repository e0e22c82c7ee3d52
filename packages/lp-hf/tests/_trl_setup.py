"""Shared setup of the TRL adapter tests (``test_trl*.py``): an in-process tokenizer, a tiny
saved Qwen2, a GRPO trainer on them, and the comparison of two runs' gradients.

Nothing is downloaded: the model is built from a config and saved to a temporary folder
(TRL loads its reference model by path) and the tokenizer is a WordLevel one.
"""

from __future__ import annotations

import types

import torch
from _hf_models import grads, tiny_model

VOCAB = 53  # prime, not a multiple of any tile
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10", "w11"]
GRAD_REL = 5e-6
"""Trainer tests (no fp64 run): lp's gradients within this much of TRL's largest entry;
the two fp32 paths differ by up to ~1.4e-6 of it on these models (small bias gradients)."""


def make_tokenizer():
    """A whitespace WordLevel tokenizer over ``w1 ... w51`` with ``<pad>`` 0 and ``<eos>`` 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 1 for i in range(1, VOCAB - 1)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def save_tiny_qwen2(path) -> str:
    """A tiny random Qwen2 saved to ``path`` (the policy and reference model of a trainer)."""
    model = tiny_model("qwen2", vocab=VOCAB, hidden=16, layers=1)
    model.config.update({"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1})
    model.save_pretrained(path)
    return str(path)


def reward(completions: list[str], **kwargs) -> list[float]:
    """A reward that varies between completions (nonzero advantages)."""
    return [float(sum(map(ord, text)) % 7) for text in completions]


def grpo_trainer(trl: types.ModuleType, model_dir: str, tokenizer, tmp_path, **overrides):
    """A CPU fp32 GRPOTrainer (beta 0.04: with a reference model); ``overrides``: GRPOConfig."""
    fields = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        temperature=0.9,
        beta=0.04,  # a reference model, with its own fused head
        bf16=False,  # fp32: the tolerances of these tests
        learning_rate=0.5,
        optim="sgd",
        max_grad_norm=0.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    fields.update(overrides)
    from datasets import Dataset

    data = Dataset.from_dict({"prompt": PROMPTS * 4})
    return trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=trl.GRPOConfig(**fields),
        train_dataset=data,
        processing_class=tokenizer,
    )


def generation_batch() -> list[dict[str, str]]:
    """Two prompts, each repeated num_generations (4) times, as GRPO's sampler gives them."""
    return [{"prompt": prompt} for prompt in PROMPTS[:2] for _ in range(4)]


def loss_and_grads(trainer, inputs, accumulation: int = 1):
    """``(loss, {name: grad})`` of one ``compute_loss`` in train mode, as ``train()`` runs it
    with ``accumulation`` micro-batches per step."""
    trainer.model.train()  # the metrics go to "train"
    trainer.current_gradient_accumulation_steps = accumulation  # what train() sets
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), grads(trainer.model)


def worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest absolute difference and where it is."""
    diff = (got.detach().double() - want.detach().double()).abs()
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return float(diff.max()), index


def assert_close_grads(lp: dict, stock: dict, rel: float, allow_zero: bool = False) -> None:
    """Every gradient within ``rel`` of its largest entry in TRL's run (``allow_zero``: a
    parameter may get none, e.g. an expert no token was routed to, if in both runs)."""
    assert lp.keys() == stock.keys()
    for name, want in stock.items():
        scale = float(want.abs().max())
        err, at = worst(lp[name], want)
        if allow_zero and scale == 0:
            assert err == 0, f"{name}: a gradient in lp's run only"
            continue
        assert scale > 0, f"{name}: no gradient reached it"
        assert err <= rel * scale, f"{name}: {err / scale:.3g} of max |grad| at {at}"
