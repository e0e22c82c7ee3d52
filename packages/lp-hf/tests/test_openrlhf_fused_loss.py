"""lp_hf.openrlhf.use_lp(trainer, fused_loss=True) on OpenRLHF 0.11's own ``ActorPPOTrainer``
(CPU, fp32, tiny random models).

Each case builds the trainer with OpenRLHF's constructor (its ``PolicyLoss`` from the
options), runs its ``training_step`` on one experience stock (``Actor.forward`` on logits,
``PolicyLoss``, KL and entropy terms, backward) and again after ``use_lp(trainer,
fused_loss=True)``, and compares the loss handed to ``strategy.backward``, the step's
metrics, every parameter's gradient and the fused loss's own value. The strategy is a
stand-in (backward is ``loss.backward()``, the optimizer step does nothing, so both runs
see the same weights).
OpenRLHF is imported as ``_openrlhf_setup`` describes (stubbed GPU and cluster packages).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads
from _openrlhf_setup import import_models, import_ppo_actor, make_actor, rollout

import lp_hf.openrlhf as lp_openrlhf

TOL = dict(rtol=1e-5, atol=1e-6)
NS = types.SimpleNamespace


@pytest.fixture(scope="module")
def ppo_actor() -> types.ModuleType:
    """``openrlhf.trainer.ray.ppo_actor`` (skips when OpenRLHF is missing)."""
    return import_ppo_actor(import_models())


class Strategy:
    """The parts of OpenRLHF's DeepspeedStrategy that ``training_step`` calls."""

    def __init__(self, args: NS):
        self.args = args
        self.ring_attn_group = None
        self.losses: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor, model, optimizer) -> None:
        self.losses.append(loss.detach())
        loss.backward()

    def optimizer_step(self, *args, **kwargs) -> None:
        pass

    def get_grad_norm(self, model) -> float:
        return 0.0


def make_args(**options) -> NS:
    """OpenRLHF's nested config, the actor-loss fields from ``options``."""
    actor = NS(
        eps_clip_low_high=options.get("clip", (0.2, 0.28)),
        dual_clip=options.get("dual_clip"),
        loss_agg_mode=options.get("agg", "token-mean"),
        policy_loss_type=options.get("policy_loss_type", "ppo"),
        aux_loss_coef=options.get("aux_loss_coef", 0.0),
        entropy_coef=options.get("entropy_coef"),
    )
    level, mode, gating, threshold = options.get("is_correction", ("off", "mask", "ratio", None))
    advantage = NS(
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=threshold or (0.5, 5.0),
    )
    estimator, unbiased = options.get("kl", (None, False))
    kl = NS(use_loss=estimator is not None, init_coef=0.01, estimator=estimator or "k1")
    kl.unbiased_gradient = unbiased
    train = NS(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False)
    ds = NS(packing_samples=options.get("packing", False), tensor_parallel_size=1, zero_stage=2)
    return NS(actor=actor, algo=NS(advantage=advantage, kl=kl), train=train, ds=ds, vllm=NS())


def make_trainer(ppo_actor, monkeypatch, actor, **options):
    """OpenRLHF's ActorPPOTrainer over ``actor``, built by its own constructor."""
    # the constructor's collective and its replay buffer (which names a CUDA device)
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *args, **kwargs: NS())
    args = make_args(**options)
    actor.packing_samples = args.ds.packing_samples
    scheduler = NS(get_last_lr=lambda: [1e-6])
    return ppo_actor.ActorPPOTrainer(Strategy(args), actor, None, None, scheduler)


def experience(ppo_actor, actor, seed: int = 7, spread: float = 0.3):
    """One micro-batch: a rollout, its old / reference / rollout log-probs (the current
    ones, perturbed: some ratios are clipped) and advantages of both signs."""
    sequences, attention_mask, action_mask = rollout(actor.model.config.vocab_size)
    with torch.no_grad():
        current = actor(sequences, action_mask, attention_mask)
    g = torch.Generator().manual_seed(seed)

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(current.shape, generator=g)

    old = current + noise(spread)
    return ppo_actor.Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old,
        base_action_log_probs=current + noise(0.5),
        rollout_log_probs=old + noise(0.2),
        advantages=torch.randn(current.shape, generator=g),
    )


