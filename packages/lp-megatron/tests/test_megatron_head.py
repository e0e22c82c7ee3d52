"""lp-megatron on CPU with the real megatron-core over gloo.

Parity: a tiny GPTModel (2 layers, h 32, 4 heads, padded vocab 98, s 8, b 2, fp32) at
TP 1 and 2, sequence parallel on/off, tied and untied embeddings. The stock path is the
model's own logits -> all-gather over TP (Megatron's
``gather_from_tensor_model_parallel_region``, backward = take this rank's slice) ->
fp32 log_softmax -> gather. Log-probs (and entropy / lse where asked) and the gradient
of every model parameter after ``backward`` of a weighted per-token sum must match.

deterministic=True: against the stock path, and bitwise across TP 1 and 2 with the
default tile on shards that cut its tiles (one fixed hidden state).

All configurations of one TP degree run inside one rank launch (the forkserver has
megatron.core preloaded), so the module costs a few rank starts, not one per case.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

import lp_testing
from lp_megatron import LogprobHeadConfig

S, B, H, HEADS, V_PADDED = 8, 2, 32, 4, 98
RTOL, ATOL = 1e-4, 1e-5  # fp32; observed differences are ~1e-7


@dataclass(frozen=True)
class Case:
    """One model / head configuration of the parity test."""

    sp: bool
    tied: bool
    temperature: float = 1.0
    vocab_size: int | None = None
    extras: bool = False  # also return entropy and lse and put them in the loss
    bias: bool = False  # the output layer gets a (random) bias

    @property
    def name(self) -> str:
        s = f"sp{int(self.sp)}-tied{int(self.tied)}"
        if self.extras:
            s += f"-T{self.temperature}-V{self.vocab_size}-ent-lse"
        if self.bias:
            s += "-bias"
        return s


def _cases(tp: int) -> list[Case]:
    cases = [Case(sp, tied) for sp in ([False, True] if tp > 1 else [False]) for tied in (0, 1)]
    cases = [Case(bool(c.sp), bool(c.tied)) for c in cases]
    cases.append(Case(sp=tp > 1, tied=True, temperature=0.7, vocab_size=97, extras=True))
    cases.append(Case(sp=False, tied=False, temperature=0.7, extras=True, bias=True))
    return cases


def _build(tp: int, sp: bool, tied: bool, seed: int = 1234, vocab: int = V_PADDED, **cfg_kwargs):
    """A tiny GPTModel, fresh parallel state; call inside MegatronCpuPatches."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **{"params_dtype": torch.float32, **cfg_kwargs},
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=S,
        share_embeddings_and_output_weights=tied,
    )


def _add_output_bias(model, seed: int = 7) -> None:
    """Give the output layer a bias (GPTModel builds it without): each TP rank its shard of
    one random ``[V]`` vector, as ``ColumnParallelLinear(bias=True)`` holds it."""
    from megatron.core import parallel_state

    layer = model.output_layer
    v_local = layer.weight.shape[0]
    full = torch.randn(
        v_local * layer.tp_group.size(), generator=torch.Generator().manual_seed(seed)
    )
    rank = parallel_state.get_tensor_model_parallel_rank()
    layer.bias = torch.nn.Parameter(full[rank * v_local : (rank + 1) * v_local].clone())


def _inputs(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[0, 3] = -100  # an ignored token
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)  # True = masked
    weights = torch.randn(3, B, S, generator=g)
    return ids, pos, mask, labels, weights


