"""``lp_megatron.output_processor`` on CPU with the real megatron-core over gloo.

Parity: a tiny GPTModel (2 layers, h 32, 4 heads, padded vocab 98, s 8, b 2, fp32) at
TP 1 and 2, sequence parallel on/off at TP 2, tied and untied embeddings, a real vocabulary
smaller than the padded one, temperature != 1, an ignored label and a loss mask, labels
through the model's ``labels=`` or the context, MuP's output multiplier. The stock path is
the model's own logits -> all-gather over TP -> fp64 log_softmax -> gather; the processor
path is ``model(..., output_processor=output_processor)``. Log-probs, entropy, lse and the
gradient of every model parameter after ``backward`` of a weighted per-token sum must
match; the processor gives the head's bits (``install_logprob_head``) on the same model.

Also: the fallback (an overridden ``_scale_logits``), a bf16 ``Float16Module`` smoke test,
and the errors. All cases of one TP degree run inside one rank launch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import pytest
import torch

import lp_testing
from lp_megatron import LogprobHeadConfig, OutputContext

S, B, H, HEADS, V_PADDED = 8, 2, 32, 4, 98
RTOL, ATOL = 1e-4, 1e-5  # fp32 model against an fp64 softmax of its fp32 logits


@dataclass(frozen=True)
class Case:
    """One model / context configuration of the parity test."""

    sp: bool
    tied: bool
    temperature: float = 1.0
    vocab_size: int | None = None  # the real vocabulary (< V_PADDED: padded rows)
    extras: bool = False  # entropy and lse in the loss, and a loss mask
    via_context: bool = False  # labels in OutputContext instead of the model's labels=
    mup: float | None = None  # MuP's mup_output_mult

    @property
    def name(self) -> str:
        s = f"sp{int(self.sp)}-tied{int(self.tied)}-T{self.temperature}-V{self.vocab_size}"
        s += "-ent-lse-mask" if self.extras else ""
        s += "-ctx" if self.via_context else ""
        return s + (f"-mup{self.mup}" if self.mup else "")


@dataclass(frozen=True)
class Run:
    """Where the cases of one rank launch run: TP degree, device and lp backend."""

    tp: int
    device: str = "cpu"
    backend: str = "torch"


def _cases(tp: int) -> list[Case]:
    sps = [False, True] if tp > 1 else [False]
    cases = [Case(sp, tied) for sp in sps for tied in (False, True)]
    cases.append(Case(tp > 1, True, temperature=0.7, vocab_size=93, extras=True))
    cases.append(Case(tp > 1, False, temperature=1.3, vocab_size=93, extras=True, via_context=True))
    cases.append(Case(False, False, temperature=0.7, extras=True, mup=0.5))
    return cases


def _build(run: Run, case: Case, seed: int = 1234, **cfg_kwargs):
    """A tiny GPTModel on ``run.device``, fresh parallel state; call inside
    MegatronCpuPatches."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=run.tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if case.mup:
        cfg_kwargs.update(use_mup=True, mup_output_mult=case.mup)
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, use_cpu_initialization=True,
        tensor_model_parallel_size=run.tp, sequence_parallel=case.sp, hidden_dropout=0.0,
        attention_dropout=0.0, **{"params_dtype": torch.float32, **cfg_kwargs},
    )  # fmt: skip
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=V_PADDED, max_sequence_length=S,
        share_embeddings_and_output_weights=case.tied,
    ).to(run.device)  # fmt: skip


def _inputs(vocab: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[0, 3] = -100  # an ignored token
    loss_mask = torch.ones(B, S)
    loss_mask[1, 5] = 0.0  # a masked token
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)  # True = masked
    weights = torch.randn(3, B, S, generator=g)
    return tuple(t.to(device) for t in (ids, pos, mask, labels, loss_mask, weights))


