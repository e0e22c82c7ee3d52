"""lp_hf.skyrl.use_lp(worker, fused_loss=True) on skyrl-train 0.3's own policy worker step
(CPU, fp32, tiny random models).

Each case runs SkyRL's ``PolicyWorkerBase.forward_backward`` on one experience, stock (the
wrapper's logits, ``ppo_policy_loss``, the KL and entropy terms, backward) and again after
``use_lp(worker, fused_loss=True)``, and compares the loss handed to
``strategy.backward``, the step's metrics and every parameter's gradient. The worker is
SkyRL's class built without Ray (``__init__`` skipped; the attributes its step reads set
here), the strategy a stand-in whose backward is ``loss.backward()``; the experience's
``to_device`` gets ``"cpu"`` for ``torch.cuda.current_device()``. skyrl-train is imported
as ``_skyrl_setup`` describes.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads
from _skyrl_setup import NUM_ACTIONS, import_skyrl, make_wrapper, rollout

import lp_hf.skyrl as lp_skyrl

TOL = dict(rtol=1e-5, atol=1e-6)
# forward_backward runs under torch.autocast("cuda"), which warns and turns off on CPU
pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")


@pytest.fixture(scope="module")
def sky() -> types.SimpleNamespace:
    """skyrl-train's wrapper, loss, worker and replay-buffer modules (skips without it)."""
    return import_skyrl(
        model_wrapper="skyrl_train.model_wrapper",
        ppo_utils="skyrl_train.utils.ppo_utils",
        worker="skyrl_train.workers.worker",
        replay_buffer="skyrl_train.dataset.replay_buffer",
    )


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``forward_backward`` moves the experience to ``torch.cuda.current_device()``."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


class Strategy:
    """The part of SkyRL's strategy that ``forward_backward`` calls."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor, model, optimizer) -> None:
        self.losses.append(loss.detach())
        loss.backward()


@dataclass(frozen=True)
class Case:
    reduction: str = "token_mean"
    loss_type: str = "regular"
    kl: str | None = None
    entropy: bool = False
    tis: bool = False
    arch: str = "llama"
    tied: bool = False
    packing: bool = False


CASES = {
    "token_mean-kl_k3": Case(kl="k3"),
    "sequence_mean-dual_clip-entropy": Case("sequence_mean", "dual_clip", entropy=True),
    "sum_norm-entropy-kl_k1-tis-qwen2_tied": Case(
        "seq_mean_token_sum_norm", kl="k1", entropy=True, tis=True, arch="qwen2", tied=True
    ),
    "token_mean-dual_clip-kl_k2-entropy-tis-packed": Case(
        "token_mean", "dual_clip", kl="k2", entropy=True, tis=True, arch="qwen2", packing=True
    ),
    "sequence_mean-kl_abs-packed": Case("sequence_mean", kl="abs", packing=True),
}


def make_config(case: Case, **overrides):
    """SkyRL's config: the fields ``forward_backward`` and ``ppo_policy_loss`` read."""
    from omegaconf import OmegaConf

    algorithm = dict(
        policy_loss_type=case.loss_type,
        loss_reduction=case.reduction,
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        clip_ratio_c=3.0,
        use_tis=case.tis,
        tis_imp_ratio_cap=1.5,
        max_seq_len=64,
        use_kl_loss=case.kl is not None,
        kl_estimator_type=case.kl or "k3",
        kl_loss_coef=0.05,
        use_entropy_loss=case.entropy,
        entropy_loss_coef=0.03,
    )
    algorithm.update(overrides)
    sampling = {"temperature": 0.9}
    return OmegaConf.create(
        {"trainer": {"algorithm": algorithm}, "generator": {"sampling_params": sampling}}
    )