def _reference(logits: torch.Tensor, labels: torch.Tensor, case: Case):
    """Stock path: vocab-parallel logits [b, s, V/P] -> full fp32 log_softmax -> gather."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits).float() / case.temperature
    if case.vocab_size is not None:
        full = full[..., : case.vocab_size]
    lsm = torch.log_softmax(full, dim=-1)
    keep = labels != -100
    logprob = lsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    entropy = -(lsm.exp() * lsm).sum(-1) * keep
    lse = torch.logsumexp(full, dim=-1) * keep
    return logprob, entropy, lse


def _loss(logprob, entropy, lse, weights):
    loss = (weights[0] * logprob).sum()
    if entropy is not None:
        loss = loss + (weights[1] * entropy).sum() + (weights[2] * lse).sum()
    return loss


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        p.grad = None
    return out


def _parity_rank(rank: int, world_size: int, device: str = "cpu", backend: str = "torch") -> dict:
    """All cases of one TP degree; on ``device="cuda"`` each rank uses GPU ``rank`` (NCCL)."""
    from lp_megatron import install_logprob_head

    results = {}
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    with lp_testing.MegatronCpuPatches(cpu=not on_gpu):
        for case in _cases(world_size):
            model = _build(world_size, case.sp, case.tied)
            if case.bias:
                _add_output_bias(model)
            model = model.to(device)
            ids, pos, mask, labels, weights = (
                t.to(device) for t in _inputs(case.vocab_size or V_PADDED)
            )

            logits = model(ids, pos, mask)
            ref = _reference(logits, labels, case)
            _loss(*(ref if case.extras else (ref[0], None, None)), weights).backward()
            ref_grads = _grads(model)

            config = LogprobHeadConfig(
                temperature=case.temperature,
                vocab_size=case.vocab_size,
                backend=backend,
                chunk_size=16 if case.extras else None,  # several chunks: b * s = 16
            )
            with install_logprob_head(model, config) as head:
                assert head.fused  # no fallback (a bias included)
                hidden = model(ids, pos, mask)
                assert hidden.shape == (B, S, H), hidden.shape
                out = head.logprobs(
                    hidden, labels, return_entropy=case.extras, return_lse=case.extras
                )
                _loss(*out, weights).backward()
            lp_grads = _grads(model)
            assert type(model.output_layer).__name__ == "ColumnParallelLinear"
            if case.bias:
                assert "output_layer.bias" in ref_grads
                assert ref_grads["output_layer.bias"].abs().sum() > 0
            results[case.name] = {
                "ref": [t.detach() for t in (ref if case.extras else ref[:1])],
                "lp": [t.detach() for t in out if t is not None],
                "ref_grads": ref_grads,
                "lp_grads": lp_grads,
            }
    return results


@pytest.fixture(scope="module", autouse=True)
def _preload():
    lp_testing.set_forkserver_preload(
        ["megatron.core", "megatron.core.models.gpt.gpt_model", "lp_kernels", "lp_megatron.head"]
    )


def _check_parity(results: list, tp: int) -> None:
    for rank, per_rank in enumerate(results):
        assert set(per_rank) == {c.name for c in _cases(tp)}
        for name, r in per_rank.items():
            where = f"tp{tp} rank {rank} {name}"
            assert len(r["lp"]) == len(r["ref"]), where
            for field, a, b in zip(("logprob", "entropy", "lse"), r["lp"], r["ref"], strict=False):
                assert a.shape == (B, S), where
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{where} {field}")
            assert r["lp_grads"].keys() == r["ref_grads"].keys()
            for pname, g_ref in r["ref_grads"].items():
                g = r["lp_grads"][pname]
                assert g_ref.abs().sum() > 0 or "bias" in pname, f"{where} {pname}: zero grad"
                torch.testing.assert_close(
                    g, g_ref, rtol=RTOL, atol=ATOL, msg=lambda m, w=where, p=pname: f"{w} {p}: {m}"
                )
    if tp == 2:  # every rank returns the same log-probs
        for name in results[0]:
            torch.testing.assert_close(results[0][name]["lp"], results[1][name]["lp"])


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_parity_with_stock_logits(tp: int) -> None:
    """Log-probs and every parameter gradient match the stock path (fp32)."""
    _check_parity(lp_testing.run_ranks(_parity_rank, tp, timeout=240), tp)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_parity_with_stock_logits_nccl(backend: str) -> None:
    """The same cases on 2 GPUs over NCCL (fp32), with each lp backend."""
    results = lp_testing.run_ranks(_parity_rank, 2, "cuda", backend, backend="nccl", timeout=300)
    _check_parity(results, 2)


class _ScaledGPT:
    """Marker: built in the rank as a GPTModel subclass overriding ``_scale_logits``."""


def _behaviour_rank(rank: int, world_size: int) -> dict:
    from megatron.core.models.gpt.gpt_model import GPTModel

    from lp_megatron import LogprobHead, install_logprob_head

    seen: dict = {}
    with lp_testing.MegatronCpuPatches():
        model = _build(world_size, False, False)
        stock_layer = model.output_layer
        keys = list(model.state_dict())
        params = [id(p) for p in model.parameters()]
        ids, pos, mask, labels, _ = _inputs(V_PADDED)
        logits = model(ids, pos, mask)

        # Idempotent install, same head; different config refused.
        head = install_logprob_head(model)
        assert isinstance(head, LogprobHead) and head.fused and head.installed
        assert install_logprob_head(model) is head
        assert install_logprob_head([model]) is head  # list of chunks
        with pytest.raises(ValueError, match="different config"):
            install_logprob_head(model, LogprobHeadConfig(temperature=2.0))
        # Parameters and checkpoint keys are unchanged while installed.
        assert list(model.state_dict()) == keys
        assert [id(p) for p in model.parameters()] == params
        assert model.output_layer.weight is stock_layer.weight
        with pytest.raises(RuntimeError, match="labels=None"):
            model(ids, pos, mask, labels=labels)
        hidden = model(ids, pos, mask)
        assert hidden.shape == (B, S, H)
        seen["logprob"] = head.logprobs(hidden, labels).logprob.detach()

        # remove() restores the stock layer and the logits; idempotent.
        head.remove()
        head.remove()
        assert model.output_layer is stock_layer
        torch.testing.assert_close(model(ids, pos, mask), logits)
        with pytest.raises(RuntimeError, match="removed"):
            head.logprobs(hidden, labels)

        # Context manager; a wrapper with .module (as DDP / Float16Module).
        wrapper = torch.nn.Module()
        wrapper.module = model
        with install_logprob_head([wrapper]) as head2:
            assert head2 is not head and model.output_layer is not stock_layer
            assert model(ids, pos, mask).shape == (B, S, H)
        assert model.output_layer is stock_layer

        # A model whose logits are post-processed: one warning, stock layer kept, and
        # head.logprobs computes from the logits.
        class ScaledGPT(GPTModel):
            def _scale_logits(self, logits):
                return logits * 0.5

        scaled = _build(world_size, False, False)
        scaled.__class__ = ScaledGPT
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            head3 = install_logprob_head(scaled)
        assert len([w for w in caught if "stock output layer" in str(w.message)]) == 1
        assert not head3.fused and "_scale_logits" in head3.fallback_reason
        with pytest.raises(ValueError, match="allow_fallback"):
            head3.remove()
            install_logprob_head(scaled, LogprobHeadConfig(allow_fallback=False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            head3 = install_logprob_head(scaled)
        out_logits = scaled(ids, pos, mask)
        assert out_logits.shape[-1] == V_PADDED // world_size
        seen["fallback"] = head3.logprobs(out_logits, labels).logprob.detach()
        seen["fallback_ref"] = _reference(out_logits, labels, Case(False, False))[0].detach()
        # runtime_gather_output=True: full logits on every rank, no TP group needed.
        full = scaled(ids, pos, mask, runtime_gather_output=True)
        assert full.shape[-1] == V_PADDED
        seen["fallback_full"] = head3.logprobs(full, labels).logprob.detach()
        head3.remove()

        # A fresh head has no weight until the model has run forward.
        head4 = install_logprob_head(model, LogprobHeadConfig(temperature=2.0))
        with pytest.raises(RuntimeError, match="forward"):
            head4.logprobs(hidden, labels)
        head4.remove()

        # vocab_size larger than the output layer is refused.
        with pytest.raises(ValueError, match="exceeds"):
            install_logprob_head(model, LogprobHeadConfig(vocab_size=V_PADDED + 1))
        seen["ref"] = _reference(logits, labels, Case(False, False))[0].detach()
    return seen


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_install_remove_context_fallback(tp: int) -> None:
    """Idempotency, remove(), context manager, wrappers, labels guard, fallback warning."""
    for seen in lp_testing.run_ranks(_behaviour_rank, tp, timeout=240):
        torch.testing.assert_close(seen["logprob"], seen["ref"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(seen["fallback"], seen["fallback_ref"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(
            seen["fallback_full"], seen["fallback_ref"], rtol=RTOL, atol=ATOL
        )


def _other_stage_rank(rank: int, world_size: int) -> None:
    from lp_megatron import install_logprob_head

    with lp_testing.MegatronCpuPatches():
        model = _build(1, False, False)
        model.post_process = False  # as on a pipeline stage before the last
        head = install_logprob_head(model)
        assert not head.fused and head.model is None
        with pytest.raises(RuntimeError, match="last stage"):
            head.logprobs(torch.zeros(B, S, H), torch.zeros(B, S, dtype=torch.long))
        head.remove()


def test_non_last_pipeline_stage_is_inert() -> None:
    lp_testing.run_ranks(_other_stage_rank, 1, timeout=120)


def _pipeline_rank(
    rank: int, world_size: int, tp: int, device: str = "cpu", vp: int | None = None
) -> dict:
    """Megatron's own pipeline schedule (PP 2, two micro-batches), stock loss against the
    head's, on every stage; tied and untied. The head is fused on the last stage only.
    ``vp``: that many virtual stages per rank (the interleaved schedule; one layer each)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lp_megatron import install_logprob_head

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    results: dict = {}
    stages = list(range(vp)) if vp else [None]
    with lp_testing.MegatronCpuPatches(cpu=not on_gpu, comm=True):
        for tied in (False, True):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=vp,
            )  # fmt: skip
            torch.manual_seed(7)
            model_parallel_cuda_manual_seed(7)
            config = TransformerConfig(
                num_layers=2 * len(stages), hidden_size=H, num_attention_heads=HEADS,
                use_cpu_initialization=True, tensor_model_parallel_size=tp,
                sequence_parallel=tp > 1, pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=vp,
                pipeline_dtype=torch.float32, params_dtype=torch.float32,
                hidden_dropout=0.0, attention_dropout=0.0,
            )  # fmt: skip
            last = parallel_state.is_pipeline_last_stage()
            chunks = [
                GPTModel(
                    config, get_gpt_layer_local_spec(), vocab_size=V_PADDED,
                    max_sequence_length=S, share_embeddings_and_output_weights=tied,
                    pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage=i),
                    post_process=parallel_state.is_pipeline_last_stage(False, vp_stage=i),
                    **({} if i is None else {"vp_stage": i}),
                ).to(device)
                for i in stages
            ]  # fmt: skip
            batches = [tuple(t.to(device) for t in _inputs(V_PADDED, seed=mb)) for mb in range(2)]
            for mode in ("stock", "lp"):
                head = install_logprob_head(chunks) if mode == "lp" else None
                if head is not None:
                    assert head.fused == last

                def step(data, chunk, mode=mode, head=head):
                    ids, pos, mask, labels, weights = next(data)
                    out = chunk(ids, pos, mask)

                    def loss_func(output, labels=labels, weights=weights):
                        if mode == "stock":
                            logprob = _reference(output, labels, Case(tp > 1, True))[0]
                        else:
                            assert output.shape == (B, S, H), output.shape
                            logprob = head.logprobs(output, labels).logprob
                        loss = -(weights[0] * logprob).sum()
                        return loss, {"logprob": logprob.detach()}

                    return out, loss_func

                data = [iter(batches) for _ in chunks] if vp else iter(batches)
                stats = get_forward_backward_func()(
                    forward_step_func=step, data_iterator=data, model=chunks,
                    num_microbatches=2, seq_length=S, micro_batch_size=B, forward_only=False,
                )  # fmt: skip
                grads = {}
                for i, chunk in enumerate(chunks):
                    prefix = f"chunk{i}." if vp else ""
                    grads.update({prefix + n: g for n, g in _grads(chunk).items()})
                results[(tied, mode)] = {
                    "logprob": [d["logprob"] for d in stats],
                    "grads": grads,
                }
                if head is not None:
                    head.remove()
    return results


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_pipeline_parallel_schedule(tp: int) -> None:
    """PP 2 (x TP 2 with SP) through megatron's 1F1B schedule: the last stage's log-probs
    and every stage's parameter gradients match the stock path, tied and untied."""
    _check_pipeline(lp_testing.run_ranks(_pipeline_rank, 2 * tp, tp, timeout=300), tp)


