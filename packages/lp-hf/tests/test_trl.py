"""lp_hf.trl.use_lp on TRL 1.16's own code paths (CPU, fp32, tiny random models).

Each case runs TRL's stock fused head and the same model after ``use_lp``, against an fp64
run of the model's own forward (materialized logits): log-probs, entropy, the loss and
every parameter's gradient, through ``model(..., fused_lm_head=True)`` directly and through
the trainers' own ``compute_loss`` (GRPO's grpo/dapo/dr_grpo losses with a reference
model, SFT), then two GRPO training steps and generation. lp's error must be no worse than
a small multiple of TRL's own fp32 error (plus a floor), and lp must have been called.

TRL is optional: without it every test skips (the workspace venv), and ``nox -s adapters``
installs it with ``LP_TRAINERS_REQUIRED=1``, where a missing TRL fails. Models are built
from a config and saved to a temporary folder (TRL loads its reference model by path); the
tokenizer is an in-process WordLevel one: nothing is downloaded.
"""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import grads, tiny_model
from _trl_setup import (
    GRAD_REL,
    VOCAB,
    assert_close_grads,
    generation_batch,
    grpo_trainer,
    loss_and_grads,
    make_tokenizer,
    save_tiny_qwen2,
    worst,
)

import lp_hf.trl as lp_trl
from lp_testing import import_trainer

TEXTS = ["w1 w2 w3 w4 w5 w6", "w7 w8", "w9 w10 w11 w12 w13 w14 w15 w16 w17", "w18 w19 w20"]
LOGPROB_ATOL = 1e-6
GRAD_FLOOR = 5e-7
"""Relative gradient error (of the largest entry) that always passes: fp32 rounding."""
K = 4.0
"""lp's error may be up to K times TRL's own fp32 error, against the fp64 truth."""


@pytest.fixture(scope="module")
def trl() -> types.ModuleType:
    return import_trainer("trl")


