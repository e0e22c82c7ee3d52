"""lp_hf.verl's fused loss: ``fused_kernel_options.lp_fused_loss`` on verl 0.9's FSDP engine.

Each case runs verl's own ``FSDPEngineWithLMHead.forward_step`` (an engine object without
its distributed set-up: the model, configs and flags that the step reads) on one actor
micro-batch, once stock (verl's ``torch`` fused backend and verl's ``ppo_loss``) and once
with ``impl_backend=lp`` and ``lp_fused_loss=True``, and compares the loss, verl's
metrics and every parameter's gradient. The micro-batch is the engine's nested layout:
3 sequences of prompt + response, a response mask with holes, remove-padding or padded.
Cases: every ``loss_agg_mode`` (with and without global batch info), clip-higher, a dual
clip that binds, each KL type lp maps, entropy coefficients 0, positive and negative;
the refusals; the step without the key; one-rank FSDP2.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import assert_grads_close, grads
from _verl_setup import load_verl, patched

import lp_hf.verl as lp_verl

VOCAB = 311
TEMPERATURE = 0.8
PROMPTS, RESPONSES = (3, 2, 4), (5, 4, 6)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`past_key_values` is deprecated:FutureWarning",
    "ignore:.*is not available:UserWarning",
    "ignore:The PyTorch API of nested tensors:UserWarning",
)


@pytest.fixture(scope="module")
def verl() -> Iterator[types.SimpleNamespace]:
    """verl with its FSDP engine module (skips when verl is missing)."""
    yield from load_verl(engine=True)


@pytest.fixture
def cpu_engine(verl, monkeypatch) -> None:
    """verl's engine step asks the accelerator for its device: answer the CPU."""
    monkeypatch.setattr(verl.engine, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(verl.engine, "get_device_name", lambda: "cpu")


def _engine(verl, model: torch.nn.Module, options: dict) -> object:
    """An ``FSDPEngineWithLMHead`` holding ``model``, with the attributes its step reads."""
    engine = object.__new__(verl.engine.FSDPEngineWithLMHead)
    engine.module = model
    engine.model_config = types.SimpleNamespace(fused_kernel_options=options)
    engine.engine_config = types.SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=False
    )
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
    engine.ulysses_device_mesh, engine.pad_to_length = None, False
    engine._autocast_dtype = torch.float32
    return engine


