"""``lp_megatron.verl.use_lp``: verl 0.9's Megatron fused forward with lp's output step.

verl's own ``fused_forward_model_engine`` (what the Megatron engine's forward step calls
with ``use_fused_kernels=True``) drives a tiny megatron-core GPTModel (2 layers, h 32, 98
output rows, fp32) at TP 1 and 2 over gloo on CPU: it packs two sequences of lengths 5
and 7 to THD, calls the model at megatron-core's output-processor hook and unpacks the
per-sequence log-probs and entropy. Stock = verl's own ``fused_output_processor``; lp =
the same call after ``use_lp``. Log-probs and entropy must agree within 1e-6, every
parameter's gradient (of a random weighting of both) to fp32 rounding; tied and untied,
temperatures 1 and 0.7, with and without sequence parallelism.

What stands in on CPU, and why:

- verl's ``linear_cross_entropy`` is a CUDA kernel (it asserts ``is_cuda``); the stock
  processor runs with a torch function of its contract in its place: logits of the
  weight shard over ``T``, all-gathered over the TP group, log-softmax, the labels'
  log-probs and the entropy, flat ``[T]``. Like the kernel's backward (which runs no
  collective), the hidden gradient it returns is this shard's part only.
- the decoder layers have no self-attention (megatron-core's ``IdentityOp``): verl always
  packs to THD, which megatron's local ``DotProductAttention`` refuses and Transformer
  Engine's needs CUDA; the output step sees the decoder's hidden states only.
- ``import verl`` imports Ray; Ray is a stub in ``sys.modules`` while verl is imported,
  as in lp-hf's verl test.

TP 2 without sequence parallelism: megatron's hook hands over the hidden state before the
output layer's ``copy_to_tensor_model_parallel_region``, and verl's kernel does not sum
the hidden gradient over TP, so verl's stock decoder gradients there are one shard's
part. lp sums it (as the stock output layer would); that case's decoder gradients are
compared with the stock processor whose hidden gradient is summed over TP.
"""

from __future__ import annotations

import copy
import importlib.machinery
import sys
from dataclasses import dataclass
from unittest.mock import MagicMock

import pytest
import torch

import lp_testing

H, V, LENGTHS = 32, 98, (5, 7)
OUT_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
_FUSED = "verl.models.mcore.model_forward_fused"


@dataclass(frozen=True)
class Case:
    sp: bool
    tied: bool
    temperature: float

    @property
    def name(self) -> str:
        return f"sp{int(self.sp)}-tied{int(self.tied)}-T{self.temperature}"


CASES = {  # per TP size
    1: [Case(False, False, 1.0), Case(False, True, 0.7)],
    2: [Case(False, False, 0.7), Case(True, True, 1.0), Case(True, False, 0.7)],
}


def _import_verl():
    """verl's fused-forward module with Ray stubbed while verl imports (skips without verl)."""
    inserted = "ray" not in sys.modules
    if inserted:
        stub = MagicMock()
        stub.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        sys.modules["ray"] = stub
    try:
        return lp_testing.import_trainer(_FUSED)
    finally:
        if inserted:
            del sys.modules["ray"]


