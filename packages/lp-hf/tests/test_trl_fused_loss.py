"""``lp_hf.trl.use_lp(trainer, fused_loss=True)`` on TRL 1.16's GRPOTrainer (CPU, fp32).

Each case builds the same GRPOTrainer twice on a tiny random Qwen2, one stock and one
after ``use_lp(fused_loss=True)``, generates one batch with TRL's own code and runs both
trainers' ``compute_loss`` on it: TRL's loss on its log-probs against lp's
``linear_logprob_loss`` in the head pass. The loss must agree within 1e-6 (relative, above
1), every parameter's gradient within GRAD_REL (5e-6) of TRL's largest entry of it, and
every metric the loss logs within 1e-5 relative (1e-6 absolute: TRL's k3 is summed naively,
lp's to full fp32 accuracy). The cases cover each covered ``loss_type``; the reference-model
KL (beta > 0, the reference log-probs moved off the policy), times the ratio (TRL's default
``use_bias_correction_kl``) and not; off-policy old log-probs that get clipped (``delta``
too); gradient accumulation; a tool mask; vLLM's importance-sampling correction; and both
row layouts of TRL's head (every position, as on CPU; only the labelled rows, as with
Triton). Then two ``train()`` steps with two iterations per generation, and the refusals.

TRL is optional: without it every test skips; ``nox -s adapters`` installs it with
``LP_TRAINERS_REQUIRED=1``, where a missing TRL fails. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

pytest.importorskip("transformers")

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
from lp_kernels.losses import PolicyLoss
from lp_testing import import_trainer

LOSS_REL = 1e-6
METRIC_REL, METRIC_ABS = 1e-5, 1e-6
CASES = {
    # id: (GRPOConfig fields, off-policy old log-probs, accumulation, tool mask, vLLM IS,
    #      labelled rows only)
    "grpo-beta": ({"loss_type": "grpo"}, False, 1, False, False, False),
    "grpo-beta-offpolicy-accum2-labelled": ({"loss_type": "grpo"}, True, 2, False, False, True),
    "grpo-beta-plain_kl-offpolicy": (
        {"loss_type": "grpo", "use_bias_correction_kl": False},
        True,
        1,
        False,
        False,
        False,
    ),
    "bnpo-beta-delta-tools": (
        {"loss_type": "bnpo", "epsilon_high": 0.28, "delta": 1.5},
        True,
        1,
        True,
        False,
        False,
    ),
    "dr_grpo-beta-offpolicy": ({"loss_type": "dr_grpo"}, True, 1, False, False, False),
    "dapo-beta0-offpolicy": ({"loss_type": "dapo", "beta": 0.0}, True, 1, False, False, False),
    "dapo-beta-accum2": (
        {"loss_type": "dapo", "epsilon_high": 0.28},
        True,
        2,
        False,
        False,
        False,
    ),
    "dapo-beta-vllm_is-tools-labelled": ({"loss_type": "dapo"}, True, 1, True, True, True),
}


@pytest.fixture(scope="module")
def trl() -> types.ModuleType:
    return import_trainer("trl")


@pytest.fixture(scope="module")
def tokenizer(trl: types.ModuleType):
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_dir(trl: types.ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture
def loss_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of lp_kernels.linear_logprob_loss made by lp_hf.trl."""
    calls: list[int] = []
    real = lp_trl.linear_logprob_loss

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lp_trl, "linear_logprob_loss", counted)
    return calls


def _off_policy(trainer, inputs: dict) -> torch.Tensor:
    """Old log-probs: the current ones shifted by noise, so that some ratios get clipped."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    gen = torch.Generator().manual_seed(2)
    return logps + 0.5 * torch.randn(logps.shape, generator=gen)


def _case_inputs(trainer, case: tuple) -> dict:
    """One generation batch of ``trainer`` (TRL's own code), changed as the case asks."""
    _, off_policy, _, tools, vllm_is, _ = case
    torch.manual_seed(1)
    inputs = trainer._prepare_inputs(generation_batch())  # eval mode: generates
    gen = torch.Generator().manual_seed(3)
    shape = inputs["completion_ids"].shape
    if off_policy:
        inputs["old_per_token_logps"] = _off_policy(trainer, inputs)
    if "ref_per_token_logps" in inputs:  # a reference model away from the policy: KL > 0
        ref = inputs["ref_per_token_logps"]
        inputs["ref_per_token_logps"] = ref + 0.3 * torch.randn(ref.shape, generator=gen)
    if tools:  # tokens a tool wrote: in the attention mask, out of the loss
        inputs["tool_mask"] = (torch.rand(shape, generator=gen) > 0.25).long()
    if vllm_is:
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=gen)
    return inputs


