"""``lp bench --mode distill`` on CPU: its rows end to end, its reference against
lp-testing's fp64 truth, its configuration, the command line and its tables (TRL's
provider against the materialized path: test_trl_provider.py, which the adapters nox
session runs with TRL installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from lp_bench.cli import main
from lp_bench.distill import (
    KINDS,
    DistillProblem,
    distill_floor,
    distill_reference,
    make_distill_provider,
    make_teacher,
)
from lp_bench.protocol import FLOOR_MATMULS, ROW_KEYS, BenchConfig, make_inputs, run_bench
from lp_bench.providers import PEERS, Unsupported, default_providers
from lp_bench.report import bench_table, markdown

N, H, V = 37, 16, 1031  # V above 1024: TRL's and lp's vocabulary tiles end partial
SHAPE = (f"{N}x{H}x{V}", N, H, V)
LP = ("lp-torch", "lp-torch-det")


def _has_op() -> bool:
    try:
        from lp_kernels import linear_divergence  # noqa: F401
    except ImportError:
        return False
    return True


def _problem(kind: str, scale: int = 2, dtype=torch.float32):
    hidden, weight, _, grad_out = make_inputs(N, H, V, device="cpu", dtype=dtype)
    teacher = make_teacher(hidden, weight, scale)
    return hidden, weight, grad_out, DistillProblem(*teacher, kind=kind, beta=0.5)


def test_distill_rows_for_every_cpu_provider_against_the_reference():
    """One row per (teacher scale, kind, provider) with the schema; the materialized path
    and (once the op exists) lp's within fp32 rounding of the fp64 reference; peers that
    cannot run marked skipped, never hidden."""
    peers = [p for p in PEERS if p != "trl" or importlib.util.find_spec("trl") is None]
    cfg = BenchConfig(
        shapes=(SHAPE,),
        providers=(*LP, "materialized", *peers),
        dtypes=("fp32",),
        device="cpu",
        modes=("distill",),
        kinds=KINDS,
        teacher_scales=(2,),  # H_t = H: the command-line test
        reps=1,
        warmup=0,
    )
    rows = run_bench(cfg, env={"device": "cpu", "commit": "abc1234"})
    assert len(rows) == cfg.size == 3 * (3 + len(peers))
    for r in rows:
        assert list(r) == list(ROW_KEYS)
        assert r["mode"] == "distill" and r["floor_ms"] is None and r["error"] is None, r
        assert r["H_t"] == 2 * H and (r["beta"] == 0.5) == (r["kind"] == "jsd")
        if r["provider"] in peers or (r["provider"] in LP and r["skipped"]):
            assert r["skipped"] and r["ms"] is None, r
            continue
        assert r["skipped"] is None and r["ms"] > 0 and r["peak_bytes"] > 0, r
        for key in ("err_divergence", "err_grad_hidden", "err_grad_weight"):
            assert r[key] < 1e-5, (r["provider"], r["kind"], key, r[key])
    by = {(r["provider"], r["kind"]): r for r in rows}
    assert by[("lp-torch-det", "jsd")]["deterministic"] is True
    assert by[("materialized", "jsd")]["deterministic"] is None
    if _has_op():  # lp-torch runs; -det runs or says why not (a ValueError of the op)
        assert all(by[("lp-torch", k)]["ms"] for k in KINDS)
        det = by[("lp-torch-det", "reverse_kl")]
        assert det["ms"] or "deterministic=True" in det["skipped"], det
    else:
        assert "linear_divergence" in by[("lp-torch", "jsd")]["skipped"]
    head, cells = bench_table(rows)
    assert "err div" in head and "err logprob" not in head
    assert {c[3] for c in cells} == set(cfg.providers)
    assert "distill jsd(0.5), H_t=2H" in {c[0] for c in cells}


@pytest.mark.parametrize("kind", KINDS)
def test_reference_matches_lp_testings_fp64_truth(kind):
    """The bench's chunked reference (blocks of 8 rows) against lp-testing's independent
    fp64 ``reference_divergence``, bf16 inputs, teacher twice as wide."""
    reference = pytest.importorskip("lp_testing.reference")
    if not hasattr(reference, "reference_divergence"):
        pytest.skip("lp_testing.reference has no reference_divergence")
    hidden, weight, grad_out, problem = _problem(kind, dtype=torch.bfloat16)
    got = distill_reference(hidden, weight, problem, grad_out, rows=8)
    teacher = (problem.teacher_hidden, problem.teacher_weight)
    want = reference.reference_divergence(
        hidden, weight, *teacher, kind=kind, beta=problem.beta, upstream=grad_out
    )
    for key in ("divergence", "grad_hidden", "grad_weight"):
        torch.testing.assert_close(got[key], want[key].to(got[key].dtype), rtol=1e-8, atol=1e-10)
    assert float(got["divergence"].min()) > 0.0


def test_teacher_floor_and_defaults():
    """The teacher's shapes and dtype, constants; its logits correlated with the student's;
    the floor's six GEMMs; distill's default CPU providers."""
    hidden, weight, _, _ = make_inputs(N, H, V, device="cpu", dtype=torch.bfloat16)
    th, tw = make_teacher(hidden, weight, 2)
    assert th.shape == (N, 2 * H) and tw.shape == (V, 2 * H) and th.dtype == torch.bfloat16
    assert not th.requires_grad and torch.equal(th[:, :H], hidden)
    zs, zt = (hidden @ weight.T).float().flatten(), (th @ tw.T).float().flatten()
    assert 0.6 < float(torch.corrcoef(torch.stack([zs, zt]))[0, 1]) < 0.95
    assert FLOOR_MATMULS["distill"] == 6
    distill_floor(hidden, weight, DistillProblem(th, tw))()
    names = default_providers("cpu", modes=("distill",))
    assert names[:4] == ["lp-torch", "lp-torch-det", "lp-loss-torch", "materialized"]
    with pytest.raises(Unsupported, match="no distillation"):
        make_distill_provider("cce", DistillProblem(th, tw))
    with pytest.raises(Unsupported, match=r"jsd only|not importable"):
        make_distill_provider("liger", DistillProblem(th, tw, kind="forward_kl"))


def test_config_counts_distill_rows_and_rejects_what_it_cannot_run():
    """A distill run counts kinds x teacher scales (not entropy) per provider; distill with
    TP, a cap, a bias, no kind, jsd's beta outside (0, 1) or a scale < 1 is a ValueError."""
    base = {"shapes": (SHAPE,), "providers": ("materialized", "lp-torch"), "device": "cpu"}
    base |= {"dtypes": ("fp32", "bf16"), "modes": ("train", "distill"), "entropy": (False, True)}
    cfg = BenchConfig(**base, kinds=("jsd", "reverse_kl"), teacher_scales=(1, 2, 3))
    assert cfg.size == 2 * (2 + 2 * 3) * 2
    bad = [{"tp": 2}, {"softcap": 3.0}, {"bias": True}, {"kinds": ()}, {"beta": 1.0}]
    for options in [*bad, {"kinds": ("kl",)}, {"teacher_scales": (0,)}]:
        with pytest.raises(ValueError, match="BenchConfig"):
            BenchConfig(**base | options)


def test_cli_distill_writes_rows_and_report(tmp_path, capsys):
    """``lp bench --mode distill --out`` on CPU, then ``lp report`` on its file; distill
    with --softcap is a usage error naming the fix."""
    out = tmp_path / "run"
    argv = ["bench", "--mode", "distill", "--shapes", "24x8x101", "--dtype", "fp32"]
    argv += ["--kind", "jsd,forward_kl", "--teacher-scale", "1", "--reps", "1", "--warmup", "0"]
    assert main([*argv, "--backends", "materialized,lp-torch", "--out", str(out)]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert [r["kind"] for r in doc["rows"]] == ["jsd", "jsd", "forward_kl", "forward_kl"]
    assert doc["config"]["kinds"] == ["jsd", "forward_kl"] and doc["config"]["beta"] == 0.5
    text = markdown(doc)
    assert "**distill, jsd(0.5), H_t=1H: ms (CPU: no floor)**" in text
    assert "divergence, logprob" in text
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--softcap", "3"])
    assert "without softcap or bias" in capsys.readouterr().err