def _build(case: Case, tp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.input_layernorm = IdentityOp  # no self-attention: see the docstring
    spec.submodules.self_attention = IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=case.sp, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    return GPTModel(
        config, spec, vocab_size=V, max_sequence_length=16, position_embedding_type="rope",
        share_embeddings_and_output_weights=case.tied,
    )  # fmt: skip


def _kernel_stand_in(sum_hidden_grad: bool):
    """verl's ``linear_cross_entropy`` contract in torch (see the module docstring)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    def linear_cross_entropy(hidden, weight, labels, temperature, reduction, group):
        assert reduction == "none" and isinstance(temperature, float)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if sum_hidden_grad:
            hidden = copy_to_tensor_model_parallel_region(hidden)
        logits = gather_from_tensor_model_parallel_region(hidden @ weight.t()) / temperature
        lsm = torch.log_softmax(logits, dim=-1)
        logprobs = lsm.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
        return logprobs, -(lsm.exp() * lsm).sum(-1)

    return linear_cross_entropy


def _step(fused, model, case: Case, ids, weights) -> dict:
    """verl's engine fused forward, a weighted loss of both outputs, and every gradient."""
    forward = fused.fused_forward_model_engine(False)
    out = forward(model, ids, ids, {}, case.temperature, True, 0)
    logprob = torch.cat(out["log_probs"].unbind())
    entropy = torch.cat(out["entropy"].unbind())
    ((weights[0] * logprob).sum() + (weights[1] * entropy).sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        p.grad = None
    return {"logprob": logprob.detach(), "entropy": entropy.detach(), "grads": grads}


def _case(fused, case: Case, tp: int) -> dict:
    from lp_megatron.verl import LpOutputProcessor, remove_lp, use_lp

    model = _build(case, tp)
    fused.patch_fused_forward(model)  # what the engine does; the hook mode needs no patch
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    weights = torch.randn(2, sum(LENGTHS), generator=g)
    stock_kernel = fused.linear_cross_entropy
    try:
        fused.linear_cross_entropy = _kernel_stand_in(sum_hidden_grad=False)
        res = {"stock": _step(fused, model, case, ids, weights)}
        fused.linear_cross_entropy = _kernel_stand_in(sum_hidden_grad=True)
        res["summed"] = _step(fused, model, case, ids, weights)
        handle = use_lp(backend="torch")
        assert isinstance(fused.fused_output_processor, LpOutputProcessor)
        assert use_lp(backend="torch") is handle
        with pytest.raises(ValueError, match="remove_lp first"):
            use_lp(backend="torch", deterministic=True)
        res["lp"] = _step(fused, model, case, ids, weights)
        remove_lp()
        res["restored"] = fused.fused_output_processor is handle.stock
    finally:
        fused.linear_cross_entropy = stock_kernel
        remove_lp()
    return res


def _rank(rank: int, world_size: int) -> dict:
    fused = _import_verl()
    with lp_testing.MegatronCpuPatches():
        return {case.name: _case(fused, case, world_size) for case in CASES[world_size]}


def _check(results: list[dict], cases: list[Case], tp: int) -> None:
    for rank, per_rank in enumerate(results):
        for case in cases:
            r, where = per_rank[case.name], f"tp{tp} rank {rank} {case.name}"
            for field in ("logprob", "entropy"):
                got, want = r["lp"][field], r["stock"][field]
                assert got.shape == want.shape == (sum(LENGTHS),), where
                torch.testing.assert_close(got, want, **OUT_TOL, msg=f"{where} {field}")
            assert r["restored"], f"{where}: remove_lp left lp in verl's module"
            # verl's stock hidden gradient is one shard's part at TP > 1 without SP
            ref = r["summed"] if tp > 1 and not case.sp else r["stock"]
            if ref is r["summed"]:  # the two gradients differ there (not a vacuous swap)
                name = "embedding.word_embeddings.weight"
                assert not torch.equal(ref["grads"][name], r["stock"]["grads"][name]), where
            assert r["lp"]["grads"].keys() == ref["grads"].keys()
            for name, want in ref["grads"].items():
                assert want.abs().sum() > 0, f"{where} {name}: zero grad"
                got = r["lp"]["grads"][name]
                torch.testing.assert_close(got, want, **GRAD_TOL, msg=f"{where} {name}")


@pytest.fixture(scope="module")
def fused():
    module = _import_verl()  # skips when verl is not installed
    lp_testing.set_forkserver_preload(
        ["megatron.core", "megatron.core.models.gpt.gpt_model", "lp_kernels"]
    )
    return module


def test_verl_megatron_fused_forward_matches_stock_tp1(fused) -> None:
    _check(lp_testing.run_ranks(_rank, 1, timeout=240), CASES[1], 1)


def test_verl_megatron_fused_forward_matches_stock_tp2(fused) -> None:
    results = lp_testing.run_ranks(_rank, 2, timeout=240)
    _check(results, CASES[2], 2)
    for case in CASES[2]:  # the same log-probs and entropy on both ranks
        for field in ("logprob", "entropy"):
            a, b = (results[rank][case.name]["lp"][field] for rank in (0, 1))
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_use_lp_version_guard(fused, monkeypatch: pytest.MonkeyPatch) -> None:
    import lp_megatron.verl as adapter

    monkeypatch.setattr(adapter, "verl_version", lambda: "0.10.0")
    with pytest.raises(RuntimeError, match=r"supports verl 0\.9\.x.*found verl 0\.10\.0"):
        adapter.use_lp()
    assert not isinstance(fused.fused_output_processor, adapter.LpOutputProcessor)