@pytest.fixture(scope="module")
def tokenizer(trl: types.ModuleType):
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_dir(trl: types.ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny Qwen2 (policy and reference model of the trainer tests)."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture
def lp_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of lp_kernels.linear_logprob made by lp_hf.trl."""
    calls: list[int] = []
    real = lp_trl.linear_logprob

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lp_trl, "linear_logprob", counted)
    return calls


def assert_no_worse(name: str, lp: torch.Tensor, stock: torch.Tensor, truth: torch.Tensor):
    """lp's max error against ``truth`` <= K x stock's (plus a floor); lp within
    LOGPROB_ATOL of stock, relative to the largest value where it is above 1 (entropy)."""
    assert lp.shape == stock.shape and lp.dtype == stock.dtype, name
    err_lp, at = worst(lp, truth)
    err_stock, _ = worst(stock, truth)
    gap, gap_at = worst(lp, stock)
    assert (
        err_lp <= K * err_stock + LOGPROB_ATOL / 10
    ), f"{name}: lp error {err_lp:.3g} at {at}, TRL's {err_stock:.3g}"
    scale = max(1.0, float(truth.detach().abs().max()))
    assert gap <= LOGPROB_ATOL * scale, f"{name}: lp - TRL = {gap:.3g} at {gap_at}"


def assert_grads_no_worse(lp: dict, stock: dict, truth: dict) -> None:
    """Every parameter: relative error vs fp64 <= K x TRL's + GRAD_FLOOR; none all-zero."""
    assert lp.keys() == stock.keys() == truth.keys()
    for name, want in truth.items():
        scale = float(want.abs().max())
        assert scale > 0, f"{name}: no gradient reached it"
        err_lp, at = worst(lp[name], want)
        err_stock, _ = worst(stock[name], want)
        assert (
            err_lp / scale <= K * err_stock / scale + GRAD_FLOOR
        ), f"{name}: lp relative error {err_lp / scale:.3g} at {at}, TRL's {err_stock / scale:.3g}"


# -- the fused forward itself ------------------------------------------------------------

CASES = {
    # id: (arch, tiny_model fields, temperature, shift_labels, num_items_in_batch, outputs)
    "qwen2": ("qwen2", {}, 1.0, False, None, ("log_probs", "entropy")),
    "qwen2-bias-T0.7-items": ("qwen2", {"bias": True}, 0.7, False, 23, ("log_probs", "entropy")),
    "qwen2-shift_labels": ("qwen2", {}, 1.3, True, None, ("log_probs", "entropy")),
    "gemma2-softcap": (
        "gemma2",
        {"softcap": 2.0, "tied": True, "attn": "eager"},
        0.9,
        False,
        None,
        ("log_probs",),
    ),
    "granite-scale": ("granite", {"logits_scaling": 4.0}, 1.0, False, 7, ("log_probs", "entropy")),
    "every-output": ("qwen2", {"bias": True}, 0.8, False, None, lp_trl.FIELDS),
}


EVERY_OPTION = {"deterministic": True, "backend": "torch", "chunk_size": 16, "validate": False}


def _batch(left_pad: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0 if left_pad else 1
    mask[2, -2:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :5] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _truth(model64, batch, temperature, shift, num_items, outputs, weights):
    """fp64 fields of TRL's contract from the model's own logits, and the objective."""
    logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    z = logits / temperature
    labels = batch["labels"]
    if shift:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    else:
        z, labels = z[:, :-1], labels[:, 1:]
    mask = labels != -100
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    fields = {"log_probs": logp, "label_mask": mask}
    fields["entropy"] = -(logp_all.exp() * logp_all).sum(-1) * mask
    fields["log_sum_sq_probs"] = torch.logsumexp(2 * logp_all, -1) * mask
    fields["mean_logits"] = z.mean(-1) * mask
    fields["is_top1"] = (z.argmax(-1) == labels) & mask
    den = mask.sum().clamp(min=1) if num_items is None else num_items
    fields["loss"] = -logp.sum() / den
    return fields, _objective(fields, outputs, weights)


def _objective(out, outputs, weights) -> torch.Tensor:
    """The fused loss plus a weighted entropy sum (a dict: the truth, or TRL's output)."""
    loss = out["loss"]
    if "entropy" in outputs:
        loss = loss + (out["entropy"] * weights.to(out["entropy"].dtype)).sum()
    return loss


def _fused_call(model, batch, shift, num_items):
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if shift:
        labels = batch["labels"]
        kwargs["shift_labels"] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    else:
        kwargs["labels"] = batch["labels"]
    return model(**kwargs, num_items_in_batch=num_items, fused_lm_head=True)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_forward_matches_trl(trl, case: str, lp_calls: list[int]) -> None:
    arch, fields, temperature, shift, num_items, outputs = CASES[case]
    from trl.trainer.utils import add_fused_lm_head

    stock = tiny_model(arch, vocab=VOCAB, hidden=16, layers=1, **fields)
    model64 = copy.deepcopy(stock).double()
    ours = copy.deepcopy(stock)
    for model in (stock, ours):
        add_fused_lm_head(model, temperature=temperature, outputs=outputs)
    # every option of use_lp non-default in the case that asks for every field
    options = EVERY_OPTION if case == "every-output" else {}
    lp_trl.use_lp(types.SimpleNamespace(model=ours), **options)
    # fp64 Gemma 2 (eager attention) gives NaN hidden states at left padding: its fp64
    # truth would be NaN there and its gradients too; fp32 runs are finite
    batch = _batch(left_pad=arch != "gemma2")
    weights = torch.randn(batch["labels"].shape[0], batch["labels"].shape[1] - (not shift))
    truth, objective = _truth(model64, batch, temperature, shift, num_items, outputs, weights)
    objective.backward()
    got = {}
    for name, model in (("stock", stock), ("lp", ours)):
        out = _fused_call(model, batch, shift, num_items)
        _objective(out, outputs, weights).backward()
        got[name] = out
    assert lp_calls, "use_lp's model did not call lp"
    # TRL's module keeps its kernel: the stock model above ran it
    assert trl.trainer.utils._ChunkedLogProbFunction is trl.kernels.ChunkedLogProbFunction
    stock_out, lp_out = got["stock"], got["lp"]
    assert torch.equal(lp_out.label_mask, stock_out.label_mask)
    assert torch.equal(lp_out.label_mask, truth["label_mask"])
    for name in ("loss", *outputs):
        if name == "is_top1":
            assert lp_out.is_top1.dtype == torch.bool
            assert torch.equal(lp_out.is_top1, truth["is_top1"]), name
            continue
        assert_no_worse(name, getattr(lp_out, name), getattr(stock_out, name), truth[name])
    for name in set(lp_trl.FIELDS) - set(outputs):
        assert getattr(lp_out, name) is None, name
    assert_grads_no_worse(grads(ours), grads(stock), grads(model64))


def test_moe_aux_loss_matches_trl(trl, lp_calls: list[int]) -> None:
    """A MoE model with output_router_logits: TRL's code adds the load-balancing loss around
    lp's log-probs (fp32 only: the experts' grouped GEMM refuses fp64)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.3,
    )
    torch.manual_seed(0)
    stock = Qwen2MoeForCausalLM(config).eval()
    ours = copy.deepcopy(stock)
    for model in (stock, ours):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    lp_trl.use_lp(types.SimpleNamespace(model=ours))
    batch = _batch()
    outs = {}
    for name, model in (("stock", stock), ("lp", ours)):
        outs[name] = model(**batch, fused_lm_head=True)
        outs[name].loss.backward()
    assert lp_calls, "use_lp's model did not call lp"
    with torch.no_grad():  # the model's own loss: cross-entropy + coef * aux
        own = stock(**batch).loss
    stock_out, lp_out = outs["stock"], outs["lp"]
    assert torch.equal(lp_out.aux_loss, stock_out.aux_loss)
    assert abs(float(lp_out.loss - stock_out.loss)) <= 1e-6
    assert abs(float(lp_out.loss - own)) <= 1e-5
    assert (lp_out.log_probs - stock_out.log_probs).abs().max() <= LOGPROB_ATOL
    assert_close_grads(grads(ours), grads(stock), rel=GRAD_REL, allow_zero=True)


# -- the trainers' own loss paths ----------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_loss_matches_trl(trl, model_dir, tokenizer, tmp_path, loss_type, lp_calls):
    trainers = {}
    for name in ("stock", "lp"):
        trainer = grpo_trainer(trl, model_dir, tokenizer, tmp_path / name, loss_type=loss_type)
        trainers[name] = lp_trl.use_lp(trainer) if name == "lp" else trainer
    inputs, results = {}, {}
    for name, trainer in trainers.items():
        torch.manual_seed(1)  # the same sampled completions from the same weights
        inputs[name] = trainer._prepare_inputs(generation_batch())  # eval mode: generates
        results[name] = loss_and_grads(trainer, inputs[name])
    assert lp_calls, "the lp trainer did not call lp"
    stock_in, lp_in = inputs["stock"], inputs["lp"]
    assert torch.equal(lp_in["completion_ids"], stock_in["completion_ids"])
    # the reference model's log-probs, computed by each trainer's own ref_model
    ref = stock_in["ref_per_token_logps"]
    assert (lp_in["ref_per_token_logps"] - ref).abs().max() <= LOGPROB_ATOL
    (stock_loss, stock_grads), (lp_loss, lp_grads) = results["stock"], results["lp"]
    assert torch.isfinite(stock_loss)  # ~0 on policy: the advantages sum to 0
    assert abs(float(lp_loss - stock_loss)) <= 1e-6 * max(1.0, abs(float(stock_loss)))
    assert_close_grads(lp_grads, stock_grads, rel=GRAD_REL)
    # TRL's metrics from the fused head's entropy
    stock_entropy = trainers["stock"]._metrics["train"]["entropy"]
    assert stock_entropy and trainers["lp"]._metrics["train"]["entropy"] == pytest.approx(
        stock_entropy, abs=1e-5
    )


def test_grpo_two_steps_and_generation(trl, model_dir, tokenizer, tmp_path, lp_calls):
    runs = {}
    for name in ("stock", "lp"):
        trainer = grpo_trainer(trl, model_dir, tokenizer, tmp_path / name, max_steps=2)
        if name == "lp":
            lp_trl.use_lp(trainer)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        prompt = tokenizer(["w3 w4 w5"], return_tensors="pt")
        greedy = trainer.model.generate(**prompt, max_new_tokens=5, do_sample=False)
        trainer.train()  # generates its completions at each step, through TRL's own code
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        after = trainer.model.generate(**prompt, max_new_tokens=5, do_sample=False)
        runs[name] = (greedy, losses, params, after)
    assert lp_calls, "the lp trainer did not call lp"
    (greedy, losses, params, after), (lp_greedy, lp_losses, lp_params, lp_after) = (
        runs["stock"],
        runs["lp"],
    )
    assert torch.equal(lp_greedy, greedy), "generation changed after use_lp"
    assert len(losses) == len(lp_losses) == 2
    assert lp_losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
    trained = max(float((params[n] - start[n]).abs().max()) for n in params)
    assert trained > 1e-3, "two steps did not move the parameters"
    gap = max(float((params[n] - lp_params[n]).abs().max()) for n in params)
    assert gap <= 1e-6, f"parameters after two steps differ by {gap:.3g}"
    assert lp_after.shape == after.shape


def test_amp_wrapped_reference_model(trl, model_dir, tokenizer, tmp_path, lp_calls):
    """Under bf16 the trainer wraps its reference model's fused forward in accelerate's
    autocast forward at construction: use_lp rebuilds that wrapper around lp's forward."""
    trainer = grpo_trainer(trl, model_dir, tokenizer, tmp_path, bf16=True)
    if not trainer.accelerator.native_amp:
        pytest.skip("accelerate gives no native mixed precision on this machine")
    stock_ref = copy.deepcopy(trainer.ref_model)
    lp_trl.use_lp(trainer)
    batch = _batch()
    with torch.no_grad():
        lp_out = trainer.ref_model(**batch, fused_lm_head=True)
        stock_out = stock_ref(**batch, fused_lm_head=True)
    assert lp_calls, "the wrapped reference model did not call lp"
    assert lp_out.log_probs.dtype == stock_out.log_probs.dtype == torch.float32
    # bf16 GEMMs, each path its own rounding
    assert (lp_out.log_probs - stock_out.log_probs).abs().max() <= 0.1


def _sft(trl, model_dir, tokenizer, tmp_path):
    from datasets import Dataset

    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        bf16=False,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        max_length=16,
    )
    data = Dataset.from_dict({"text": TEXTS})
    return trl.SFTTrainer(
        model=model_dir, args=args, train_dataset=data, processing_class=tokenizer
    )


def test_sft_loss_matches_trl(trl, model_dir, tokenizer, tmp_path, lp_calls):
    stock = _sft(trl, model_dir, tokenizer, tmp_path / "stock")
    ours = _sft(trl, model_dir, tokenizer, tmp_path / "lp")
    lp_trl.use_lp(ours)
    batch = next(iter(stock.get_train_dataloader()))
    num_items = int((batch["labels"][:, 1:] != -100).sum()) + 3  # as if other ranks had more
    results = {}
    for name, trainer in (("stock", stock), ("lp", ours)):
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=num_items)
        loss.backward()
        results[name] = (loss.detach(), grads(trainer.model), trainer._metrics["train"])
    assert lp_calls, "the lp trainer did not call lp"
    (loss, stock_grads, metrics), (lp_loss, lp_grads, lp_metrics) = results.values()
    assert abs(float(lp_loss - loss)) <= 1e-6 * max(1.0, abs(float(loss)))
    assert_close_grads(lp_grads, stock_grads, rel=GRAD_REL)
    assert lp_metrics["mean_token_accuracy"] == metrics["mean_token_accuracy"]
    assert lp_metrics["entropy"] == pytest.approx(metrics["entropy"], abs=1e-5)


