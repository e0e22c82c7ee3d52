"""`lp bench --mode loss`: a DAPO loss with a k3 KL penalty, forward + backward, for every
provider that runs on CPU; its reference, its rows and its report tables."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from lp_bench.cli import main
from lp_bench.protocol import ROW_KEYS, BenchConfig, run_bench

pytest.importorskip("lp_kernels.losses")

SHAPE = ("48x16x301", 48, 16, 301)
CPU_LOSS_PROVIDERS = ("lp-loss-torch", "lp-loss-torch-det", "lp-torch", "materialized")


def _problem(n: int, h: int, v: int, dtype: torch.dtype, *, entropy: bool = False):
    """Inputs and the loss mode's objective at one small shape (as the harness makes them)."""
    from lp_bench.protocol import SEQ_LEN, loss_per_token, make_inputs, policy_loss
    from lp_bench.providers import LossProblem
    from lp_testing.reference import reference_chunked

    hidden, weight, targets, _ = make_inputs(n, h, v, device="cpu", dtype=dtype)
    per_token = loss_per_token(reference_chunked(hidden, weight, targets)["logprob"])
    problem = LossProblem(policy_loss(entropy), per_token, min(SEQ_LEN, n), entropy=entropy)
    return hidden, weight, targets, problem


def _run_step(name: str, hidden, weight, targets, problem):
    """One loss step of provider ``name``: (loss, logprob, grad_hidden, grad_weight)."""
    from lp_bench.providers import make_provider

    prep = make_provider(name, mode="loss", loss=problem)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logprob, _, loss = prep.step(h, w, targets)
    return loss, logprob, h.grad, w.grad