@pytest.mark.multigpu
def test_pipeline_parallel_schedule_nccl() -> None:
    """The same on 2 GPUs over NCCL (PP 2)."""
    results = lp_testing.run_ranks(_pipeline_rank, 2, 1, "cuda", backend="nccl", timeout=300)
    _check_pipeline(results, 1)


def test_interleaved_pipeline_schedule() -> None:
    """PP 2 with two virtual stages per rank (megatron's interleaved schedule, model chunks
    as a list): the head finds the chunk with the output layer; log-probs and every
    chunk's gradients match the stock path."""
    results = lp_testing.run_ranks(_pipeline_rank, 2, 1, "cpu", 2, timeout=300)
    _check_pipeline(results, 1)


def _check_pipeline(results: list, tp: int) -> None:
    for rank, res in enumerate(results):
        last = rank >= tp  # ranks [0, tp) are stage 0, [tp, 2 tp) stage 1
        for tied in (False, True):
            stock, lp = res[(tied, "stock")], res[(tied, "lp")]
            where = f"pp2 tp{tp} rank {rank} tied={tied}"
            assert len(lp["logprob"]) == len(stock["logprob"]) == (2 if last else 0), where
            for a, b in zip(lp["logprob"], stock["logprob"], strict=True):
                assert a.shape == (B, S), where
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=where)
            assert lp["grads"].keys() == stock["grads"].keys(), where
            # Under PP the last stage holds the output weight even when tied (a copy of the
            # first stage's embedding that Megatron keeps in sync).
            has_output = any(n.endswith("output_layer.weight") for n in stock["grads"])
            assert has_output == last, where
            for name, g_ref in stock["grads"].items():
                assert g_ref.abs().sum() > 0 or "bias" in name, f"{where} {name}: zero grad"
                torch.testing.assert_close(
                    lp["grads"][name], g_ref, rtol=RTOL, atol=ATOL, msg=f"{where} {name}"
                )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "cuda"}, "backend must be one of"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": 10, "ignore_index": 2**63}, "ignore_index"),
        ({"deterministic": 1}, "deterministic"),
        ({"deterministic_tile": 100}, "deterministic_tile"),
        ({"deterministic_tile": 256.0}, "deterministic_tile"),
        ({"validate": "yes"}, "validate"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()),
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LogprobHeadConfig(**kwargs)


