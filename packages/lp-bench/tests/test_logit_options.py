"""`lp bench --softcap C --bias`: the options reach every provider, the materialized path
applies them as a model does, rows carry them and the reports label them."""

from __future__ import annotations

import json

import pytest
import torch

from lp_bench.cli import build_parser, main
from lp_bench.protocol import ROW_KEYS

TINY = ["--shapes", "16x8x97", "--reps", "1", "--warmup", "0", "--device", "cpu"]


def _spy_linear_logprob(monkeypatch) -> list[dict]:
    """Record the keyword arguments of every ``lp_kernels.linear_logprob`` call."""
    import lp_kernels

    calls, real = [], lp_kernels.linear_logprob

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(lp_kernels, "linear_logprob", spy)
    return calls


def test_bench_softcap_and_bias_reach_linear_logprob_rows_and_tables(tmp_path, capsys, monkeypatch):
    calls = _spy_linear_logprob(monkeypatch)
    argv = ["bench", *TINY, "--dtype", "fp32", "--softcap", "2.5", "--bias", "--entropy"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert calls, "lp-torch never called linear_logprob"
    for kwargs in calls:
        assert kwargs["softcap"] == 2.5
        bias = kwargs["bias"]
        assert isinstance(bias, torch.Tensor) and bias.shape == (97,)
        assert bias.dtype == torch.float32 and bias.requires_grad  # train mode: a leaf
    out = capsys.readouterr().out
    assert "softcap 2.5, bias" in out.splitlines()[1]  # the run's header line
    table = out[out.index("run  ") :]
    assert "train+entropy (softcap 2.5, bias)" in table and "err grad_b" in table

    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["softcap"] == 2.5 and doc["config"]["bias"] is True
    rows = doc["rows"]
    assert [r["provider"] for r in rows] == ["lp-torch", "materialized"]
    for row in rows:
        assert list(row) == list(ROW_KEYS)
        assert row["softcap"] == 2.5 and row["bias"] is True and row["error"] is None
        for key in ("err_logprob", "err_entropy", "err_grad_hidden", "err_grad_weight"):
            assert row[key] < 1e-5, (row["provider"], key, row[key])
        assert row["err_grad_bias"] is not None and row["err_grad_bias"] < 1e-5

    assert main(["report", str(tmp_path / "bench.json")]) == 0
    text = capsys.readouterr().out
    assert "**train, logprob + entropy, softcap 2.5, bias: ms (CPU: no floor)**" in text
    assert "**peak memory above the inputs, MiB (softcap 2.5, bias)**" in text
    assert (
        "fp64 reference (softcap 2.5, bias)** (logprob, entropy, grad_hidden, grad_weight, "
        "grad_bias)" in text
    )


def test_reference_catches_an_option_that_a_provider_drops(tmp_path, monkeypatch):
    """The errors are against a reference with the cap and bias: a provider that ignored
    them would show it (here lp called without them, through the spy)."""
    import lp_kernels

    real = lp_kernels.linear_logprob

    def drops(*args, **kwargs):
        kwargs.update(softcap=None, bias=None)
        return real(*args, **kwargs)

    monkeypatch.setattr(lp_kernels, "linear_logprob", drops)
    argv = ["bench", *TINY, "--dtype", "fp32", "--softcap", "2.5", "--bias"]
    assert main([*argv, "--backends", "lp-torch", "--out", str(tmp_path)]) == 1
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["err_logprob"] > 1e-2 and row["err_grad_hidden"] > 1e-2
    assert row["err_grad_bias"] is None  # the bias never entered the graph: no gradient
    assert row["error"] == "RuntimeError: no gradient reached the bias (the step ignored it)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_materialized_path_with_softcap_and_bias_agrees_with_lp(dtype):
    """Logits ``F.linear(h, W, b)``, cap ``tanh(l / c) * c`` in their dtype, then fp32:
    lp's fused result to each dtype's tolerance, gradients of all three inputs too, and the
    cap and bias really change the numbers."""
    from lp_bench.protocol import make_bias, make_inputs
    from lp_bench.providers import make_provider

    hidden, weight, targets, grad_out = make_inputs(24, 16, 203, device="cpu", dtype=dtype)
    bias = make_bias(203, device="cpu", dtype=dtype)
    got = {}
    for name, softcap, with_bias in [
        ("materialized", 3.0, True),
        ("lp-torch", 3.0, True),
        ("materialized", None, False),
    ]:
        prep = make_provider(name, mode="train", softcap=softcap, bias=with_bias)
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        b = bias.detach().requires_grad_()
        extra = {"bias": b} if with_bias else {}
        logprob, _ = prep.step(h, w, targets, grad_out, None, **extra)
        got[name, softcap] = (logprob, h.grad, w.grad, b.grad if with_bias else None)
    mat, lp, plain = got["materialized", 3.0], got["lp-torch", 3.0], got["materialized", None]
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for a, c in zip(mat, lp, strict=True):
        assert a.dtype == c.dtype
        err = float((a.float() - c.float()).norm() / c.float().norm())
        assert err < tol, err
    assert mat[3].dtype == dtype and mat[3].shape == (203,)
    err = float((mat[0] - plain[0]).norm() / plain[0].norm())
    assert err > 0.05, err  # a cap of 3 on logits of std ~2 bends them


def test_materialized_outputs_cap_runs_in_the_logits_dtype():
    """bf16 logits: the cap is a bf16 op on them (as HF Gemma 2 does), not an fp32 one."""
    from lp_bench.providers import materialized_outputs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(8, 16, generator=g).bfloat16()
    w = torch.randn(64, 16, generator=g).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    t = torch.randint(0, 64, (8,), generator=g)
    got = materialized_outputs(h, w, t, bias=b, softcap=4.0)["logprob"]
    logits = torch.nn.functional.linear(h, w, b)
    capped = (torch.tanh(logits / 4.0) * 4.0).float()
    want = capped.log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    assert torch.equal(got, want)


def test_grid_has_no_softcap_or_bias_unless_asked():
    parser = build_parser()
    from lp_bench.cli import bench_config

    cfg = bench_config(parser.parse_args(["bench", "--grid"]), parser, "cpu")
    assert cfg.softcap is None and cfg.bias is False
    cfg = bench_config(
        parser.parse_args(["bench", "--grid", "--softcap", "30", "--bias"]), parser, "cpu"
    )
    assert cfg.softcap == 30.0 and cfg.bias is True


def test_peer_without_the_keyword_is_skipped_with_a_note():
    from lp_bench.providers import Unsupported, peer_options

    def old(hidden, weight, targets, reduction="mean"):
        pass

    def new(hidden, weight, targets, bias=None, reduction="mean", softcap=None):
        pass

    assert peer_options("cce", old, softcap=None, bias=False) == {}
    assert peer_options("cce", new, softcap=30.0, bias=True) == {"softcap": 30.0}
    with pytest.raises(Unsupported, match="cut_cross_entropy takes no softcap="):
        peer_options("cce", old, softcap=30.0, bias=False)
    with pytest.raises(Unsupported, match="liger_kernel takes no bias="):
        peer_options("liger", old, softcap=None, bias=True)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "big"])