def _nested(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(values, layout=torch.jagged)


def _micro_batch(verl, model, *, rmpad: bool, entropy: bool, info: dict, seed: int = 5):
    """The actor's micro-batch as the engine's step gets it; old log-probs near the
    model's own (ratios inside and past the clip bounds), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPTS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in RESPONSES]
    ids = [torch.cat(pair) for pair in zip(prompts, responses, strict=True)]
    with torch.no_grad():
        logits = [model.model(input_ids=i[None]).last_hidden_state[0] for i in ids]
        logits = [model.lm_head(h) for h in logits]
    current = [
        torch.log_softmax(z[:-1] / TEMPERATURE, -1).gather(-1, i[1:, None])[-r:, 0]
        for z, i, r in zip(logits, ids, RESPONSES, strict=True)
    ]
    masks = [torch.ones(r) for r in RESPONSES]
    masks[1][1] = 0  # a tool token inside a response
    tensors = {
        "input_ids": _nested(ids),
        "position_ids": _nested([torch.arange(len(i)) for i in ids]),
        "prompts": _nested(prompts),
        "responses": _nested(responses),
        "response_mask": _nested(masks),
        "old_log_probs": _nested([c + 0.4 * torch.randn(c.shape, generator=g) for c in current]),
        "advantages": _nested([torch.randn(r, generator=g) for r in RESPONSES]),
        "ref_log_prob": _nested([c + 0.2 * torch.randn(c.shape, generator=g) for c in current]),
    }
    flags = dict(temperature=TEMPERATURE, use_remove_padding=rmpad, use_fused_kernels=True)
    flags.update(calculate_entropy=entropy, **info)
    return verl.tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=flags)


def _config(verl, **fields) -> object:
    fields = dict(strategy="fsdp2", ppo_micro_batch_size_per_gpu=3, **fields)
    return verl.config.FSDPActorConfig(ppo_mini_batch_size=3, rollout_n=1, **fields)


def _step(verl, backend: str, config, *, rmpad, entropy, info, arch="qwen2", tied=False, mesh=None):
    """One actor micro-batch through verl's engine step and backward: ``(loss, metrics,
    grads)``; ``backend`` ``"stock"`` (verl's torch backend), ``"lp"`` (the fused loss
    on) or ``"lp-unfused"`` (lp's forward, verl's loss); with ``mesh``, under FSDP2."""
    model = patched(verl, "torch" if backend == "stock" else "lp", arch, tied, vocab=VOCAB)
    batch = _micro_batch(verl, model, rmpad=rmpad, entropy=entropy, info=info)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    options = {"impl_backend": "torch" if backend == "stock" else "lp"}
    if backend == "lp":
        options[lp_verl.FUSED_LOSS_KEY] = True
    engine = _engine(verl, model, options)
    loss_fn = functools.partial(verl.losses.ppo_loss, config=config)
    loss, out = engine.forward_step(batch, loss_function=loss_fn, forward_only=False)
    loss.backward()
    metrics = {k: getattr(m, "values", m) for k, m in out["metrics"].items()}  # Metric: its values
    found = grads(model)
    if mesh is not None:  # the sharded gradients FSDP2's post-backward wrote
        found = {name: g.full_tensor() for name, g in found.items()}
    return loss.detach(), out["loss"], metrics, found


def _compare(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert got[1] == pytest.approx(want[1], rel=1e-6, abs=1e-6)
    assert got[2].keys() == want[2].keys()
    for name, value in want[2].items():
        value = torch.as_tensor(value, dtype=torch.float64)
        torch.testing.assert_close(
            torch.as_tensor(got[2][name], dtype=torch.float64), value, rtol=1e-5, atol=1e-6
        )
    assert_grads_close(got[3], want[3])


CASES = {
    "token-mean": (dict(), True, False, {}),
    "token-mean-entropy-clip-higher": (
        dict(entropy_coeff=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28),
        True,
        True,
        {},
    ),
    "token-mean-dual-clip-1.01-padded": (dict(clip_ratio_c=1.01), False, True, {}),
    "seq-mean-token-mean-k3": (
        dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1),
        True,
        True,
        dict(dp_size=2, global_batch_size=6),
    ),
    "seq-mean-token-sum-k1-entropy": (
        dict(
            loss_agg_mode="seq-mean-token-sum",
            use_kl_loss=True,
            kl_loss_type="kl",
            kl_loss_coef=0.05,
            entropy_coeff=-0.02,
        ),
        True,
        True,
        {},
    ),
    "seq-mean-token-sum-norm-mse": (
        dict(
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_scale_factor=16,
            use_kl_loss=True,
            kl_loss_type="mse",
            kl_loss_coef=0.3,
        ),
        False,
        False,
        {},
    ),
    "token-sum-k2+-entropy": (
        dict(
            loss_agg_mode="token-sum",
            use_kl_loss=True,
            kl_loss_type="k2+",
            entropy_coeff=0.01,
        ),
        True,
        True,
        dict(dp_size=2, batch_num_tokens=30),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_matches_stock(verl, cpu_engine, case) -> None:
    fields, rmpad, entropy, info = CASES[case]
    info = dict(dict(dp_size=1, batch_num_tokens=None, global_batch_size=None), **info)
    config = _config(verl, **fields)
    want = _step(verl, "stock", config, rmpad=rmpad, entropy=entropy, info=info)
    got = _step(verl, "lp", config, rmpad=rmpad, entropy=entropy, info=info)
    _compare(got, want)


def test_without_the_key_the_step_is_verls(verl, cpu_engine) -> None:
    """``impl_backend=lp`` alone: verl's own step and loss on lp's log-probs."""
    config = _config(verl, use_kl_loss=True, entropy_coeff=0.01)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    run = dict(rmpad=True, entropy=True, info=info)
    _compare(_step(verl, "lp-unfused", config, **run), _step(verl, "stock", config, **run))


def test_metrics_and_clipping_exercised(verl, cpu_engine) -> None:
    """The cases reach both clip bounds and the dual clip, and verl's metrics are there."""
    config = _config(verl, clip_ratio_c=1.01, use_kl_loss=True, entropy_coeff=0.01)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    run = dict(rmpad=True, entropy=True, info=info, arch="llama", tied=True)
    got, want = _step(verl, "lp", config, **run), _step(verl, "stock", config, **run)
    _compare(got, want)
    names = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert names | {"actor/entropy_loss", "kl_loss", "kl_coef"} <= got[2].keys()
    assert float(got[2]["actor/pg_clipfrac"][0]) > 0
    assert float(got[2]["actor/pg_clipfrac_lower"][0]) > 0