@pytest.mark.parametrize("case_id", list(CASES))
def test_fused_loss_matches_trl(
    trl, model_dir, tokenizer, tmp_path, monkeypatch, case_id, loss_calls
):
    case = CASES[case_id]
    fields, _, accumulation, _, vllm_is, labelled = case
    if labelled:  # TRL's head then passes only the labelled rows (its Triton layout)
        monkeypatch.setattr(trl.trainer.utils, "_use_triton", lambda device: True)
    stock = grpo_trainer(trl, model_dir, tokenizer, tmp_path / "stock", **fields)
    fused = grpo_trainer(trl, model_dir, tokenizer, tmp_path / "lp", **fields)
    lp_trl.use_lp(fused, fused_loss=True)
    inputs = _case_inputs(stock, case)
    results = {}
    for name, trainer in (("stock", stock), ("lp", fused)):
        if vllm_is:  # set after generation: TRL would else generate with vLLM
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer._metrics["train"].clear()
        loss, grads = loss_and_grads(trainer, inputs, accumulation)
        results[name] = (loss, grads, dict(trainer._metrics["train"]))
    assert len(loss_calls) == 1, "the fused trainer did not compute its loss with lp"
    (loss, grads, metrics), (lp_loss, lp_grads, lp_metrics) = results["stock"], results["lp"]
    assert torch.isfinite(loss)  # ~0 on policy: the advantages sum to 0
    assert abs(float(lp_loss - loss)) <= LOSS_REL * max(1.0, abs(float(loss))), (lp_loss, loss)
    assert_close_grads(lp_grads, grads, rel=GRAD_REL)
    assert list(lp_metrics) == list(metrics)
    for key, values in metrics.items():
        assert lp_metrics[key] == pytest.approx(values, rel=METRIC_REL, abs=METRIC_ABS), key
    if fields.get("beta", 0.04) != 0.0:
        assert metrics["kl"][0] > 1e-3
    # evaluation (prediction_step): no gradient, no accumulation scale, "eval" metrics
    for trainer in (stock, fused):
        trainer.model.eval()
    with torch.no_grad():
        evals = [trainer.compute_loss(trainer.model, inputs) for trainer in (stock, fused)]
    assert abs(float(evals[1] - evals[0])) <= LOSS_REL * max(1.0, abs(float(evals[0])))
    assert fused._metrics["eval"]["entropy"] == pytest.approx(stock._metrics["eval"]["entropy"])
    if case[1]:  # the clipped branches ran
        assert metrics["clip_ratio/region_mean"][0] > 0


