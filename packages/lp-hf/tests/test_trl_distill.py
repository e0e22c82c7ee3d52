"""lp_hf.trl.use_lp on TRL 1.16's DistillationTrainer (CPU, fp32, tiny random models).

A student and a teacher of different hidden sizes over one vocabulary. Each case builds the
same trainer twice, runs TRL's stock chunked divergence and, after ``use_lp``, lp's
``linear_divergence`` through the trainer's own ``compute_loss`` (beta 0.0, 1.0 and 0.5:
forward KL, reverse KL, generalized JSD), then two ``train()`` steps (on-policy generation
included): the loss within 1e-6 relative and every student gradient, and the parameters
after the steps, within fp32 rounding of TRL's. Then the refusals.

TRL is optional: without it every test skips; ``nox -s adapters`` installs it with
``LP_TRAINERS_REQUIRED=1``, where a missing TRL fails. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import grads, tiny_model

import lp_hf.trl as lp_trl
from lp_testing import import_trainer

VOCAB = 53  # prime, not a multiple of any tile
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10", "w11"]
GRAD_REL = 5e-6
"""lp's gradients within this much of the largest entry of TRL's (two fp32 paths)."""
CASES = {
    # id: (beta, temperature, student fields, teacher arch and fields)
    "forward_kl": (0.0, 1.0, {"bias": True}, ("qwen2", {})),
    "reverse_kl": (1.0, 0.8, {}, ("qwen2", {"bias": True})),
    "jsd": (0.5, 1.0, {"bias": True}, ("qwen2", {"bias": True})),
    "jsd-softcap-teacher-T0.7": (0.3, 0.7, {}, ("gemma2", {"softcap": 2.0, "attn": "eager"})),
}

EVERY_OPTION = {"deterministic": True, "backend": "torch", "chunk_size": 8, "validate": False}


@pytest.fixture(scope="module")
def trl() -> types.ModuleType:
    return import_trainer("trl")


@pytest.fixture(scope="module")
def tokenizer(trl: types.ModuleType):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 1 for i in range(1, VOCAB - 1)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture
def lp_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of lp_kernels.linear_divergence made by lp_hf.trl."""
    calls: list[int] = []
    real = lp_trl.linear_divergence

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lp_trl, "linear_divergence", counted)
    return calls


