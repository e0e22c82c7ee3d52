"""``lp_megatron.skyrl.use_lp``: SkyRL's Megatron fused LM-head path computed by lp.

SkyRL's own functions drive a tiny megatron-core GPTModel (2 layers, h 32, 4 heads, 98
output rows of which the "tokenizer" uses 93, s 8, b 2, fp32) at TP 2 over gloo on CPU:
``call_model_with_fused_lm_head`` with SkyRL's ``fused_lm_head_output_processor`` (the
hidden state and the kept weight, as the worker's ``forward_step`` calls them), then
``from_parallel_hidden_to_logprobs`` and ``_fused_vocab_parallel_entropy_from_hidden`` on
the action columns, as the worker's loss does, its sample-packing variant, and one direct
call of the
``_fused_lm_head_logprob_apply`` seam with targets in the padded rows and outside every
shard. Stock = SkyRL's torch backend; the entropy's gradient (SkyRL's has none) is checked
against the model's own logits, all-gathered, in fp64. Log-probs, entropy and every
parameter's gradient must match to fp32 tolerance, with and without sequence parallel,
tied and untied, at temperatures 1, 0.7 and 1.3.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

import lp_testing

S, B, H, HEADS, V_PADDED, V_REAL, ACTIONS = 8, 2, 32, 4, 98, 93, 5
RTOL, ATOL = 1e-4, 1e-5
_MODEL_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
_PROCESSOR = "skyrl.backends.skyrl_train.distributed.megatron.fused_lm_head"


@dataclass(frozen=True)
class Case:
    sp: bool
    tied: bool
    temperature: float

    @property
    def name(self) -> str:
        return f"sp{int(self.sp)}-tied{int(self.tied)}-T{self.temperature}"


CASES = [Case(False, False, 1.0), Case(True, True, 0.7), Case(False, True, 1.3)]


def _config(enabled: bool = True) -> types.SimpleNamespace:
    """The two fields of SkyRL's TrainerConfig that use_lp reads."""
    return types.SimpleNamespace(fused_lm_head_logprob=enabled, strategy="megatron")


def _build(case: Case, tp: int, vocab: int = V_PADDED):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=case.sp, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=S,
        share_embeddings_and_output_weights=case.tied,
    )  # fmt: skip


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V_REAL, (B, S), generator=g)
    ids[0, 4] = V_PADDED - 1  # a padded row as a token (and as the previous one's target)
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)
    seam_targets = torch.randint(0, V_PADDED, (B, S), generator=g)
    seam_targets[0, 1], seam_targets[1, 6] = V_PADDED + 3, -1  # outside every shard
    seam_targets[1, 2] = V_PADDED - 2  # a padded row
    weights = torch.randn(4, B, S, generator=g)
    return ids, pos, mask, seam_targets, weights


def _skyrl_step(model, case: Case, inputs, inference_only: bool = False, entropy_grad=True):
    """The worker's fused forward and loss calls, from SkyRL's modules (looked up now).
    SkyRL computes its fused entropy without gradient (``entropy_grad=False``)."""
    import importlib

    from megatron.core import parallel_state as mpu

    mu, fused = importlib.import_module(_MODEL_UTILS), importlib.import_module(_PROCESSOR)
    ids, pos, mask, seam_targets, _ = inputs
    ctx: dict = {}
    hidden = fused.call_model_with_fused_lm_head(
        model, ids, pos, mask, output_processor=fused.fused_lm_head_output_processor,
        output_processor_context=ctx,
    )  # fmt: skip
    weight, group = ctx["lm_head_weight"], mpu.get_tensor_model_parallel_group()
    rank, rows = mpu.get_tensor_model_parallel_rank(), weight.shape[0]
    bounds = dict(vocab_start_index=rank * rows, vocab_end_index=(rank + 1) * rows)
    logprob = mu.from_parallel_hidden_to_logprobs(
        hidden, weight, ids, **bounds, tp_group=group, inference_only=inference_only,
        cp_group=None, chunk_size=3, temperature=case.temperature, fused_backend="torch",
    )  # fmt: skip
    if inference_only:
        return logprob, None, None, None
    with torch.set_grad_enabled(entropy_grad):
        entropy = mu._fused_vocab_parallel_entropy_from_hidden(
            hidden[:, -ACTIONS - 1 : -1, :], weight, group, chunk_size=3,
            temperature=case.temperature,
        )  # fmt: skip
    seam = mu._fused_lm_head_logprob_apply(
        "torch", hidden, weight / case.temperature, seam_targets, *bounds.values(), 3, group, False
    )
    # sample packing: the B rows as one [1, B * S] sequence with its cu_seqlens
    packed = mu.from_parallel_hidden_to_logprobs_packed_sequences(
        hidden.reshape(1, B * S, H), weight, ids.reshape(1, B * S), torch.tensor([0, S, 2 * S]),
        S, **bounds, group=group, inference_only=False, cp_group=None, chunk_size=3,
        temperature=case.temperature, fused_backend="torch",
    )  # fmt: skip
    return logprob, entropy, seam, packed