def _refused(verl, config, *, batch_extra=None, engine_extra=None, options=None, loss=None):
    """The fused step's error on one micro-batch; the model got no gradient."""
    model = patched(verl, "lp", "qwen2", False, vocab=VOCAB)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    batch = _micro_batch(verl, model, rmpad=True, entropy=False, info=info)
    for key, value in (batch_extra or {}).items():
        batch[key] = value
    engine = _engine(verl, model, options or {"impl_backend": "lp", lp_verl.FUSED_LOSS_KEY: True})
    for key, value in (engine_extra or {}).items():
        setattr(engine, key, value)
    loss = loss or functools.partial(verl.losses.ppo_loss, config=config)
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        engine.forward_step(batch, loss_function=loss, forward_only=False)
    assert all(p.grad is None for p in model.parameters())
    return str(excinfo.value)


def test_refusals(verl, cpu_engine, monkeypatch) -> None:
    cfg = _config(verl)
    policy = verl.config.PolicyLossConfig(loss_mode="gpg")
    assert "policy_loss.loss_mode='gpg'" in _refused(verl, _config(verl, policy_loss=policy))
    for kind in ("abs", "k3+", "low_var_kl+"):
        config = _config(verl, use_kl_loss=True, kl_loss_type=kind)
        assert f"kl_loss_type={kind!r}" in _refused(verl, config)
    weights = torch.nested.as_nested_tensor([torch.ones(r) for r in RESPONSES], layout=torch.jagged)
    msg = _refused(
        verl,
        cfg,
        batch_extra={"rollout_is_weights": weights},
        engine_extra=dict(use_ulysses_sp=True, pad_to_length=True),
    )
    for name in ("rollout_is_weights", "Ulysses", "pad_to_length", "remove lp_fused_loss"):
        assert name in msg
    other = functools.partial(lambda config, **kw: None, config=cfg)
    assert "distillation or another loss" in _refused(verl, cfg, loss=other)
    options = {"impl_backend": "torch", lp_verl.FUSED_LOSS_KEY: True}
    model = patched(verl, "torch", "qwen2", False, vocab=VOCAB)
    engine = _engine(verl, model, options)
    with pytest.raises(ValueError, match="impl_backend=lp"):
        engine.forward_step(None, loss_function=print, forward_only=False)
    monkeypatch.setattr(lp_verl, "loss_digest", lambda: "0" * 16)
    assert "not the ones lp-hf has read" in _refused(verl, cfg)


def test_remove_lp_restores_the_engine_step(verl) -> None:
    patched(verl, "lp", "qwen2", False)
    engine_cls = verl.engine.FSDPEngineWithLMHead
    assert type(engine_cls.__dict__["forward_step"]).__name__ == "_FusedStep"
    lp_verl.remove_lp()
    assert callable(engine_cls.__dict__["forward_step"])
    assert type(engine_cls.__dict__["forward_step"]).__name__ == "function"
    lp_verl.use_lp()


def test_fsdp2_root_module(verl, cpu_engine, tmp_path) -> None:
    """Under one-rank FSDP2 the fused loss leaves the model beside its outputs (which carry
    no gradient): FSDP2's post-backward still writes every sharded gradient, as stock."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        config = _config(verl, use_kl_loss=True, entropy_coeff=0.01)
        info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
        run = dict(rmpad=True, entropy=True, info=info, mesh=mesh)
        want = _step(verl, "stock", config, **run)
        got = _step(verl, "lp", config, **run)
    finally:
        dist.destroy_process_group()
    _compare(got, want)