def test_config_defaults_and_frozen() -> None:
    config = LogprobHeadConfig()
    assert config.backend == "auto" and config.temperature == 1.0 and config.vocab_size is None
    with pytest.raises(AttributeError):
        config.temperature = 2.0  # type: ignore[misc]


def _bf16_rank(rank: int, world_size: int, device: str = "cpu", backend: str = "torch") -> dict:
    from megatron.core.transformer.module import Float16Module

    from lp_megatron import install_logprob_head

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    with lp_testing.MegatronCpuPatches(cpu=not on_gpu):
        inner = _build(world_size, world_size > 1, True, bf16=True)
        model = Float16Module(inner.config, inner).to(device)  # bf16 params, fp32 output
        ids, pos, mask, labels, weights = (t.to(device) for t in _inputs(V_PADDED))
        ref = _reference(model(ids, pos, mask), labels, Case(False, True))[0]
        (weights[0] * ref).sum().backward()
        ref_grads = _grads(model)
        with install_logprob_head(model, LogprobHeadConfig(backend=backend)) as head:
            hidden = model(ids, pos, mask)
            assert hidden.dtype == torch.float32  # Float16Module upcasts; the head casts back
            out = head.logprobs(hidden, labels).logprob
            (weights[0] * out).sum().backward()
        return {
            "ref": ref.detach(),
            "lp": out.detach(),
            "ref_grads": ref_grads,
            "lp_grads": _grads(model),
        }