def _reference_entropy(model, case: Case, inputs) -> torch.Tensor:
    """Entropy of the action columns from the stock logits: all-gather, fp64."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    ids, pos, mask, *_ = inputs
    logits = gather_from_tensor_model_parallel_region(model(ids, pos, mask)).double()
    lsm = torch.log_softmax(logits / case.temperature, dim=-1)[:, -ACTIONS - 1 : -1]
    return (-(lsm.exp() * lsm).sum(-1)).float()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        p.grad = None
    return out


def _loss(outs, weights) -> torch.Tensor:
    logprob, entropy, seam, packed = outs
    w = weights
    loss = (w[0, :, :-1] * logprob).sum() + (w[1, :, :ACTIONS] * entropy).sum()
    return loss + (w[2] * seam).sum() + (w[3, :, 1:] * packed).sum()


def _case(case: Case, tp: int) -> dict:
    from lp_megatron.skyrl import use_lp

    model, inputs = _build(case, tp), _inputs()
    weights = inputs[-1]
    # stock: SkyRL's torch backend; its entropy is a no-grad metric, so the entropy
    # gradient's reference is the logits' (the gradients of both passes add up)
    stock = _skyrl_step(model, case, inputs, entropy_grad=False)
    _loss((stock[0], torch.zeros(B, ACTIONS), *stock[2:]), weights).backward()
    (weights[1, :, :ACTIONS] * _reference_entropy(model, case, inputs)).sum().backward()
    res = {"stock": [t.detach() for t in stock], "stock_grads": _grads(model)}
    res["stock_infer"] = _skyrl_step(model, case, inputs, inference_only=True)[0]
    with use_lp(_config(), backend="torch") as handle:
        assert use_lp(_config(), backend="torch") is handle  # same options: same handle
        with pytest.raises(RuntimeError, match="already SkyRL's fused LM-head backend"):
            use_lp(_config(), backend="torch", deterministic=True)
        outs = _skyrl_step(model, case, inputs)
        _loss(outs, weights).backward()
        res["lp"], res["lp_grads"] = [t.detach() for t in outs], _grads(model)
        res["reused"] = handle.entropy_reused
        infer = _skyrl_step(model, case, inputs, inference_only=True)[0]
        res["lp_infer"], res["infer_grad"] = infer, infer.requires_grad
    res["restored"] = _restored()
    return res


def _restored() -> bool:
    import importlib

    mu = importlib.import_module(_MODEL_UTILS)
    return all(
        getattr(mu, name).__module__ == _MODEL_UTILS
        for name in ("_fused_lm_head_logprob_apply", "from_parallel_hidden_to_logprobs",
                     "_fused_vocab_parallel_entropy_from_hidden")
    )  # fmt: skip


def _deterministic_reaches_lp(tp: int) -> str:
    """deterministic=True on shards of 49 rows: lp's 128-row rule raises (the option arrives)."""
    from lp_megatron.skyrl import use_lp

    model, inputs = _build(CASES[0], tp), _inputs()
    handle = use_lp(_config(), deterministic=True, backend="torch")
    with handle, pytest.raises(ValueError, match="128") as info:
        _skyrl_step(model, CASES[0], inputs)
    return str(info.value)


def _rank(rank: int, world_size: int) -> dict:
    results: dict = {}
    with lp_testing.MegatronCpuPatches():
        for case in CASES:
            results[case.name] = _case(case, world_size)
        results["deterministic"] = _deterministic_reaches_lp(world_size)
    return results


@pytest.fixture(scope="module")
def skyrl():
    module = lp_testing.import_trainer(_PROCESSOR)  # skips when SkyRL is not installed
    lp_testing.set_forkserver_preload(
        ["megatron.core", "megatron.core.models.gpt.gpt_model", "lp_kernels", _MODEL_UTILS]
    )
    return module


def test_skyrl_fused_path_matches_stock_tp2(skyrl) -> None:
    """Log-probs, entropy and every parameter gradient: lp through SkyRL's functions against
    SkyRL's torch backend (and the logits' entropy gradient), TP 2 over gloo."""
    results = lp_testing.run_ranks(_rank, 2, timeout=240)
    for rank, per_rank in enumerate(results):
        for case in CASES:
            r, where = per_rank[case.name], f"rank {rank} {case.name}"
            fields = ("logprob", "entropy", "seam", "packed")
            for field, a, b in zip(fields, r["lp"], r["stock"], strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{where} {field}")
            assert r["lp"][2][0, 1] == 0 and r["lp"][2][1, 6] == 0, f"{where}: outside targets"
            assert r["reused"] == 1, f"{where}: entropy not taken from the log-prob call"
            torch.testing.assert_close(r["lp_infer"], r["stock_infer"], rtol=RTOL, atol=ATOL)
            assert not r["infer_grad"], f"{where}: inference_only built a graph"
            assert r["restored"], f"{where}: remove() left lp in SkyRL's module"
            assert r["lp_grads"].keys() == r["stock_grads"].keys()
            for name, g in r["stock_grads"].items():
                assert g.abs().sum() > 0, f"{where} {name}: zero grad"
                torch.testing.assert_close(
                    r["lp_grads"][name], g, rtol=RTOL, atol=ATOL, msg=f"{where} {name}"
                )
        assert "128" in per_rank["deterministic"]
    for case in CASES:  # the same log-probs on both ranks
        torch.testing.assert_close(results[0][case.name]["lp"][0], results[1][case.name]["lp"][0])


def test_use_lp_requires_the_fused_path(skyrl) -> None:
    from lp_megatron.skyrl import use_lp

    with pytest.raises(ValueError, match=r"trainer\.fused_lm_head_logprob=true"):
        use_lp(_config(enabled=False))
    with pytest.raises(ValueError, match=r"trainer\.fused_lm_head_logprob=true"):
        use_lp(types.SimpleNamespace(trainer=_config(enabled=False)))
    wrong = types.SimpleNamespace(fused_lm_head_logprob=True, strategy="fsdp2")
    with pytest.raises(ValueError, match="strategy"):
        use_lp(wrong)


def test_use_lp_version_guard(skyrl, monkeypatch: pytest.MonkeyPatch) -> None:
    import lp_megatron.skyrl as adapter

    monkeypatch.setattr(adapter, "skyrl_version", lambda: "0.4.1")
    with pytest.raises(RuntimeError, match=r"supports skyrl 0\.4\.0.*found skyrl 0\.4\.1"):
        adapter.use_lp(_config())