def run_step(trainer, exp, kl_ctl: float, info: dict | None):
    """``trainer.training_step`` on a copy of ``exp``: (loss, metrics, gradients)."""
    trainer.actor.model.zero_grad(set_to_none=True)
    batch = type(exp)(**{**vars(exp), "info": {}})
    status = trainer.training_step(batch, kl_ctl, 0, info)
    metrics = {k: v for k, v in status["metrics"].items() if isinstance(v, torch.Tensor)}
    return trainer.strategy.losses[-1], metrics, grads(trainer.actor.model)


CASES = {
    "clip-token-mean": {},
    "dual-clip-seq-mean-entropy": dict(
        dual_clip=3.0, agg="seq-mean-token-mean", entropy_coef=0.01, spread=1.5
    ),
    "entropy-coef-0": dict(entropy_coef=0.0),
    "kl-k1": dict(kl=("k1", False)),
    "kl-k2-seq-mean": dict(kl=("k2", False), agg="seq-mean-token-mean"),
    "kl-k3-entropy": dict(kl=("k3", False), entropy_coef=-0.02),
    "kl-k3-unbiased": dict(kl=("k3", True)),
    "is-token-mask": dict(is_correction=("token", "mask", "ratio", (0.8, 1.25))),
    "is-token-clip": dict(is_correction=("token", "clip", "ratio", (0.9, 1.1))),
    "is-seq-binary-kl": dict(is_correction=("seq", "mask", "binary_kl", (0.0, 1e-5))),
    "is-token-tv-kl": dict(is_correction=("token", "mask", "tv", (0.0, 5e-5)), kl=("k3", False)),
    "packed": dict(packing=True, kl=("k2", False), entropy_coef=0.01, arch="qwen2"),
    "biased-head": dict(model=dict(bias=True), entropy_coef=0.01),
    "gemma2-softcap": dict(arch="gemma2", model=dict(softcap=5.0, attn="eager"), entropy_coef=0.01),
    "granite-logit-scale": dict(arch="granite", model=dict(logits_scaling=4.0)),
    "granitemoe-aux-loss": dict(
        arch="granitemoe", model=dict(output_router_logits=True), aux_loss_coef=0.01
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_training_step_matches_stock(ppo_actor, monkeypatch, case: str) -> None:
    options = dict(CASES[case])
    spread = options.pop("spread", 0.3)
    arch, model = options.pop("arch", "llama"), options.pop("model", {})
    actor = make_actor(import_models(), arch, temperature=0.9, **model)
    trainer = make_trainer(ppo_actor, monkeypatch, actor, **options)
    exp = experience(ppo_actor, actor, spread=spread)
    tokens = float(exp.action_mask.sum())
    # a step of a larger accumulated batch on 2 ranks (OpenRLHF's loss_batch_info)
    info = {"dp_size": 2, "batch_num_tokens": torch.tensor(3 * tokens), "global_batch_size": 5.0}
    want = run_step(trainer, exp, 0.05, info)
    assert 0 < float(want[1]["ppo_clip_ratio"]) < 1  # some ratios are clipped
    if "is_filter_ratio" in want[1]:
        assert 0 < float(want[1]["is_filter_ratio"]) < 1  # the gate drops or clamps some
    assert lp_openrlhf.use_lp(trainer, fused_loss=True) is trainer
    got = run_step(trainer, exp, 0.05, info)
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, **TOL, msg=name)
    assert_grads_close(got[2], want[2])
    if not options.get("aux_loss_coef"):  # the fused loss's own value is the stock total
        assert_close_fused_value(trainer, exp, 0.05, info, want[0], options)


def assert_close_fused_value(trainer, exp, kl_ctl, info, want, options) -> None:
    """One fused pass by hand: ``linear_logprob_loss``'s loss is the step's loss."""
    fused = trainer.actor_loss_fn
    request = fused.request(exp, kl_ctl, info)
    entropy = options.get("entropy_coef") is not None
    with torch.no_grad(), fused.forward.loss_pass(request):
        trainer.actor(
            exp.sequences,
            exp.action_mask,
            attention_mask=exp.attention_mask,
            return_output=True,
            return_entropy=entropy,
        )
    torch.testing.assert_close(request.output.loss, want, **TOL)


def test_loss_batch_info_from_the_trainer(ppo_actor, monkeypatch) -> None:
    """loss_batch_info None: the trainer's get_loss_batch_info, computed once."""
    actor = make_actor(import_models(), "qwen2", tied=True)
    trainer = make_trainer(ppo_actor, monkeypatch, actor, kl=("k3", False), entropy_coef=0.01)
    exp = experience(ppo_actor, actor, seed=11)
    want = run_step(trainer, exp, 0.1, None)
    calls = []
    stock = ppo_actor.get_loss_batch_info
    monkeypatch.setattr(
        ppo_actor, "get_loss_batch_info", lambda *a, **k: calls.append(1) or stock(*a, **k)
    )
    lp_openrlhf.use_lp(trainer, fused_loss=True)
    got = run_step(trainer, exp, 0.1, None)
    assert calls == [1]
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert_grads_close(got[2], want[2])
    # outside training_step the actor and actor_loss_fn are the unfused ones
    with torch.no_grad():
        log_probs = actor(exp.sequences, exp.action_mask, exp.attention_mask)
        loss, *_ = trainer.actor_loss_fn(
            log_probs, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask
        )
    assert torch.isfinite(loss)
    lp_openrlhf.remove_lp(trainer)
    assert type(trainer.actor_loss_fn) is ppo_actor.PolicyLoss
    assert "training_step" not in vars(trainer) and "forward" not in vars(actor)


def test_refusals(ppo_actor, monkeypatch) -> None:
    models = import_models()
    actor = make_actor(models)
    trainer = make_trainer(ppo_actor, monkeypatch, actor, policy_loss_type="gspo")
    with pytest.raises(ValueError, match="policy_loss_type='gspo'"):
        lp_openrlhf.use_lp(trainer, fused_loss=True)
    assert "forward" not in vars(actor) and "training_step" not in vars(trainer)
    with pytest.raises(TypeError, match="takes the ActorPPOTrainer"):
        lp_openrlhf.use_lp(actor, fused_loss=True)
    trainer = make_trainer(ppo_actor, monkeypatch, actor)
    trainer.strategy.ring_attn_group = object()
    with pytest.raises(ValueError, match="ring attention"):
        lp_openrlhf.use_lp(trainer, fused_loss=True)
    trainer.strategy.ring_attn_group = None
    trainer.args.ds.zero_stage = 3
    with pytest.raises(ValueError, match="ZeRO-3"):
        lp_openrlhf.use_lp(trainer, fused_loss=True)
    trainer.args.ds.zero_stage = 2

    class Custom(ppo_actor.ActorPPOTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

    custom = make_trainer(ppo_actor, monkeypatch, actor)
    custom.__class__ = Custom
    with pytest.raises(TypeError, match=r"overrides ActorPPOTrainer\.training_step"):
        lp_openrlhf.use_lp(custom, fused_loss=True)
    monkeypatch.setattr(ppo_actor, "aggregate_loss", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="not the ones lp-hf has read"):
        lp_openrlhf.use_lp(trainer, fused_loss=True)
    monkeypatch.undo()
    # an option changed after use_lp: refused at the step, before any forward
    trainer = make_trainer(ppo_actor, monkeypatch, actor)
    lp_openrlhf.use_lp(trainer, fused_loss=True)
    assert lp_openrlhf.use_lp(trainer, fused_loss=True) is trainer  # a no-op
    trainer.actor_loss_fn.policy_loss.policy_loss_type = "gspo"
    with pytest.raises(ValueError, match="policy_loss_type"):
        run_step(trainer, experience(ppo_actor, actor), 0.0, None)