def test_bf16_float16module_smoke() -> None:
    """bf16 model wrapped in Megatron's Float16Module, TP 2 + SP, tied.

    The stock path rounds the logits to bf16, lp keeps them in fp32, so the two differ by
    bf16 rounding (observed: log-probs 6e-4, gradients <1% of their max). A gradient
    summed twice (or not at all) over TP would be off by ~100%.
    """
    _check_bf16(lp_testing.run_ranks(_bf16_rank, 2, timeout=240))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_float16module_nccl(backend: str) -> None:
    """The bf16 Float16Module case (TP 2 + SP, tied) on 2 GPUs over NCCL."""
    _check_bf16(lp_testing.run_ranks(_bf16_rank, 2, "cuda", backend, backend="nccl", timeout=300))


def _check_bf16(results: list) -> None:
    for r in results:
        torch.testing.assert_close(r["lp"], r["ref"], rtol=0, atol=5e-3)
        for name, g_ref in r["ref_grads"].items():
            g = r["lp_grads"][name].float()
            scale = g_ref.float().abs().max().clamp(min=1e-6)
            assert (g - g_ref.float()).abs().max() / scale < 3e-2, name


def _ddp_backward(tp: int, sp: bool, tied: bool, mode: str, inputs):
    """A fresh tiny GPTModel under megatron.core's DistributedDataParallel (main_grad
    buffers and hooks) after one backward of the weighted stock (``mode="stock"``) or lp
    log-probs of ``inputs``; call inside MegatronCpuPatches."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from lp_megatron import install_logprob_head

    inner = _build(tp, sp, tied)
    ddp = DistributedDataParallel(
        inner.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), inner
    )
    ids, pos, mask, labels, weights = inputs
    ddp.zero_grad_buffer()
    if mode == "stock":
        ref = _reference(ddp(ids, pos, mask), labels, Case(sp, tied))[0]
        (weights[0] * ref).sum().backward()
    else:
        with install_logprob_head(ddp, LogprobHeadConfig(backend="torch")) as head:
            lp = head.logprobs(ddp(ids, pos, mask), labels).logprob
            (weights[0] * lp).sum().backward()
    return ddp


def _main_grads(ddp) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


def _ddp_rank(rank: int, world_size: int) -> dict:
    """Megatron's own DistributedDataParallel (main_grad buffers and hooks), stock vs lp."""
    out: dict = {}
    with lp_testing.MegatronCpuPatches():
        for tied in (False, True):
            for mode in ("stock", "lp"):
                ddp = _ddp_backward(world_size, False, tied, mode, _inputs(V_PADDED))
                # DP = 1 here: the backward hooks have already accumulated every gradient
                # into main_grad (no finish_grad_sync needed).
                out[(tied, mode)] = _main_grads(ddp)
                params = ddp.module.named_parameters()
                out[(tied, mode, "grad")] = [n for n, p in params if p.grad is not None]
    return out


