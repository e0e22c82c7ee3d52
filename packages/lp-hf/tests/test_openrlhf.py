"""lp_hf.openrlhf on OpenRLHF 0.11's own ``Actor.forward`` (CPU, fp32, tiny random models).

Each case runs the stock ``Actor.forward`` (materialized logits) and the same actor after
``use_lp``: action log-probs, log-probs of every position, entropy, OpenRLHF's own
``PolicyLoss`` plus an entropy bonus, and the gradient of every parameter. OpenRLHF is
imported as ``_openrlhf_setup`` describes (stubbed GPU dependencies).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads
from _openrlhf_setup import import_models, make_actor, rollout

import lp_hf.openrlhf as lp_openrlhf

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def models() -> types.ModuleType:
    """``openrlhf.models`` (skips when OpenRLHF is missing)."""
    return import_models()


def _ppo_step(models, actor, sequences, attention_mask, action_mask, *, entropy_coef=0.01):
    """OpenRLHF's actor loss on one batch: PolicyLoss + entropy bonus; backward; grads."""
    actor.model.zero_grad(set_to_none=True)
    log_probs, output = actor(
        sequences,
        action_mask,
        attention_mask=attention_mask,
        return_output=True,
        return_entropy=True,
    )
    g = torch.Generator().manual_seed(7)
    old = log_probs.detach() + 0.3 * torch.randn(log_probs.shape, generator=g)
    advantages = torch.randn(log_probs.shape, generator=g)
    mask = action_mask.float()
    loss, *_ = models.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)(
        log_probs, old, advantages, action_mask=mask, batch_num_tokens=float(mask.sum())
    )
    width = action_mask.shape[1]
    entropy = models.aggregate_loss(output.entropy[:, -width:], mask)
    (loss - entropy_coef * entropy).backward()
    return log_probs.detach(), output.entropy.detach(), loss.detach(), grads(actor.model)


@pytest.mark.parametrize(
    "arch,tied,temperature",
    [("llama", False, 1.0), ("qwen2", True, 0.7)],
    ids=["llama-untied-T1", "qwen2-tied-T0.7"],
)
def test_ppo_step_matches_stock(models, arch: str, tied: bool, temperature: float) -> None:
    actor = make_actor(models, arch, tied=tied, temperature=temperature)
    batch = rollout(actor.model.config.vocab_size)
    want = _ppo_step(models, actor, *batch)
    assert lp_openrlhf.use_lp(actor) is actor
    got = _ppo_step(models, actor, *batch)
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[0].shape == batch[2].shape
    torch.testing.assert_close(got[1], want[1], **TOL)  # every position, padding included
    assert got[1].shape == (3, batch[0].shape[1] - 1)
    torch.testing.assert_close(got[2], want[2], **TOL)
    assert_grads_close(got[3], want[3])


def test_logprob_paths_match_stock(models) -> None:
    """return_logprobs (SFT / DPO), action log-probs alone (only the action columns are
    computed), return_output=False, and the deterministic option."""
    actor = make_actor(models, temperature=1.3)
    sequences, attention_mask, action_mask = rollout(actor.model.config.vocab_size)
    with torch.no_grad():
        full, out_stock = actor(
            sequences, attention_mask=attention_mask, return_logprobs=True, return_output=True
        )
        actions = actor(sequences, action_mask, attention_mask)
        lp_openrlhf.use_lp(actor)
        got_full, out = actor(
            sequences, attention_mask=attention_mask, return_logprobs=True, return_output=True
        )
        got_actions = actor(sequences, action_mask, attention_mask)
        lp_openrlhf.remove_lp(actor)
        lp_openrlhf.use_lp(actor, deterministic=True, backend="torch")
        det = actor(sequences, action_mask, attention_mask)
    assert out_stock.logits.shape[-1] == actor.model.config.vocab_size
    assert out.logits is None and "logits" not in out
    torch.testing.assert_close(got_full, full, **TOL)
    assert got_full.shape == (3, sequences.shape[1] - 1)
    assert isinstance(got_actions, torch.Tensor)
    torch.testing.assert_close(got_actions, actions, **TOL)
    torch.testing.assert_close(det, actions, **TOL)
    assert float(got_actions[~action_mask].abs().max()) == 0.0