def make_worker(sky, case: Case, **overrides):
    """SkyRL's ``PolicyWorkerBase`` with the attributes ``forward_backward`` reads."""
    worker = object.__new__(sky.worker.PolicyWorkerBase)  # no Ray actor: __init__ skipped
    worker.cfg = make_config(case, **overrides)
    worker.model = make_wrapper(sky, case.arch, tied=case.tied, packing=case.packing)
    worker.strategy, worker.optimizer = Strategy(), None
    worker.policy_loss_fn = sky.ppo_utils.PolicyLossRegistry.get(case.loss_type)
    return worker


def make_experience(sky, worker, seed: int = 5):
    """An experience whose old log-probs are the policy's, perturbed so that ratios clip
    on both sides (and past the dual clip); a fully masked row and masked tail tokens."""
    sequences, attention_mask, loss_mask = rollout(worker.model.model.config.vocab_size)
    loss_mask[1, 1:3] = 0
    with torch.no_grad():
        log_probs = worker.model(sequences, NUM_ACTIONS, attention_mask, temperature=0.9)
    g = torch.Generator().manual_seed(seed)
    noise = lambda scale: scale * torch.randn(log_probs.shape, generator=g)
    old = log_probs + noise(0.8)
    old[0, 0] = log_probs[0, 0] - 2.0  # ratio e^2 > clip_ratio_c
    advantages = noise(1.0)
    advantages[0, 0] = -1.0
    return sky.replay_buffer.Experience(
        sequences=sequences,
        action_log_probs=old,
        base_action_log_probs=log_probs + noise(0.3),
        values=None,
        returns=None,
        advantages=advantages,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        action_mask=attention_mask[:, -NUM_ACTIONS:],
        rollout_logprobs=old + noise(0.5),
        num_actions=NUM_ACTIONS,
        info={},
    )


def step(worker, experience) -> tuple[dict, torch.Tensor, dict]:
    """One ``forward_backward`` (2 accumulation steps): status, the loss, every gradient."""
    worker.model.model.zero_grad(set_to_none=True)
    status = worker.forward_backward(experience, 2)
    return status, worker.strategy.losses[-1], grads(worker.model.model)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_step_matches_stock(sky, name: str) -> None:
    case = CASES[name]
    worker = make_worker(sky, case)
    experience = make_experience(sky, worker)
    want = step(worker, experience)
    assert lp_skyrl.use_lp(worker, fused_loss=True, backend="torch") is worker
    assert isinstance(worker.policy_loss_fn, lp_skyrl.FusedPolicyLoss)
    got = step(worker, experience)
    assert got[0].keys() == want[0].keys()
    for key, value in want[0].items():
        assert got[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert ("policy_kl" in got[0]) == (case.kl is not None)
    assert want[0]["ppo_clip_ratio"] > 0
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert_grads_close(got[2], want[2])
    lp_skyrl.remove_lp(worker)
    assert "forward_backward" not in worker.__dict__ and "forward" not in worker.model.__dict__
    assert not isinstance(worker.policy_loss_fn, lp_skyrl.FusedPolicyLoss)


def test_outside_the_step_and_same_options(sky) -> None:
    """The adapted policy_loss_fn called directly is SkyRL's; use_lp again is a no-op."""
    case = Case()
    worker = make_worker(sky, case)
    lp_skyrl.use_lp(worker, fused_loss=True)
    assert lp_skyrl.use_lp(worker, fused_loss=True) is worker
    with pytest.raises(ValueError, match="already uses lp"):
        lp_skyrl.use_lp(worker, fused_loss=True, backend="torch")
    lp = torch.randn(2, 4, requires_grad=True)
    args = (lp, torch.randn(2, 4), torch.randn(2, 4))
    config, mask = worker.cfg.trainer.algorithm, torch.ones(2, 4)
    got = worker.policy_loss_fn(*args, config=config, loss_mask=mask)
    want = sky.ppo_utils.ppo_policy_loss(*args, config=config, loss_mask=mask)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(policy_loss_type="gspo"), "policy_loss_type='gspo'"),
        (dict(loss_reduction="token_sum"), "loss_reduction='token_sum'"),
        (dict(loss_reduction="seq_mean_token_sum_norm", max_seq_len=None), "max_seq_len"),
        (dict(eps_clip_low=1.0), "eps_clip_low=1.0"),
        (dict(eps_clip_high=-0.1), "eps_clip_high=-0.1"),
        (dict(policy_loss_type="dual_clip", clip_ratio_c=0.9), "clip_ratio_c=0.9"),
    ],
    ids=["gspo", "reduction", "max_seq_len", "clip_low", "clip_high", "clip_ratio_c"],
)
def test_refused_options(sky, overrides: dict, match: str) -> None:
    worker = make_worker(sky, Case(), **overrides)
    with pytest.raises(ValueError, match=re.escape(match)):
        lp_skyrl.use_lp(worker, fused_loss=True)
    assert "forward" not in worker.model.__dict__  # every check before any change
    assert "forward_backward" not in worker.__dict__


