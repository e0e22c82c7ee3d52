"""lp_hf.verl as verl 0.9's fused-kernel backend ``lp`` (CPU, fp32, tiny random models).

Each case patches a model as verl's FSDP engine does (``patch_forward_with_backends``, the
fused-kernel step that ``apply_monkey_patch`` ends with) once with verl's stock ``torch``
backend and once with ``lp``, calls it with the engine's inputs (remove-padding layout:
``[1, N]`` ids, restarting positions, ``shift_labels`` = the rolled ids; or a padded
``[B, S]`` batch), and compares log-probs, entropy, verl's own ``compute_policy_loss``
minus an entropy bonus, and every parameter's gradient.

verl is imported as ``_verl_setup.load_verl`` does (Ray stubbed while it imports; the
class forwards that verl's ``torch`` backend replaces are put back afterwards).
"""

from __future__ import annotations

import importlib.metadata
import types
import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads, tiny_model
from _verl_setup import load_verl, patched

import lp_hf.verl as lp_verl
from lp_hf.adapters import HeadOptions

TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*compute_policy_loss.*:FutureWarning",  # the clipped PPO loss, verl's oldest name
    "ignore:`past_key_values` is deprecated:FutureWarning",  # verl's own decoder call
    "ignore:FSDP2-wrapped module:UserWarning",  # verl's torch backend returns views
)


@pytest.fixture(scope="module")
def verl() -> Iterator[types.SimpleNamespace]:
    """verl's ``monkey_patch`` and ``core_algos`` (skips when verl is missing)."""
    yield from load_verl()


def _rmpad_batch(vocab: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """The engine's remove-padding inputs: 3 sequences (7, 4, 9 tokens) packed to [1, 20]."""
    g = torch.Generator().manual_seed(seed)
    lengths = (7, 4, 9)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, attention_mask=None, position_ids=positions)


def _padded_batch(vocab: int, seed: int = 4) -> dict[str, torch.Tensor]:
    """A right-padded [3, 8] batch: the engine's path without remove-padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1)


def _step(verl, model, batch: dict[str, torch.Tensor], temperature: float, rmpad: bool):
    """One actor update as verl forms it: fused forward, PPO loss, entropy bonus, backward."""
    model.zero_grad(set_to_none=True)
    extra = dict(temperature=temperature, return_dict=True, use_cache=False)
    if rmpad:
        extra["shift_labels"] = torch.roll(batch["input_ids"], shifts=-1, dims=1)
    out = model(**batch, **extra)
    log_probs, entropy = out.log_probs, out.entropy
    g = torch.Generator().manual_seed(7)
    old = log_probs.detach() + 0.3 * torch.randn(log_probs.shape, generator=g)
    advantages = torch.randn(log_probs.shape, generator=g)
    mask = torch.ones_like(log_probs) if rmpad else batch["attention_mask"].float()
    pg_loss, *_ = verl.core_algos.compute_policy_loss(
        old, log_probs, advantages, mask, cliprange=0.2, loss_agg_mode="token-mean"
    )
    bonus = verl.core_algos.agg_loss(entropy, mask, loss_agg_mode="token-mean")
    (pg_loss - 0.01 * bonus).backward()
    return log_probs.detach(), entropy.detach(), pg_loss.detach(), grads(model)


@pytest.mark.parametrize(
    "arch,tied,temperature,rmpad",
    [
        ("qwen2", False, 1.0, True),
        ("llama", True, 0.7, True),
        ("qwen2", True, 1.3, False),
    ],
    ids=["qwen2-untied-T1-rmpad", "llama-tied-T0.7-rmpad", "qwen2-tied-T1.3-padded"],
)
def test_actor_step_matches_torch_backend(verl, arch, tied, temperature, rmpad) -> None:
    make = _rmpad_batch if rmpad else _padded_batch
    batch = make(311)
    want = _step(verl, patched(verl, "torch", arch, tied), batch, temperature, rmpad)
    model = patched(verl, "lp", arch, tied)
    assert "forward" in model.__dict__ and model._verl_fused_kernels_backend == "lp"
    got = _step(verl, model, batch, temperature, rmpad)
    assert got[0].shape == want[0].shape == batch["input_ids"].shape
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    torch.testing.assert_close(got[2], want[2], **TOL)
    assert_grads_close(got[3], want[3])


def _registered(verl) -> bool:
    """Whether verl's fused-kernel patch takes "lp" now (else it skips the name)."""
    model = tiny_model("llama", layers=1)
    verl.monkey_patch.patch_forward_with_backends(
        model, use_fused_kernels=True, fused_kernels_backend="lp"
    )
    return "forward" in model.__dict__