def _ddp_sync_rank(rank: int, world_size: int, tp: int) -> dict:
    """DP = world / tp with Megatron's DDP and its gradient sync (finish_grad_sync): each DP
    rank sees its own micro-batch; stock vs lp, after and before the sync."""
    from megatron.core import parallel_state

    out: dict = {}
    dp_rank = rank // tp  # megatron orders ranks TP-fastest (checked below)
    with lp_testing.MegatronCpuPatches(comm=True):
        for mode in ("stock", "lp"):
            inputs = _inputs(V_PADDED, seed=100 + dp_rank)
            ddp = _ddp_backward(tp, tp > 1, False, mode, inputs)
            assert parallel_state.get_data_parallel_rank() == dp_rank
            out[(mode, "local")] = _main_grads(ddp)
            ddp.finish_grad_sync()
            out[mode] = _main_grads(ddp)
        out["dp_rank"] = dp_rank
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_megatron_ddp_data_parallel_grad_sync(tp: int) -> None:
    """DP 2 (x TP 2): after DistributedDataParallel's gradient sync every main_grad equals
    the stock path's, is the same on both DP ranks, and differs from the rank's own
    pre-sync gradient (the DP ranks saw different micro-batches)."""
    results = lp_testing.run_ranks(_ddp_sync_rank, 2 * tp, tp, timeout=300)
    for rank, res in enumerate(results):
        where = f"tp{tp} rank {rank}"
        assert res["lp"].keys() == res["stock"].keys()
        for name, g_ref in res["stock"].items():
            torch.testing.assert_close(
                res["lp"][name], g_ref, rtol=RTOL, atol=ATOL, msg=f"{where} {name}"
            )
        assert any(
            not torch.allclose(res["lp"][n], res[("lp", "local")][n], rtol=1e-3, atol=1e-6)
            for n in res["lp"]
        ), f"{where}: the gradient sync changed nothing"
    # the two DP replicas of a TP rank (ranks r and r + tp) hold the same synced gradients
    for rank in range(tp):
        a, b = results[rank], results[rank + tp]
        assert a["dp_rank"] != b["dp_rank"]
        for name in a["lp"]:
            torch.testing.assert_close(a["lp"][name], b["lp"][name], rtol=0, atol=0, msg=name)