def test_packed_samples_match_stock(models) -> None:
    actor = make_actor(models, "qwen2", temperature=0.8)
    actor.packing_samples = True
    batch = rollout(actor.model.config.vocab_size, seed=5)
    want = _ppo_step(models, actor, *batch)
    lp_openrlhf.use_lp(actor)
    got = _ppo_step(models, actor, *batch)
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert_grads_close(got[3], want[3])
    # packed and padded runs agree on the scored positions (sdpa keeps sequences apart)
    actor.packing_samples = False
    unpacked = _ppo_step(models, actor, *batch)
    torch.testing.assert_close(unpacked[0], got[0], **TOL)


def test_logits_call_and_generation_stay_stock(models) -> None:
    actor = make_actor(models)
    sequences, attention_mask, _ = rollout(actor.model.config.vocab_size)
    with torch.no_grad():
        want = actor(sequences, attention_mask=attention_mask, return_output=True).logits
        lp_openrlhf.use_lp(actor)
        got = actor(sequences, attention_mask=attention_mask, return_output=True).logits
        assert torch.equal(got, want)  # a call for the logits runs the stock forward
        assert actor.model.get_output_embeddings().__dict__.get("forward") is None
        logits = actor.model(sequences[:1, :4]).logits
        tokens = actor.model.generate(sequences[:1, :4], max_new_tokens=3, do_sample=False)
    assert logits.shape[-1] == actor.model.config.vocab_size
    assert tokens.shape == (1, 7)


def test_version_guard(models, monkeypatch: pytest.MonkeyPatch) -> None:
    actor = make_actor(models)
    monkeypatch.setattr(lp_openrlhf, "openrlhf_version", lambda: "0.12.0")
    with pytest.raises(RuntimeError, match=r"supports openrlhf 0\.11\.x.*found openrlhf 0\.12\.0"):
        lp_openrlhf.use_lp(actor)
    assert "forward" not in actor.__dict__


def test_refused_arguments_and_actors(models) -> None:
    actor = make_actor(models)
    sequences, attention_mask, action_mask = rollout(actor.model.config.vocab_size)
    with pytest.raises(TypeError, match=r"openrlhf\.models\.Actor"):
        lp_openrlhf.use_lp(actor.model)
    vlm = make_actor(models)
    vlm.is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        lp_openrlhf.use_lp(vlm)
    lp_openrlhf.use_lp(actor)
    assert lp_openrlhf.use_lp(actor) is actor  # same options: a no-op
    with pytest.raises(ValueError, match="already uses lp"):
        lp_openrlhf.use_lp(actor, chunk_size=64)
    with pytest.raises(NotImplementedError, match="pixel_values"):
        actor(sequences, action_mask, attention_mask, pixel_values=torch.zeros(1))
    with pytest.raises(ValueError, match="return_entropy=True needs return_output=True"):
        actor(sequences, action_mask, attention_mask, return_entropy=True)
    del actor.packing_samples
    with pytest.raises(AttributeError, match="packing_samples"):
        actor(sequences, action_mask, attention_mask)
    lp_openrlhf.remove_lp(actor)
    assert "forward" not in actor.__dict__


def test_moe_aux_loss_kept(models) -> None:
    """return_output keeps the model's other fields: a Mixtral's router aux_loss, which
    OpenRLHF's actor loss adds (its gradient reaches the routers)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    actor = models.Actor(MixtralForCausalLM(config).eval())
    actor.packing_samples = False
    sequences, attention_mask, action_mask = rollout(config.vocab_size)

    def step():
        actor.model.zero_grad(set_to_none=True)
        log_probs, output = actor(sequences, action_mask, attention_mask, return_output=True)
        (log_probs.sum() + output.aux_loss).backward()
        return log_probs.detach(), output.aux_loss.detach(), grads(actor.model)

    want = step()
    lp_openrlhf.use_lp(actor)
    got = step()
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert_grads_close(got[2], want[2])


class _Engine(torch.nn.Module):
    """What OpenRLHF's DeepSpeed strategy puts in ``actor.model``: a module whose forward
    calls the model and whose other attributes fall through to it (as DeepSpeedEngine's)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def test_engine_as_actor_model(models) -> None:
    """use_lp before the strategy wraps actor.model (the usual order), called after."""
    actor = make_actor(models, "qwen2", tied=True, temperature=0.9)
    batch = rollout(actor.model.config.vocab_size)
    want = _ppo_step(models, actor, *batch)
    lp_openrlhf.use_lp(actor)
    actor.model = _Engine(actor.model)
    got = _ppo_step(models, actor, *batch)
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert_grads_close({k.removeprefix("module."): v for k, v in got[3].items()}, want[3])