def test_entry_point_registers_at_import(verl) -> None:
    points = importlib.metadata.entry_points(group="verl.plugins")
    assert [p.value for p in points if p.name == "lp"] == ["lp_hf.verl:verl_plugin"]
    lp_verl.remove_lp()
    assert not _registered(verl)
    assert points["lp"].load() is lp_verl.use_lp  # what verl's loader does
    assert _registered(verl)


def test_other_backends_reach_verl(verl) -> None:
    model = tiny_model("llama")
    verl.monkey_patch.patch_forward_with_backends(model, use_fused_kernels=False)
    assert "forward" not in model.__dict__
    assert not hasattr(model, "_verl_fused_kernels_backend")


def test_version_guard(verl, monkeypatch) -> None:
    monkeypatch.setattr(lp_verl, "verl_version", lambda: "0.10.0")
    with pytest.raises(RuntimeError, match=r"supports verl 0\.9\.x.*found verl 0\.10\.0"):
        lp_verl.use_lp()
    lp_verl.remove_lp()
    with pytest.warns(UserWarning, match="impl_backend=lp is unavailable"):
        lp_verl.verl_plugin  # noqa: B018 - the entry point's lookup
    assert not _registered(verl)
    monkeypatch.undo()
    lp_verl.use_lp()


def test_refusals(verl) -> None:
    lp_verl.use_lp()
    with pytest.raises(ValueError, match="registered in verl with"):
        lp_verl.use_lp(chunk_size=64)
    model = patched(verl, "lp", "llama", False)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="logits_to_keep"):
        model(input_ids=ids, return_dict=True, logits_to_keep=1)
    with pytest.raises(NotImplementedError, match="return_dict=True"):
        model(input_ids=ids, return_dict=False)
    with pytest.raises(NotImplementedError, match="KV cache"):
        model(input_ids=ids, return_dict=True, use_cache=True)
    with pytest.raises(ValueError, match="already uses lp"):
        lp_verl.use_lp_forward(model, HeadOptions(chunk_size=64))
    vl = tiny_model("llama")
    vl.config.model_type = "qwen2_vl"
    with pytest.raises(NotImplementedError, match="multimodal"):
        verl.monkey_patch.patch_forward_with_backends(
            vl, use_fused_kernels=True, fused_kernels_backend="lp"
        )


def _fsdp2_steps(verl, backend: str, mesh) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two forward/backward steps of a fully_shard-ed model patched for ``backend``."""
    from torch.distributed.fsdp import fully_shard

    model = patched(verl, backend, "qwen2", False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = _rmpad_batch(311)
    shifted = torch.roll(batch["input_ids"], shifts=-1, dims=1)
    log_probs = []
    for _ in range(2):
        out = model(
            **batch, temperature=0.8, return_dict=True, shift_labels=shifted, use_cache=False
        )
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        log_probs.append(out.log_probs.detach())
    full = {name: g.full_tensor() for name, g in grads(model).items()}
    return log_probs, full


def test_fsdp2_root_module(verl, tmp_path) -> None:
    """Under fully_shard the lp forward runs the model's own forward once more inside the
    root module's (FSDP2's hooks run twice, nested): same results as the torch backend over
    two steps, and no view among the outputs (FSDP2 hooks them for backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        want = _fsdp2_steps(verl, "torch", mesh)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "FSDP2-wrapped module .* returned a view")
            got = _fsdp2_steps(verl, "lp", mesh)
    finally:
        dist.destroy_process_group()
    for step_got, step_want in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(step_got, step_want, **TOL)
    assert_grads_close(got[1], want[1])