def test_megatron_ddp_main_grad() -> None:
    """Under megatron.core's DistributedDataParallel (TP 2, tied and untied), every
    parameter's main_grad equals the stock path's; no .grad is left behind."""
    for rank, res in enumerate(lp_testing.run_ranks(_ddp_rank, 2, timeout=300)):
        for tied in (False, True):
            stock, lp = res[(tied, "stock")], res[(tied, "lp")]
            assert lp.keys() == stock.keys()
            assert ("output_layer.weight" in lp) != tied
            assert res[(tied, "lp", "grad")] == [] == res[(tied, "stock", "grad")]
            for name, g_ref in stock.items():
                where = f"rank {rank} tied={tied} {name}"
                assert g_ref.abs().sum() > 0, f"{where}: zero main_grad"
                torch.testing.assert_close(lp[name], g_ref, rtol=RTOL, atol=ATOL, msg=where)


def _deterministic_rank(rank: int, world_size: int) -> dict:
    """deterministic=True through the head (vocabulary 256: shards of 128 at TP 2, so the
    widest tile is 256 at TP 1 and 128 at TP 2)."""
    from lp_megatron import install_logprob_head

    with lp_testing.MegatronCpuPatches():
        model = _build(world_size, world_size > 1, True, vocab=256)
        ids, pos, mask, labels, weights = _inputs(250)
        ref = _reference(model(ids, pos, mask), labels, Case(False, True, vocab_size=250))[0]
        (weights[0] * ref).sum().backward()
        ref_grads = _grads(model)
        config = LogprobHeadConfig(
            backend="torch", deterministic=True, deterministic_tile=256 // world_size,
            vocab_size=250,
        )  # fmt: skip
        with install_logprob_head(model, config) as head:
            out = head.logprobs(model(ids, pos, mask), labels).logprob
            (weights[0] * out).sum().backward()
        return {
            "ref": ref.detach(),
            "lp": out.detach(),
            "ref_grads": ref_grads,
            "lp_grads": _grads(model),
        }


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_deterministic_through_the_head(tp: int) -> None:
    """The head passes deterministic=True (with SP at TP 2); results match the stock path."""
    for r in lp_testing.run_ranks(_deterministic_rank, tp, timeout=240):
        torch.testing.assert_close(r["lp"], r["ref"], rtol=RTOL, atol=ATOL)
        for name, g_ref in r["ref_grads"].items():
            torch.testing.assert_close(r["lp_grads"][name], g_ref, rtol=RTOL, atol=ATOL, msg=name)