def test_refused_at_each_step_and_seams(sky, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_worker(sky, Case())
    experience = make_experience(sky, worker)
    lp_skyrl.use_lp(worker, fused_loss=True)
    worker.cfg.trainer.algorithm.eps_clip_low = 1.5  # changed after use_lp
    with pytest.raises(ValueError, match=r"eps_clip_low=1\.5"):
        worker.forward_backward(experience, 1)
    lp_skyrl.remove_lp(worker)
    custom = make_worker(sky, Case())
    custom.policy_loss_fn = lambda *args, **kwargs: sky.ppo_utils.ppo_policy_loss(*args, **kwargs)
    with pytest.raises(ValueError, match="other than SkyRL's ppo_policy_loss"):
        lp_skyrl.use_lp(custom, fused_loss=True)
    with pytest.raises(TypeError, match="policy worker"):
        lp_skyrl.use_lp(worker.model, fused_loss=True)
    sub = type("Sub", (sky.worker.PolicyWorkerBase,), {"forward_backward": lambda *a: {}})
    other = object.__new__(sub)
    other.__dict__.update(make_worker(sky, Case()).__dict__)
    with pytest.raises(TypeError, match=r"overrides PolicyWorkerBase\.forward_backward"):
        lp_skyrl.use_lp(other, fused_loss=True)
    monkeypatch.setattr(lp_skyrl, "seam_digest", lambda: "0" * 16)
    with pytest.raises(RuntimeError, match="not the ones lp-hf has read"):
        lp_skyrl.use_lp(make_worker(sky, Case()), fused_loss=True)


def _sharded_step(worker, experience) -> tuple[dict, torch.Tensor, dict]:
    """:func:`step` under FSDP2: the gradients its post-backward wrote (sharded), gathered."""
    from torch.distributed.tensor import DTensor

    status, loss, found = step(worker, experience)
    for name, g in found.items():
        assert isinstance(g, DTensor), f"{name}: FSDP2's post-backward did not run"
    return status, loss, {name: g.full_tensor() for name, g in found.items()}


def test_fsdp2_root_module(sky, tmp_path) -> None:
    """One-rank FSDP2 on the HF model, the root alone as SkyRL's ``apply_fsdp2`` makes it
    (its backward hooks, on its outputs, are then the only ones that run FSDP2's
    post-backward): the fused step writes every sharded gradient, as stock."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    worker = make_worker(sky, Case(kl="k3", entropy=True))
    experience = make_experience(sky, worker)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fully_shard(worker.model.model, mesh=init_device_mesh("cpu", (1,)))
        want = _sharded_step(worker, experience)
        lp_skyrl.use_lp(worker, fused_loss=True, backend="torch")
        got = _sharded_step(worker, experience)
    finally:
        dist.destroy_process_group()
    for key, value in want[0].items():
        assert got[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert_grads_close(got[2], want[2])