def _reference(logits, labels, loss_mask, case: Case):
    """Stock path: logits [b, s, V/P] -> all-gather -> fp64 log_softmax over the real
    vocabulary -> gather; ignored and (extras) masked tokens are 0."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits).double() / case.temperature
    full = full[..., : case.vocab_size or V_PADDED]
    lsm = torch.log_softmax(full, dim=-1)
    keep = (labels != -100) & ((loss_mask != 0) if case.extras else True)
    logprob = lsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    entropy = -(lsm.exp() * lsm).sum(-1) * keep
    lse = torch.logsumexp(full, dim=-1) * keep
    return [t.float() for t in (logprob, entropy, lse)]


def _loss(outputs, weights):
    return sum((w * t).sum() for w, t in zip(weights, outputs, strict=False) if t is not None)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        p.grad = None
    return out


def _processor_call(model, case: Case, inputs, backend: str = "torch"):
    """``model(...)`` through the hook, labels via the model or the context."""
    from lp_megatron import output_processor

    ids, pos, mask, labels, loss_mask, _ = inputs
    config = LogprobHeadConfig(
        temperature=case.temperature, vocab_size=case.vocab_size, backend=backend,
        chunk_size=16 if case.extras else None,  # several chunks: b * s = 16
    )  # fmt: skip
    ctx = OutputContext(
        labels=labels if case.via_context else None,
        return_entropy=case.extras,
        return_lse=case.extras,
        config=config,
    )
    return model(
        ids, pos, mask, labels=None if case.via_context else labels,
        loss_mask=loss_mask if case.extras else None,
        output_processor=output_processor, output_processor_context=ctx,
    )  # fmt: skip


def _parity_case(run: Run, case: Case) -> dict:
    from lp_megatron import install_logprob_head

    model = _build(run, case)
    inputs = _inputs(case.vocab_size or V_PADDED, run.device)
    ids, pos, mask, labels, loss_mask, weights = inputs
    n = 3 if case.extras else 1
    ref = _reference(model(ids, pos, mask), labels, loss_mask, case)[:n]
    _loss(ref, weights).backward()
    ref_grads = _grads(model)
    out = _processor_call(model, case, inputs, run.backend)
    assert type(out).__name__ == "LogProbOutput"
    _loss(out, weights).backward()
    lp_grads = _grads(model)
    res = {
        "ref": [t.detach() for t in ref],
        "lp": [t.detach() for t in out if t is not None],
        "ref_grads": ref_grads,
        "lp_grads": lp_grads,
    }
    if not case.extras:  # the head on the same model: the same arithmetic, the same bits
        with install_logprob_head(model, LogprobHeadConfig(backend=run.backend)) as head:
            res["head"] = head.logprobs(model(ids, pos, mask), labels).logprob.detach()
    return res


def _fallback_case(run: Run) -> dict:
    """An overridden ``_scale_logits``: one warning, the stock logits, the right values."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    class ScaledGPT(GPTModel):
        def _scale_logits(self, logits):
            return logits * 0.5

    case = Case(run.tp > 1, False)
    model = _build(run, case)
    model.__class__ = ScaledGPT
    inputs = _inputs(V_PADDED, run.device)
    ids, pos, mask, labels, loss_mask, _ = inputs
    ref = _reference(model(ids, pos, mask), labels, loss_mask, case)[:1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _processor_call(model, case, inputs, run.backend)
    assert len([w for w in caught if "stock output layer" in str(w.message)]) == 1
    with pytest.raises(ValueError, match="allow_fallback"):
        model(
            ids, pos, mask, labels=labels, output_processor=_processor(),
            output_processor_context=OutputContext(config=LogprobHeadConfig(allow_fallback=False)),
        )  # fmt: skip
    return {"ref": ref[0].detach(), "lp": out.logprob.detach()}


def _processor():
    from lp_megatron import output_processor

    return output_processor


def _error_cases(run: Run) -> None:
    """Bad input through the hook raises the same error on every rank."""
    case = Case(run.tp > 1, False)
    model = _build(run, case)
    ids, pos, mask, labels, loss_mask, _ = _inputs(V_PADDED, run.device)

    def call(ctx=None, **kwargs):
        kwargs.setdefault("labels", labels)
        return model(
            ids, pos, mask, output_processor=_processor(), output_processor_context=ctx, **kwargs
        )

    assert call().logprob.shape == (B, S)  # context None: OutputContext()
    with pytest.raises(TypeError, match="output_processor_context"):
        call({"temperature": 0.7})
    with pytest.raises(ValueError, match="needs labels"):
        call(labels=None)
    with pytest.raises(ValueError, match="pass them once"):
        call(OutputContext(labels=labels.clone()))
    assert call(OutputContext(labels=labels)).logprob.shape == (B, S)  # the same tensor: fine
    with pytest.raises(ValueError, match=r"labels must be \[b, s\]"):
        call(labels=labels.t().contiguous())
    with pytest.raises(TypeError, match="labels must be an int64"):
        call(labels=labels.float())
    with pytest.raises(ValueError, match="loss_mask"):
        call(loss_mask=loss_mask[:, :-1])
    call(OutputContext(apply_loss_mask=False), loss_mask=loss_mask[:, :-1])  # not looked at
    with pytest.raises(ValueError, match="vocab_size"):
        call(OutputContext(config=LogprobHeadConfig(vocab_size=V_PADDED + 1)))


def _bf16_case(run: Run) -> dict:
    """Megatron's Float16Module (bf16, fp32_output): the result arrives as a plain tuple."""
    from megatron.core.transformer.module import Float16Module

    case = Case(run.tp > 1, True)
    inner = _build(run, case, bf16=True)
    model = Float16Module(inner.config, inner)
    inputs = _inputs(V_PADDED, run.device)
    ids, pos, mask, labels, loss_mask, _ = inputs
    ref = _reference(model(ids, pos, mask), labels, loss_mask, case)[0]
    out = _processor_call(model, case, inputs, run.backend)
    assert type(out) is tuple and out[0].dtype == torch.float32 and out[1] is None
    return {"ref": ref.detach(), "lp": out[0].detach()}


def _rank(rank: int, world_size: int, device: str = "cpu", backend: str = "torch") -> dict:
    """Every case of one TP degree; on ``device="cuda"`` each rank uses GPU ``rank`` (NCCL)."""
    run = Run(world_size, device, backend)
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    results: dict = {}
    with lp_testing.MegatronCpuPatches(cpu=not on_gpu):
        for case in _cases(world_size):
            results[case.name] = _parity_case(run, case)
        results["fallback"] = _fallback_case(run)
        results["bf16"] = _bf16_case(run)
        _error_cases(run)
    return results


@pytest.fixture(scope="module", autouse=True)
def _preload():
    lp_testing.set_forkserver_preload(
        ["megatron.core", "megatron.core.models.gpt.gpt_model", "lp_kernels", "lp_megatron.head"]
    )


def _check_case(r: dict, where: str, head_bitwise: bool) -> None:
    assert len(r["lp"]) == len(r["ref"]), where
    for field, a, b in zip(("logprob", "entropy", "lse"), r["lp"], r["ref"], strict=False):
        assert a.shape == (B, S), where
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{where} {field}")
    assert r["lp"][0][0, 3] == 0, f"{where}: the ignored label"
    assert r["lp_grads"].keys() == r["ref_grads"].keys()
    for pname, g_ref in r["ref_grads"].items():
        assert g_ref.abs().sum() > 0, f"{where} {pname}: zero grad"
        torch.testing.assert_close(
            r["lp_grads"][pname], g_ref, rtol=RTOL, atol=ATOL,
            msg=lambda m, w=where, p=pname: f"{w} {p}: {m}",
        )  # fmt: skip
    if "head" in r and head_bitwise:  # the head's rows are [b, s], the processor's [s, b]
        lp_testing.assert_bitwise_equal(r["lp"][0], r["head"], f"{where}: head vs processor")
    elif "head" in r:  # the torch backend on CUDA is not batch-invariant (cuBLAS)
        torch.testing.assert_close(r["lp"][0], r["head"], rtol=RTOL, atol=ATOL, msg=where)


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_output_processor_parity_with_stock_logits(tp: int) -> None:
    """Log-probs, entropy, lse and every parameter gradient match the stock path (fp32);
    the fallback and Float16Module cases match; bad input raises on every rank."""
    _check(lp_testing.run_ranks(_rank, tp, timeout=240), tp, head_bitwise=True)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_processor_parity_nccl(backend: str) -> None:
    """The same cases at TP 2 on 2 GPUs over NCCL, with each lp backend."""
    results = lp_testing.run_ranks(_rank, 2, "cuda", backend, backend="nccl", timeout=300)
    _check(results, 2, head_bitwise=backend == "triton")


def _check(results: list, tp: int, head_bitwise: bool) -> None:
    for rank, per_rank in enumerate(results):
        for case in _cases(tp):
            _check_case(per_rank[case.name], f"tp{tp} rank {rank} {case.name}", head_bitwise)
        fb = per_rank["fallback"]
        torch.testing.assert_close(fb["lp"], fb["ref"], rtol=RTOL, atol=ATOL)
        # bf16 logits in the stock path, fp32 in lp's: bf16 rounding apart (see the head's test)
        bf16 = per_rank["bf16"]
        torch.testing.assert_close(bf16["lp"], bf16["ref"], rtol=0, atol=5e-3)
    if tp == 2:  # every rank returns the same log-probs
        for name in results[0]:
            if name not in ("fallback", "bf16"):
                torch.testing.assert_close(results[0][name]["lp"], results[1][name]["lp"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"labels": [[1, 2]]}, TypeError, "labels must be"),
        ({"labels": torch.zeros(2, 3)}, ValueError, r"int64"),
        ({"labels": torch.zeros(6, dtype=torch.long)}, ValueError, r"\[b, s\]"),
        ({"return_entropy": 1}, TypeError, "return_entropy"),
        ({"return_lse": "yes"}, TypeError, "return_lse"),
        ({"apply_loss_mask": None}, TypeError, "apply_loss_mask"),
        ({"config": {"temperature": 0.7}}, TypeError, "LogprobHeadConfig"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_output_context_validation(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        OutputContext(**kwargs)


def test_output_context_defaults_frozen_and_comparable() -> None:
    ctx = OutputContext()
    assert ctx.labels is None and not ctx.return_entropy and ctx.apply_loss_mask
    assert ctx.config == LogprobHeadConfig()
    with pytest.raises(AttributeError):
        ctx.return_entropy = True  # type: ignore[misc]
    labels = torch.zeros(2, 3, dtype=torch.long)
    # labels do not take part in ==: a context with tensors still compares and hashes
    assert replace(ctx, labels=labels) == ctx and hash(replace(ctx, labels=labels)) == hash(ctx)