def test_bad_softcap_exits_naming_the_argument(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--softcap", value])
    assert exc.value.code != 0
    assert "argument --softcap" in capsys.readouterr().err


def test_bad_softcap_in_config_and_provider():
    from lp_bench.protocol import BenchConfig
    from lp_bench.providers import make_provider

    base = dict(shapes=(("x", 2, 2, 3),), providers=("lp-torch",), dtypes=("fp32",), device="cpu")
    with pytest.raises(ValueError, match=r"BenchConfig\.softcap"):
        BenchConfig(**base, softcap=0.0)
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        make_provider("lp-torch", softcap=float("nan"))


def test_bench_tp2_with_softcap_and_bias_under_torchrun(tmp_path):
    """Each rank its shard of the bias: errors of the sharded run against the full
    reference, grad_bias included."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", "-m", "lp_bench.cli", "bench", "--tp", "2",
        "--shapes", "32x16x301", "--backends", "lp-torch,lp-torch-det",
        "--dtype", "fp32", "--reps", "1", "--warmup", "0", "--softcap", "2.5", "--bias",
        "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["provider"] for r in rows] == ["lp-torch", "lp-torch-det"]
    for r in rows:
        assert r["tp"] == 2 and r["softcap"] == 2.5 and r["bias"] is True
        for key in ("err_logprob", "err_grad_hidden", "err_grad_weight", "err_grad_bias"):
            assert r[key] < 1e-6, (r["provider"], key, r[key])