def test_dpo_loss_matches_trl(trl, model_dir, tokenizer, tmp_path, lp_calls):
    """DPO with WPO weighting: its fused heads compute every field (log_sum_sq_probs,
    mean_logits, is_top1 feed the loss weights and the metrics)."""
    from datasets import Dataset

    data = Dataset.from_dict(
        {
            "prompt": ["w1 w2", "w3", "w4 w5 w6", "w7"],
            "chosen": ["w8 w9", "w10", "w11 w12 w13", "w14"],
            "rejected": ["w15", "w16 w17 w18", "w19", "w20 w21"],
        }
    )
    trainers = []
    for name in ("stock", "lp"):
        args = trl.DPOConfig(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=4,
            use_weighting=True,
            bf16=False,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            dataloader_num_workers=0,
            max_length=16,
        )
        trainer = trl.DPOTrainer(
            model=model_dir, args=args, train_dataset=data, processing_class=tokenizer
        )
        trainers.append(trainer)
    lp_trl.use_lp(trainers[1])
    batch = next(iter(trainers[0].get_train_dataloader()))
    (loss, stock_grads), (lp_loss, lp_grads) = (loss_and_grads(t, batch) for t in trainers)
    assert lp_calls, "the lp trainer did not call lp"
    assert abs(float(lp_loss - loss)) <= 1e-6 * max(1.0, abs(float(loss)))
    assert_close_grads(lp_grads, stock_grads, rel=GRAD_REL)
    metrics, lp_metrics = (t._metrics["train"] for t in trainers)
    assert lp_metrics.keys() == metrics.keys()
    for key, values in metrics.items():
        assert lp_metrics[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key


# -- refusals ----------------------------------------------------------------------------


def test_refuses_other_trl_versions(trl, monkeypatch):
    model = tiny_model("qwen2", vocab=VOCAB, hidden=16, layers=1)
    trl.trainer.utils.add_fused_lm_head(model)
    for version in ("1.17.0", "1.15.2", "2.0.0", "1.16"):
        monkeypatch.setattr(trl, "__version__", version)
        with pytest.raises(RuntimeError, match=rf"TRL {version} is installed.*1\.16"):
            lp_trl.use_lp(types.SimpleNamespace(model=model))
    monkeypatch.setattr(trl, "__version__", "1.16.9")
    lp_trl.use_lp(types.SimpleNamespace(model=model))  # the series is accepted


def test_refuses_trainer_without_fused_head(trl, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_model("qwen2", vocab=VOCAB, hidden=16, layers=1)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args)
    with pytest.raises(ValueError, match="no TRL fused LM head"):
        lp_trl.use_lp(trainer)
    assert "forward" not in model.__dict__  # nothing changed
    with pytest.raises(TypeError, match="expects a TRL trainer"):
        lp_trl.use_lp(object())


def test_refuses_twice_and_foreign_transforms(trl):
    model = tiny_model("qwen2", vocab=VOCAB, hidden=16, layers=1)
    trl.trainer.utils.add_fused_lm_head(model)
    lp_trl.use_lp(types.SimpleNamespace(model=model))
    with pytest.raises(RuntimeError, match="already applied"):
        lp_trl.use_lp(types.SimpleNamespace(model=model))
    # a scale TRL would apply and the model's own forward (Qwen2) does not read
    other = tiny_model("qwen2", vocab=VOCAB, hidden=16, layers=1)
    other.config.logit_scale = 2.0
    trl.trainer.utils.add_fused_lm_head(other)
    with pytest.raises(ValueError, match="logit_scale"):
        lp_trl.use_lp(types.SimpleNamespace(model=other))
    with pytest.raises(ValueError, match="backend"):
        lp_trl.use_lp(types.SimpleNamespace(model=model), backend="cuda")