def test_moe_aux_loss(trl, tokenizer, tmp_path, loss_calls):
    """A MoE policy: TRL adds its load-balancing loss (scaled for accumulation) and logs it."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

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
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "moe")
    trainers = [
        grpo_trainer(trl, str(tmp_path / "moe"), tokenizer, tmp_path / name, loss_type="bnpo")
        for name in ("stock", "lp")
    ]
    lp_trl.use_lp(trainers[1], fused_loss=True)
    assert trainers[1].aux_loss_enabled
    # transformers' MoE generation with router logits fails (a cache-shaped mask): off then
    trainers[0].model.config.output_router_logits = False
    inputs = _case_inputs(trainers[0], (None, True, 2, False, False, False))
    trainers[0].model.config.output_router_logits = True
    results = []
    for trainer in trainers:
        trainer._metrics["train"].clear()
        results.append((*loss_and_grads(trainer, inputs, 2), dict(trainer._metrics["train"])))
    assert len(loss_calls) == 1
    (loss, grads, metrics), (lp_loss, lp_grads, lp_metrics) = results
    assert abs(float(lp_loss - loss)) <= LOSS_REL * max(1.0, abs(float(loss)))
    assert_close_grads(lp_grads, grads, rel=GRAD_REL, allow_zero=True)
    assert list(lp_metrics) == list(metrics) and metrics["aux_loss"][0] > 0
    for key, values in metrics.items():
        assert lp_metrics[key] == pytest.approx(values, rel=METRIC_REL, abs=METRIC_ABS), key


def test_two_steps_two_iterations(trl, model_dir, tokenizer, tmp_path, loss_calls):
    """``train()``: two micro-batches a step, the second step on the first step's
    generation (``num_iterations=2``: TRL's old log-probs, now off-policy)."""
    runs = {}
    for name in ("stock", "lp"):
        trainer = grpo_trainer(
            trl,
            model_dir,
            tokenizer,
            tmp_path / name,
            max_steps=2,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_iterations=2,
            loss_type="dapo",
            epsilon_high=0.28,
        )
        if name == "lp":
            lp_trl.use_lp(trainer, fused_loss=True)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[name] = (start, logs, params)
    assert len(loss_calls) == 4, "two steps of two micro-batches"
    (start, logs, params), (_, lp_logs, lp_params) = runs["stock"], runs["lp"]
    assert len(logs) == len(lp_logs) == 2
    for log, lp_log in zip(logs, lp_logs, strict=True):
        for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/high_max"):
            assert lp_log[key] == pytest.approx(log[key], rel=1e-5, abs=1e-6), key
    assert logs[1]["clip_ratio/region_mean"] > 0, "the second iteration was not off-policy"
    assert max(float((params[n] - start[n]).abs().max()) for n in params) > 1e-3
    gap, at = max((worst(lp_params[n], params[n]), n) for n in params)
    assert gap[0] <= 1e-6, f"parameters after two steps differ by {gap[0]:.3g} in {at}"


@pytest.mark.parametrize("kl_ratio", [False, True])
def test_token_loss_value_and_grad_is_autograds(trl, kl_ratio: bool) -> None:
    """GrpoTokenLoss's closed-form derivatives (what the op uses) against autograd through
    its ``__call__``, with every term on and ratios on both sides of every clip bound."""
    gen = torch.Generator().manual_seed(4)
    n = 257
    logprob = (-3 * torch.rand(n, generator=gen, dtype=torch.float64)).requires_grad_()
    per_token = {
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
        "weights": torch.rand(n, generator=gen, dtype=torch.float64),
        "old_logprob": logprob.detach() + 0.6 * torch.randn(n, generator=gen, dtype=torch.float64),
        "ref_logprob": logprob.detach() + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64),
        "is_ratio": 0.5 + torch.rand(n, generator=gen, dtype=torch.float64),
    }
    surrogate = PolicyLoss(clip_low=0.2, clip_high=0.28, dual_clip=1.5, max_log_ratio=None)
    fn = lp_trl.GrpoTokenLoss(surrogate, kl_coef=0.3, kl_ratio=kl_ratio)
    value, (grad, g_ent, g_lse) = fn.value_and_grad(logprob.detach(), None, None, **per_token)
    loss = fn(logprob, None, None, **per_token)
    loss.sum().backward()
    assert g_ent is None and g_lse is None
    torch.testing.assert_close(value, loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, logprob.grad, rtol=1e-12, atol=1e-12)


REFUSED = {
    # id: (attribute changes on the trainer, its args, what the error names)
    "cispo": ({"loss_type": "cispo"}, {}, "loss_type='cispo'"),
    "sapo": ({"loss_type": "sapo"}, {}, "loss_type='sapo'"),
    "vespo": ({"loss_type": "vespo"}, {}, "loss_type='vespo'"),
    "luspo": ({"loss_type": "luspo"}, {}, "loss_type='luspo'"),
    "sequence-is": ({"importance_sampling_level": "sequence"}, {}, "importance_sampling_level"),
    "top_entropy": ({"top_entropy_quantile": 0.2}, {}, "top_entropy_quantile"),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.5}, {}, "off_policy_mask_threshold"),
    "entropy_coef": ({"entropy_coef": 0.01}, {}, "entropy bonus"),
    "adaptive_entropy": ({"use_adaptive_entropy": True}, {}, "entropy bonus"),
    "delta": ({}, {"delta": 1.1}, "delta=1.1"),
    "epsilon": ({"epsilon_low": 1.0}, {}, "epsilon=1.0"),
}