def _model(arch: str, hidden: int, seed: int, **fields) -> torch.nn.Module:
    model = tiny_model(arch, vocab=VOCAB, hidden=hidden, layers=1, seed=seed, **fields)
    model.config.update({"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1})
    return model


def _trainer(trl, tokenizer, tmp_path, case: str, **overrides):
    """A DistillationTrainer: a student of hidden size 16, a teacher of 24 (or Gemma 2)."""
    from datasets import Dataset

    beta, temperature, student_fields, (arch, teacher_fields) = CASES[case]
    fields = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_completion_length=5,
        temperature=temperature,
        beta=beta,
        bf16=False,  # fp32: the tolerances of this file
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
    return trl.DistillationTrainer(
        model=_model("qwen2", 16, 0, **student_fields),
        teacher_model=_model(arch, 24, 1, **teacher_fields),
        args=trl.DistillationConfig(**fields),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=tokenizer,
    )


def _inputs() -> dict[str, torch.Tensor]:
    """A batch as ``_generate_and_score_completions`` gives it: left-padded prompts,
    right-padded completions, and the global count of completion tokens (here more than
    the local one, as with other ranks)."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, VOCAB, (4, 5), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = prompt_mask[3, :4] = 0
    completion_ids = torch.randint(2, VOCAB, (4, 6), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = completion_mask[2, 5:] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "num_items_in_batch": completion_mask.sum() + 3,
    }


def _assert_close_grads(lp: dict, stock: dict, rel: float) -> None:
    assert lp.keys() == stock.keys() and stock
    for name, want in stock.items():
        scale = float(want.abs().max())
        assert scale > 0, f"{name}: no gradient reached it"
        err = float((lp[name] - want).abs().max())
        assert err <= rel * scale, f"{name}: {err / scale:.3g} of max |grad|"


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_match_trl(trl, tokenizer, tmp_path, case, lp_calls):
    results = {}
    for name in ("stock", "lp"):
        trainer = _trainer(trl, tokenizer, tmp_path / name, case)
        if name == "lp":
            # every option of use_lp non-default in the softcap case
            options = EVERY_OPTION if "softcap" in case else {}
            assert lp_trl.use_lp(trainer, **options) is trainer
        assert not lp_calls, "the stock trainer called lp"
        trainer.model.train()  # the metrics go to "train"
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, _inputs())
        loss.backward()
        teacher = [p.grad for p in trainer.teacher_model.parameters()]
        assert all(g is None for g in teacher), "a gradient reached the teacher"
        results[name] = (loss.detach(), grads(trainer.model), trainer._metrics["train"])
    assert lp_calls, "the lp trainer did not call lp"
    # TRL's module keeps its own kernel and loss: the stock trainer above ran them
    module = trl.trainer.distillation_trainer
    kernel = trl.kernels.chunked_divergence.ChunkedDivergenceFunction
    assert module.ChunkedDivergenceFunction is kernel
    assert module._chunked_divergence_loss.__globals__ is vars(module)
    (loss, stock_grads, metrics), (lp_loss, lp_grads, lp_metrics) = results.values()
    assert float(loss) > 1e-3, "a divergence this small tests nothing"
    assert abs(float(lp_loss - loss)) <= 1e-6 * abs(float(loss))
    _assert_close_grads(lp_grads, stock_grads, rel=GRAD_REL)
    assert lp_metrics["entropy"] == pytest.approx(metrics["entropy"], rel=1e-6)


def test_two_train_steps_match_trl(trl, tokenizer, tmp_path, lp_calls):
    """Two optimizer steps of ``train()``, completions sampled by the student each step."""
    runs = {}
    for name in ("stock", "lp"):
        trainer = _trainer(trl, tokenizer, tmp_path / name, "jsd", max_steps=2)
        if name == "lp":
            lp_trl.use_lp(trainer)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[name] = (losses, params)
    assert lp_calls, "the lp trainer did not call lp"
    (losses, params), (lp_losses, lp_params) = runs.values()
    assert len(losses) == len(lp_losses) == 2
    assert lp_losses == pytest.approx(losses, rel=1e-5)
    trained = max(float((params[n] - start[n]).abs().max()) for n in params)
    assert trained > 1e-3, "two steps did not move the parameters"
    gap = max(float((params[n] - lp_params[n]).abs().max()) for n in params)
    assert gap <= 1e-6, f"parameters after two steps differ by {gap:.3g}"


# -- refusals ----------------------------------------------------------------------------


def test_refusals(trl, tokenizer, tmp_path, monkeypatch):
    trainer = _trainer(trl, tokenizer, tmp_path, "jsd")
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"TRL 1\.17\.0 is installed"):
        lp_trl.use_lp(trainer)
    monkeypatch.undo()
    # a changed seam: TRL's loss with other parameters
    module = trl.trainer.distillation_trainer
    with monkeypatch.context() as patch:
        patch.setattr(module, "_chunked_divergence_loss", lambda student, teacher: None)
        with pytest.raises(RuntimeError, match="_chunked_divergence_loss takes"):
            lp_trl.use_lp(trainer)
    # DeepSpeed ZeRO-3
    import transformers.integrations.deepspeed as ds

    with monkeypatch.context() as patch:
        patch.setattr(ds, "is_deepspeed_zero3_enabled", lambda: True)
        with pytest.raises(NotImplementedError, match="ZeRO-3"):
            lp_trl.use_lp(trainer)
    # a subclass with its own loss
    subclass = type("MyDistill", (type(trainer),), {"compute_loss": lambda self, *a, **k: 0})
    other = object.__new__(subclass)
    vars(other).update(vars(trainer))
    with pytest.raises(TypeError, match=r"overrides DistillationTrainer\.compute_loss"):
        lp_trl.use_lp(other)
    # a scale TRL would apply and the teacher's own forward (Qwen2) does not read
    trainer.teacher_model.config.logit_scale = 2.0
    with pytest.raises(ValueError, match="logit_scale"):
        lp_trl.use_lp(trainer)
    del trainer.teacher_model.config.logit_scale
    assert "_compute_loss" not in vars(trainer), "a refused trainer was changed"
    lp_trl.use_lp(trainer)
    with pytest.raises(RuntimeError, match="already applied"):
        lp_trl.use_lp(trainer)


def test_kernel_refuses_foreign_transforms_and_beta(trl):
    """The kernel checks what TRL passes at each call against the models' own transforms."""
    from lp_hf.final_logits import FinalLogitTransform

    kernel = lp_trl.LpDivergenceKernel(
        FinalLogitTransform(), FinalLogitTransform(softcap=2.0), lp_trl.TrlOptions(), "T"
    )
    h_s, w_s = torch.randn(3, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    h_t, w_t = torch.randn(3, 5), torch.randn(7, 5, requires_grad=True)  # a trainable teacher
    args = (h_s, w_s, None, h_t, w_t, None)
    out, entropy = kernel.apply(*args, 0.5, 1.0, 1.0, None, 1.0, 2.0)
    assert out.shape == entropy.shape == (3,) and not entropy.requires_grad
    out.sum().backward()
    assert w_t.grad is None and w_s.grad is not None
    with pytest.raises(ValueError, match=r"T \(teacher\).*softcap=None"):
        kernel.apply(*args, 0.5, 1.0, 1.0, None, 1.0, None)
    with pytest.raises(ValueError, match=r"T \(student\).*logit_scale=2\.0"):
        kernel.apply(*args, 0.5, 1.0, 2.0, None, 1.0, 2.0)
    for beta in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="beta"):
            kernel.apply(*args, beta, 1.0, 1.0, None, 1.0, 2.0)
    assert lp_trl.divergence_kind(1) == ("reverse_kl", 0.5)