def test_loss_rows_for_every_cpu_provider_against_the_reference():
    """One row per (entropy, provider) with the schema; lp's and the materialized path's
    loss and gradients within fp32 rounding of the fp64 reference; peers skipped."""
    from lp_bench.providers import PEERS

    # cce has no loss; liger and trl are skipped when not installed (else they would run)
    peers = [p for p in PEERS if p == "cce" or importlib.util.find_spec(PEERS[p]) is None]
    cfg = BenchConfig(
        shapes=(SHAPE,),
        providers=(*CPU_LOSS_PROVIDERS, *peers),
        dtypes=("fp32",),
        device="cpu",
        modes=("loss",),
        entropy=(False, True),
        reps=1,
        warmup=0,
    )
    rows = run_bench(cfg, env={"device": "cpu", "commit": "abc1234"})
    assert len(rows) == cfg.size == 2 * (4 + len(peers))
    by = {(r["entropy"], r["provider"]): r for r in rows}
    for (entropy, prov), r in by.items():
        assert list(r) == list(ROW_KEYS)
        assert r["mode"] == "loss" and r["floor_ms"] is None and r["floor_matmuls"] is None
        if prov in peers:
            assert r["skipped"] and r["ms"] is None, r
            continue
        assert r["error"] is None and r["skipped"] is None, r
        det = {"lp-loss-torch": False, "lp-loss-torch-det": True, "lp-torch": False}
        assert r["deterministic"] == det.get(prov), (prov, r["deterministic"])
        assert r["entropy_computed"] == entropy and (r["err_entropy"] is not None) == entropy
        assert r["ms"] > 0 and r["peak_bytes"] > 0
        for key in ("err_loss", "err_logprob", "err_grad_hidden", "err_grad_weight"):
            assert r[key] < 1e-5, (entropy, prov, key, r[key])
    assert "no RL loss" in by[(False, "cce")]["skipped"]
    if "liger" in peers:
        assert "not importable" in by[(False, "liger")]["skipped"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lp_loss_agrees_with_materialized_and_the_reference(dtype):
    """linear_logprob_loss's loss and gradients against the materialized path's (fp32:
    rounding apart; bf16: no further from the fp64 reference than the materialized path,
    whose bf16 logits perturb the loss's per-row derivatives)."""
    from lp_bench.protocol import BenchConfig, bench_reference, loss_reference

    hidden, weight, targets, problem = _problem(96, 32, 1009, dtype, entropy=True)
    cfg = BenchConfig(shapes=(SHAPE,), providers=("lp-torch",), dtypes=("fp32",), device="cpu")
    inputs = (hidden, weight, targets, None)
    ref = loss_reference(cfg, inputs, bench_reference(cfg, inputs), problem)
    fused = _run_step("lp-loss-torch", hidden, weight, targets, problem)
    mat = _run_step("materialized", hidden, weight, targets, problem)
    truth = (ref["loss"], ref["logprob"], ref["grad_hidden"], ref["grad_weight"])

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    names = ("loss", "logprob", "grad_h", "grad_w")
    for name, ours, theirs, exact in zip(names, fused, mat, truth, strict=True):
        assert ours.shape == theirs.shape == exact.shape, name
        if dtype == torch.float32:
            assert rel(ours, theirs) < 1e-5 and rel(ours, exact) < 1e-5, name
        else:
            assert rel(ours, exact) <= 2 * rel(theirs, exact) + 1e-5, (name, rel(ours, exact))


def test_loss_reference_is_autograd_through_fp64_logits():
    """The harness's reference (the loss's derivatives per row fed to the chunked reference)
    equals plain fp64 autograd through materialized logits."""
    from lp_bench.protocol import BenchConfig, bench_reference, loss_reference

    hidden, weight, targets, problem = _problem(40, 12, 211, torch.float32, entropy=True)
    cfg = BenchConfig(shapes=(SHAPE,), providers=("lp-torch",), dtypes=("fp32",), device="cpu")
    inputs = (hidden, weight, targets, None)
    ref = loss_reference(cfg, inputs, bench_reference(cfg, inputs), problem)
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = (h @ w.T).log_softmax(-1)
    logprob = logp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = problem.loss_fn(logprob, entropy, None, **problem.per_token).sum()
    loss.backward()
    torch.testing.assert_close(ref["loss"], loss.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(ref["grad_hidden"], h.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(ref["grad_weight"], w.grad, rtol=1e-10, atol=1e-14)


def test_loss_inputs_sequences_and_weights():
    """One advantage per 1024-token sequence, token-mean weights, old and reference
    log-probs near the model's, some ratios outside DAPO's clip bounds."""
    from lp_bench.protocol import LOSS_NOISE, SEQ_LEN, loss_per_token, policy_loss

    n = 2 * SEQ_LEN + 100
    logprob = -torch.rand(n, dtype=torch.float64) * 10
    per = loss_per_token(logprob, seed=3)
    assert {k: (v.shape, v.dtype) for k, v in per.items()} == dict.fromkeys(
        ("old_logprob", "ref_logprob", "advantages", "weights"), ((n,), torch.float32)
    )
    adv = per["advantages"]
    for start in (0, SEQ_LEN, 2 * SEQ_LEN):
        assert (adv[start : start + SEQ_LEN] == adv[start]).all()
    assert len(set(adv.tolist())) == 3
    torch.testing.assert_close(per["weights"], torch.full((n,), 1 / n))
    for key in ("old_logprob", "ref_logprob"):
        noise = per[key].double() - logprob
        assert 0.8 * LOSS_NOISE < float(noise.std()) < 1.2 * LOSS_NOISE
    ratio = (logprob - per["old_logprob"].double()).exp()
    outside = float(((ratio < 0.8) | (ratio > 1.28)).double().mean())
    assert 0.005 < outside < 0.05
    loss = policy_loss()
    assert (loss.clip_low, loss.clip_high, loss.kl_coef, loss.kl_estimator) == (
        0.2,
        0.28,
        0.04,
        "k3",
    )
    assert not loss.needs_entropy and policy_loss(entropy=True).needs_entropy


def test_loss_mode_providers_default_and_refusals():
    from lp_bench.providers import LossProblem, Unsupported, default_providers, make_provider

    assert default_providers("cpu", modes=("loss",)) == [
        "lp-loss-torch",
        "lp-loss-torch-det",
        "lp-torch",
        "materialized",
    ]
    assert default_providers("cpu") == ["lp-torch", "materialized"]  # train: as before
    with pytest.raises(Unsupported, match="loss mode only"):
        make_provider("lp-loss-torch", mode="train")
    with pytest.raises(ValueError, match="LossProblem"):
        make_provider("materialized", mode="loss")
    problem = LossProblem(lambda lp, ent, lse: -lp, {}, 4)
    prep = make_provider("lp-torch", mode="loss", loss=problem)
    assert prep.entropy is False


# ----------------------------------------------------------------------------- liger


def _fake_liger(monkeypatch) -> list[dict]:
    """A stand-in ``liger_kernel.chunked_loss`` whose ``LigerFusedLinearGRPOLoss`` has the
    real signature and computes its documented loss in plain torch (materialized logits);
    returns the keyword arguments of each constructor call."""
    made: list[dict] = []

    class LigerFusedLinearGRPOLoss(torch.nn.Module):
        def __init__(
            self,
            beta: float = 0.04,
            compiled: bool = True,
            use_ref_model: bool = True,
            chunk_size: int = 1,
            epsilon_low: float = 0.2,
            epsilon_high: float = 0.2,
            loss_type: str = "dapo",
            max_completion_length: int | None = None,
            importance_sampling_level: str = "token",
            temperature: float = 1.0,
        ):
            super().__init__()
            made.append(dict(beta=beta, eps=(epsilon_low, epsilon_high), loss_type=loss_type))
            self.beta, self.low, self.high = beta, epsilon_low, epsilon_high

        def forward(
            self,
            _input,
            lin_weight,
            selected_token_ids,
            attention_mask,
            advantages,
            bias=None,
            ref_per_token_logps=None,
            old_per_token_logps=None,
            ref_input=None,
            ref_weight=None,
            ref_bias=None,
        ):
            logits = (_input @ lin_weight.T).float()
            lp = logits.log_softmax(-1).gather(-1, selected_token_ids[..., None]).squeeze(-1)
            coef = (lp - old_per_token_logps).exp()
            adv = advantages[:, None]
            clipped = coef.clamp(1 - self.low, 1 + self.high)
            per_token = -torch.min(coef * adv, clipped * adv)
            d = ref_per_token_logps - lp
            per_token = per_token + self.beta * (d.exp() - d - 1)
            loss = (per_token * attention_mask).sum() / attention_mask.sum().clamp(min=1)
            return loss, ()

    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    chunked = types.ModuleType("liger_kernel.chunked_loss")
    chunked.LigerFusedLinearGRPOLoss = LigerFusedLinearGRPOLoss
    package.chunked_loss = chunked
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    return made


def test_liger_grpo_is_given_the_same_objective(monkeypatch):
    """liger's GRPO loss gets the loss's clip bounds and KL coefficient, [B, T] sequences
    with one advantage each and token-mean aggregation: on a stand-in with its signature and
    documented math, the same loss and gradients as lp's fused op."""
    from lp_bench.protocol import SEQ_LEN

    made = _fake_liger(monkeypatch)
    hidden, weight, targets, problem = _problem(2 * SEQ_LEN, 8, 97, torch.float32)
    loss, _, grad_h, grad_w = _run_step("lp-loss-torch", hidden, weight, targets, problem)
    peer = _run_step("liger", hidden, weight, targets, problem)
    assert made == [dict(beta=0.04, eps=(0.2, 0.28), loss_type="bnpo")]
    assert peer[1] is None  # no per-token output
    torch.testing.assert_close(peer[0], loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(peer[2], grad_h, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(peer[3], grad_w, rtol=1e-4, atol=1e-7)


def test_liger_grpo_refuses_what_it_cannot_express(monkeypatch):
    from lp_bench.providers import LossProblem, Unsupported, make_provider

    _fake_liger(monkeypatch)
    problem = _problem(48, 8, 97, torch.float32, entropy=True)[-1]
    with pytest.raises(Unsupported, match="no entropy bonus"):
        make_provider("liger", mode="loss", loss=problem)
    problem = _problem(48, 8, 97, torch.float32)[-1]
    odd = LossProblem(problem.loss_fn, problem.per_token, seq_len=7)
    with pytest.raises(Unsupported, match="not a multiple"):
        make_provider("liger", mode="loss", loss=odd)
    with pytest.raises(Unsupported, match="softcap"):
        make_provider("liger", mode="loss", loss=problem, softcap=30.0)
    with pytest.raises(Unsupported, match="no RL loss"):
        make_provider("cce", mode="loss", loss=problem)


# ----------------------------------------------------------------------------- cli, report


def test_bench_mode_loss_json_table_and_report(tmp_path, capsys):
    argv = ["bench", "--mode", "loss", "--shapes", "32x8x97", "--dtype", "fp32"]
    assert (
        main([*argv, "--reps", "1", "--warmup", "0", "--device", "cpu", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    table = out[out.index("run  ") :]
    assert "err loss" in table and "lp-loss-torch-det" in table
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["modes"] == ["loss"]
    assert [r["provider"] for r in doc["rows"]] == list(CPU_LOSS_PROVIDERS)
    assert all(r["err_loss"] < 1e-5 for r in doc["rows"])

    assert main(["report", str(tmp_path / "bench.json")]) == 0
    text = capsys.readouterr().out
    assert "**loss, DAPO + k3 KL: ms (CPU: no floor)**" in text
    assert "| lp-loss-torch (loss) |" in text  # memory and error tables
    assert "fp64 reference** (loss, logprob, entropy, grad_hidden, grad_weight)" in text


def test_report_loss_mode_on_gpu_rows():
    from lp_bench.report import markdown

    def row(provider, entropy, x):
        return {
            "mode": "loss", "entropy": entropy, "provider": provider, "shape": "S1",
            "dtype": "bf16", "ms": 10 * x, "x_floor": x, "floor_ms": 10.0,
            "peak_bytes": 2**30, "err_loss": 1e-6, "err_logprob": 2e-6,
            "err_grad_hidden": 3e-3, "note": None, "error": None, "skipped": None,
        }  # fmt: skip

    rows = [row("lp-loss-triton", False, 0.8), row("materialized", False, 1.2)]
    rows += [row("lp-loss-triton", True, 0.85)]
    text = markdown({"command": "bench", "env": {"device": "cuda", "gpu": "H200"}, "rows": rows})
    assert "**loss, DAPO + k3 KL: x floor (4 matmuls)**" in text
    assert "**loss, DAPO + k3 KL + entropy bonus: x floor (4 matmuls)**" in text
    assert "| lp-loss-triton | 0.80 |" in text and "| materialized | 1.20 |" in text


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the triton package is not installed"
)
def test_triton_loss_providers_under_the_interpreter(tmp_path):
    """lp-loss-triton (and linear_logprob's triton backend + the loss) on CPU under
    TRITON_INTERPRET=1, which Triton reads at import: in a child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "lp_bench.cli", "bench", "--mode", "loss", "--entropy", "both",
        "--backends", "lp-loss-triton,lp-loss-triton-det,lp-triton", "--shapes", "24x16x257",
        "--dtype", "fp32", "--reps", "1", "--warmup", "0", "--device", "cpu",
        "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 6
    for r in rows:
        assert r["error"] is None and r["skipped"] is None, r
        for key in ("err_loss", "err_logprob", "err_grad_hidden", "err_grad_weight"):
            assert r[key] < 1e-5, (r["provider"], r["entropy"], key, r[key])