# A vocabulary whose default deterministic tile (512 = 4096 / 8 of the TP-8 padding)
# crosses Megatron's TP 2 shards (3328 padded / 2 = 1664 rows = 3.25 tiles): rank 0's last
# tile takes 384 rows of rank 1's shard (the halo).
V_HALO, V_HALO_PADDED = 3300, 3328


def _invariance_rank(rank: int, world_size: int, device: str = "cpu", backend: str = "torch"):
    """The head with deterministic=True and the default tile, on one fixed hidden state
    (the decoder's own output differs across TP in Megatron's arithmetic): without and
    with sequence parallel at TP > 1. On ``device="cuda"`` each rank uses GPU ``rank``."""
    from lp_kernels import default_deterministic_tile
    from lp_megatron import install_logprob_head

    assert V_HALO_PADDED // 2 % default_deterministic_tile(V_HALO)  # the shards cross tiles
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    results = {}
    with lp_testing.MegatronCpuPatches(cpu=not on_gpu):
        for sp in [False, True] if world_size > 1 else [False]:
            model = _build(world_size, sp, False, vocab=V_HALO_PADDED).to(device)
            ids, pos, mask, labels, weights = (t.to(device) for t in _inputs(V_HALO))
            g = torch.Generator().manual_seed(7)
            hidden = (torch.randn(B, S, H, generator=g) * 2).to(device).requires_grad_()
            config = LogprobHeadConfig(backend=backend, deterministic=True, vocab_size=V_HALO)
            with install_logprob_head(model, config) as head:
                model(ids, pos, mask)  # the layer's weight, as in a step
                out = head.logprobs(hidden, labels, return_entropy=True, return_lse=True)
                (
                    weights[0] * out.logprob + weights[1] * out.entropy + weights[2] * out.lse
                ).sum().backward()
            results[sp] = {
                "out": [x.detach().cpu() for x in out],
                "grad_hidden": hidden.grad.cpu(),
                "grad_weight": model.output_layer.weight.grad.detach().cpu(),
            }
    return results


def test_deterministic_head_bitwise_across_tp() -> None:
    """deterministic=True through the head with its default tile on Megatron's TP 2
    shards, which cut the tiles (halo rows travel between the ranks): log-probs, entropy,
    lse and the output layer's weight gradient are bitwise those of TP 1, on every rank,
    with and without sequence parallel; so is the hidden state's gradient without it.
    (With SP the head returns each rank's partial, summed by Megatron's reduce-scatter,
    whose bits are Megatron's.)"""
    one = lp_testing.run_ranks(_invariance_rank, 1, timeout=240)[0][False]
    two = lp_testing.run_ranks(_invariance_rank, 2, timeout=240)
    _check_invariance(one, two)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_deterministic_head_bitwise_across_tp_nccl(backend: str) -> None:
    """The same on GPUs, with either backend: TP 1 on one GPU, TP 2 over NCCL."""
    one = lp_testing.run_ranks(_invariance_rank, 1, "cuda", backend, backend="nccl", timeout=300)
    two = lp_testing.run_ranks(_invariance_rank, 2, "cuda", backend, backend="nccl", timeout=300)
    _check_invariance(one[0][False], two)


def _check_invariance(one: dict, two: list) -> None:
    for sp in (False, True):
        for rank, res in enumerate(two):
            got = res[sp]
            for name, a, b in zip(
                ("logprob", "entropy", "lse"), got["out"], one["out"], strict=True
            ):
                lp_testing.assert_bitwise_equal(a, b, f"{name} rank {rank} sp={sp}")
            if not sp:
                lp_testing.assert_bitwise_equal(
                    got["grad_hidden"], one["grad_hidden"], f"grad_hidden rank {rank}"
                )
        grad_w = torch.cat([res[sp]["grad_weight"] for res in two])
        lp_testing.assert_bitwise_equal(grad_w, one["grad_weight"], f"grad_weight sp={sp}")
