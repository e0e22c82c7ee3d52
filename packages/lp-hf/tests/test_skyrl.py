"""lp_hf.skyrl on skyrl-train 0.3's own ``HFModelWrapper.forward`` (CPU, fp32, tiny models).

Each case runs the stock forward (materialized logits) and the same wrapper after
``use_lp``: action log-probs, the ``[B, S]`` entropy, SkyRL's own PPO policy loss
(``ppo_policy_loss``) plus an entropy bonus as its policy worker forms it, and the gradient
of every parameter.

skyrl-train is imported as ``_skyrl_setup`` describes (Ray, flash-attn and peft stubbed
while it is imported).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads
from _skyrl_setup import NUM_ACTIONS, import_skyrl
from _skyrl_setup import make_wrapper as _wrapper
from _skyrl_setup import rollout as _rollout

import lp_hf.skyrl as lp_skyrl

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sky() -> types.SimpleNamespace:
    """skyrl-train's ``model_wrapper`` and ``ppo_utils``, imported as ``_skyrl_setup``
    describes (skips when skyrl-train is missing)."""
    return import_skyrl(
        model_wrapper="skyrl_train.model_wrapper", ppo_utils="skyrl_train.utils.ppo_utils"
    )


_LOSS_CONFIG = dict(
    policy_loss_type="regular",
    loss_reduction="token_mean",
    eps_clip_low=0.2,
    eps_clip_high=0.28,
    use_tis=False,
    max_seq_len=64,
)


def _policy_step(sky, wrapper, sequences, attention_mask, loss_mask, temperature, num_actions):
    """SkyRL's policy worker step: PPO loss + entropy bonus; backward; grads."""
    from omegaconf import OmegaConf

    wrapper.model.zero_grad(set_to_none=True)
    log_probs, output = wrapper(
        sequences,
        num_actions,
        attention_mask=attention_mask,
        temperature=temperature,
        return_output=True,
        compute_entropy=True,
        entropy_requires_grad=True,
    )
    g = torch.Generator().manual_seed(7)
    old = log_probs.detach() + 0.3 * torch.randn(log_probs.shape, generator=g)
    advantages = torch.randn(log_probs.shape, generator=g)
    config = OmegaConf.create(_LOSS_CONFIG)
    loss, _ = sky.ppo_utils.ppo_policy_loss(log_probs, old, advantages, config, loss_mask=loss_mask)
    entropy = sky.ppo_utils.masked_mean(output["entropy"][:, -NUM_ACTIONS - 1 : -1], loss_mask)
    (loss - 0.01 * entropy).backward()
    return log_probs.detach(), output["entropy"].detach(), loss.detach(), grads(wrapper.model)


@pytest.mark.parametrize(
    "arch,tied,packing,temperature,num_actions",
    [
        ("llama", False, False, 1.0, NUM_ACTIONS),
        ("qwen2", True, False, 0.7, [NUM_ACTIONS]),
        ("qwen2", False, True, 0.8, NUM_ACTIONS),
    ],
    ids=["llama-untied-T1", "qwen2-tied-T0.7-list", "qwen2-packed-T0.8"],
)
def test_policy_step_matches_stock(sky, arch, tied, packing, temperature, num_actions) -> None:
    wrapper = _wrapper(sky, arch, tied=tied, packing=packing)
    batch = _rollout(wrapper.model.config.vocab_size)
    want = _policy_step(sky, wrapper, *batch, temperature, num_actions)
    assert lp_skyrl.use_lp(wrapper) is wrapper
    got = _policy_step(sky, wrapper, *batch, temperature, num_actions)
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[0].shape == (3, NUM_ACTIONS)
    torch.testing.assert_close(got[1], want[1], **TOL)  # [B, S], zero at padding
    assert got[1].shape == batch[0].shape
    torch.testing.assert_close(got[2], want[2], **TOL)
    assert_grads_close(got[3], want[3])


def test_action_logprobs_only_and_detached_entropy(sky) -> None:
    """Only the action columns computed (logits_to_keep); entropy_requires_grad=False."""
    wrapper = _wrapper(sky)
    sequences, attention_mask, _ = _rollout(wrapper.model.config.vocab_size)
    want = wrapper(sequences, NUM_ACTIONS, attention_mask, temperature=1.3)
    _, want_out = wrapper(
        sequences,
        NUM_ACTIONS,
        attention_mask,
        return_output=True,
        compute_entropy=True,
        entropy_requires_grad=False,
    )
    lp_skyrl.use_lp(wrapper, deterministic=True)
    got = wrapper(sequences, NUM_ACTIONS, attention_mask, temperature=1.3)
    _, got_out = wrapper(
        sequences,
        NUM_ACTIONS,
        attention_mask,
        return_output=True,
        compute_entropy=True,
        entropy_requires_grad=False,
    )
    assert isinstance(got, torch.Tensor) and got.requires_grad
    torch.testing.assert_close(got, want, **TOL)
    assert not got_out["entropy"].requires_grad and not want_out["entropy"].requires_grad
    torch.testing.assert_close(got_out["entropy"], want_out["entropy"], **TOL)
    assert "logits" not in got_out


def test_generate_stays_stock(sky) -> None:
    wrapper = _wrapper(sky)
    lp_skyrl.use_lp(wrapper)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = wrapper.generate(
        prompt, max_new_tokens=3, do_sample=False, eos_token_id=1, pad_token_id=0
    )
    assert out[0].shape == (1, 7)
    assert wrapper.model.get_output_embeddings().__dict__.get("forward") is None


def test_version_guard(sky, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = _wrapper(sky)
    monkeypatch.setattr(lp_skyrl, "skyrl_train_version", lambda: "0.4.0")
    with pytest.raises(RuntimeError, match=r"supports skyrl-train 0\.3\.x.*found skyrl-train 0\.4"):
        lp_skyrl.use_lp(wrapper)
    assert "forward" not in wrapper.__dict__


def test_refused_arguments_and_wrappers(sky) -> None:
    wrapper = _wrapper(sky)
    sequences, attention_mask, _ = _rollout(wrapper.model.config.vocab_size)
    with pytest.raises(TypeError, match="HFModelWrapper"):
        lp_skyrl.use_lp(wrapper.model)
    parallel = _wrapper(sky)
    parallel.sequence_parallel_size = 2
    with pytest.raises(NotImplementedError, match="sequence_parallel_size"):
        lp_skyrl.use_lp(parallel)
    lp_skyrl.use_lp(wrapper)
    assert lp_skyrl.use_lp(wrapper) is wrapper
    with pytest.raises(ValueError, match="already uses lp"):
        lp_skyrl.use_lp(wrapper, backend="torch")
    with pytest.raises(ValueError, match="one-element list"):
        wrapper(sequences, [3, 4], attention_mask)
    wrapper.sequence_parallel_size = 2
    with pytest.raises(NotImplementedError, match="sequence_parallel_size"):
        wrapper(sequences, NUM_ACTIONS, attention_mask)
    lp_skyrl.remove_lp(wrapper)
    assert "forward" not in wrapper.__dict__