def _changed(trainer, attrs: dict, args: dict):
    """Sets ``attrs`` on ``trainer`` and ``args`` on its args; returns the undo."""
    saved = [(trainer, k, getattr(trainer, k)) for k in attrs]
    saved += [(trainer.args, k, getattr(trainer.args, k)) for k in args]
    for target, values in ((trainer, attrs), (trainer.args, args)):
        for key, value in values.items():
            setattr(target, key, value)
    return lambda: [setattr(target, key, value) for target, key, value in saved]


def test_refusals(trl, model_dir, tokenizer, tmp_path, monkeypatch):
    trainer = grpo_trainer(trl, model_dir, tokenizer, tmp_path)
    for attrs, args, named in REFUSED.values():
        undo = _changed(trainer, attrs, args)
        with pytest.raises(ValueError, match=named):
            lp_trl.use_lp(trainer, fused_loss=True)
        undo()
    with pytest.raises(TypeError, match="fused_loss must be a bool"):
        lp_trl.use_lp(trainer, fused_loss=1)
    # a subclass with its own loss, and a TRL whose loss is not the one read
    cls = type(trainer)
    trainer.__class__ = type("Mine", (cls,), {"_compute_loss": lambda self, m, i: None})
    with pytest.raises(TypeError, match=r"overrides GRPOTrainer\._compute_loss"):
        lp_trl.use_lp(trainer, fused_loss=True)
    trainer.__class__ = cls
    with monkeypatch.context() as patch:
        patch.setattr(cls, "_compute_loss", lambda self, model, inputs: self.loss_type)
        with pytest.raises(RuntimeError, match="not the one lp-hf has read"):
            lp_trl.use_lp(trainer, fused_loss=True)
    # a trainer that is not a GRPOTrainer (RLOO's loss is per sequence)
    model = trainer.ref_model
    with pytest.raises(ValueError, match="not a GRPOTrainer"):
        lp_trl.use_lp(types.SimpleNamespace(model=model), fused_loss=True)
    # every refusal above left the trainer as it was; the options are checked at each call
    lp_trl.use_lp(trainer, fused_loss=True)
    torch.manual_seed(1)
    inputs = trainer._prepare_inputs(generation_batch())
    trainer.loss_type = "sapo"
    with pytest.raises(ValueError, match="loss_type='sapo'"):
        loss_and_grads(trainer, inputs)


def _sharded_loss_and_grads(trainer, inputs, mesh):
    """:func:`loss_and_grads` with ``trainer.model`` under one-rank FSDP2, the root module
    alone (its backward hooks, on its outputs, are then the only ones that run FSDP2's
    post-backward); the sharded gradients that post-backward wrote, gathered."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    fully_shard(trainer.model, mesh=mesh)
    loss, found = loss_and_grads(trainer, inputs)
    for name, g in found.items():
        assert isinstance(g, DTensor), f"{name}: FSDP2's post-backward did not run"
    return loss, {name: g.full_tensor() for name, g in found.items()}


def test_fsdp2_root_module(trl, model_dir, tokenizer, tmp_path):
    """Under one-rank FSDP2 the fused loss reaches the policy through its outputs (with
    weight 0): FSDP2's backward hooks run and write every sharded gradient, as stock (without
    the tie they never run and the parameters keep unsharded gradients)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    case = CASES["dr_grpo-beta-offpolicy"]
    stock = grpo_trainer(trl, model_dir, tokenizer, tmp_path / "stock", **case[0])
    fused = grpo_trainer(trl, model_dir, tokenizer, tmp_path / "lp", **case[0])
    lp_trl.use_lp(fused, fused_loss=True)
    inputs = _case_inputs(stock, case)  # generated before the wrap
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        loss, grads = _sharded_loss_and_grads(stock, inputs, mesh)
        lp_loss, lp_grads = _sharded_loss_and_grads(fused, inputs, mesh)
    finally:
        dist.destroy_process_group()
    assert abs(float(lp_loss - loss)) <= LOSS_REL * max(1.0, abs(float(loss))), (lp_loss, loss)
    assert_close_grads(lp_grads, grads, rel=GRAD_REL)
