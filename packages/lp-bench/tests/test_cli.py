"""The `lp` command line: `lp demo` end to end on a small CPU problem, and argument errors."""

from __future__ import annotations

import json

import pytest

from lp_bench.cli import main
from lp_bench.protocol import ROW_KEYS

SMALL = ["--n", "64", "--h", "32", "--v", "1001", "--seed", "1", "--repeat", "1"]
PATH_KEYS = {
    "time_s",
    "times_s",
    "peak_bytes",
    "scratch_bytes",
    "reproducible",
    "max_abs_err",
    "max_rel_err",
}
ERROR_KEYS = {"logprob", "entropy", "lse", "grad_hidden", "grad_weight"}


def test_demo_prints_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "sub" / "demo.json"

    assert main(["demo", *SMALL, "--json", str(out_json)]) == 0

    out = capsys.readouterr().out
    for text in ("lp linear_logprob", "materialized logits", "fp64 reference", "bf16", "fp32"):
        assert text in out
    for key in ERROR_KEYS:
        assert f"max |err| {key} vs fp64" in out
    assert "first tokens" in out

    doc = json.loads(out_json.read_text())
    assert doc.keys() >= {"command", "config", "env", "runs"}
    assert doc["config"]["n"] == 64 and doc["config"]["v"] == 1001
    assert [run["dtype"] for run in doc["runs"]] == ["bf16", "fp32"]
    for run in doc["runs"]:
        assert run["logits_and_grad_bytes"] > 0
        assert run["ignored_rows"] > 0
        assert run["paths"].keys() == {"lp", "materialized", "fp64"}
        for figures in run["paths"].values():
            assert figures.keys() >= PATH_KEYS
            assert figures["max_abs_err"].keys() == ERROR_KEYS
            assert figures["reproducible"]
        lp, mat = run["paths"]["lp"], run["paths"]["materialized"]
        for key in ERROR_KEYS:
            # No worse than twice the plain materialized path's error (fp32 math in both).
            worst = lp["max_abs_err"][key]
            assert worst <= 2 * mat["max_abs_err"][key] + 1e-5, (run["dtype"], key, worst)
            if run["dtype"] == "fp32":
                assert lp["max_rel_err"][key] < 1e-4, (key, lp["max_rel_err"][key])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["nope"], "invalid choice"),
        (["demo", "--n", "0"], "positive integer"),
        (["demo", "--v", "1"], "at least 2"),
        (["demo", "--dtype", "fp8"], "invalid choice"),
        (["demo", "--n", "many"], "invalid"),
    ],
    ids=["no-command", "unknown-command", "n-zero", "v-one", "bad-dtype", "n-not-int"],
)
def test_bad_arguments_exit_nonzero_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- lp bench


ENV_KEYS = {"device", "device_name", "torch", "triton", "lp_kernels", "python", "commit", "date"}


def test_bench_writes_json_and_prints_table(tmp_path, capsys):
    argv = ["bench", "--shapes", "16x8x97", "--reps", "1", "--device", "cpu"]
    assert main([*argv, "--entropy", "--temperature", "0.7", "--out", str(tmp_path)]) == 0

    out = capsys.readouterr().out
    table = out[out.index("run  ") :]  # the table is printed last
    for text in ("lp-torch", "materialized", "err grad_w", "err entropy", "16x8x97"):
        assert text in table
    assert "…" not in out  # stdout is not a terminal here: the plain table, every cell whole

    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["command"] == "bench"
    assert doc["env"].keys() >= ENV_KEYS and doc["env"]["device"] == "cpu"
    config = doc["config"]
    assert config["shapes"] == [{"name": "16x8x97", "N": 16, "H": 8, "V": 97}]
    assert config["dtypes"] == ["fp32", "bf16"] and config["temperature"] == 0.7
    assert config["entropy"] == [True] and config["modes"] == ["train"] and config["reps"] == 1
    rows = doc["rows"]
    assert [(r["dtype"], r["provider"]) for r in rows] == [
        ("fp32", "lp-torch"),
        ("fp32", "materialized"),
        ("bf16", "lp-torch"),
        ("bf16", "materialized"),
    ]
    for row in rows:
        assert list(row) == list(ROW_KEYS), row.keys()
        assert row["mode"] == "train" and row["entropy"] and row["entropy_computed"]
        assert row["commit"] and row["date"] and row["torch"] and row["device"] == "cpu"
        assert row["floor_ms"] is None and row["x_floor"] is None  # CPU: no floor
        assert row["ms"] > 0 and len(row["ms_all"]) == 1 and row["peak_bytes"] > 0
        tol = 1e-5 if row["dtype"] == "fp32" else 2e-2
        for key in ("err_logprob", "err_grad_hidden", "err_grad_weight", "err_entropy"):
            assert row[key] < tol, (row["dtype"], row["provider"], key, row[key])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--shapes", "S9"], "argument --shapes"),
        (["bench", "--shapes", "4x0x10"], "argument --shapes"),
        (["bench", "--backends", "lp-foo"], "argument --backends"),
        (["bench", "--backends", "lp-triton", "--device", "cpu"], "argument --backends"),
        (["bench", "--backends", "liger", "--device", "cpu"], "argument --backends"),
        (["bench", "--dtype", "fp8"], "argument --dtype"),
        (["bench", "--temperature", "0"], "argument --temperature"),
        (["bench", "--temperature", "hot"], "argument --temperature"),
        (["bench", "--reps", "0"], "argument --reps"),
        (["bench", "--warmup", "-1"], "argument --warmup"),
        (["bench", "--warm-s", "-1"], "argument --warm-s"),
        (["bench", "--warm-s", "nan"], "argument --warm-s"),
        (["bench", "--tp", "2"], "needs a torchrun launch with 2 processes"),
        (["bench", "--tp", "0"], "argument --tp"),
        (["bench", "--mode", "eval"], "argument --mode"),
        (["bench", "--entropy", "maybe"], "argument --entropy"),
        (["report", "/nonexistent/bench.json"], "argument BENCH_JSON"),
        (["check", "--tp-timeout", "0"], "argument --tp-timeout"),
        (["check", "--bogus"], "unrecognized arguments"),
    ],
    ids=[
        "unknown-shape",
        "zero-hidden",
        "unknown-backend",
        "triton-on-cpu",
        "peer-on-cpu",
        "bad-dtype",
        "temperature-zero",
        "temperature-nan",
        "reps-zero",
        "warmup-negative",
        "warm-s-negative",
        "warm-s-nan",
        "tp-without-torchrun",
        "tp-zero",
        "unknown-mode",
        "bad-entropy",
        "report-missing-file",
        "check-timeout-zero",
        "check-unknown-flag",
    ],
)
def test_bench_bad_arguments_exit_nonzero_naming_the_argument(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_bench_tp2_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m lp_bench.cli bench --tp 2` on CPU (gloo)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", "-m", "lp_bench.cli", "bench", "--tp", "2",
        "--shapes", "64x32x1001", "--backends", "lp-torch,lp-torch-det,materialized",
        "--dtype", "fp32", "--reps", "1", "--warmup", "0", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP=2") == 1  # rank 0 alone prints
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["tp"] == 2
    rows = {r["provider"]: r for r in doc["rows"]}
    assert "single-device provider" in rows["materialized"]["skipped"]
    for name in ("lp-torch", "lp-torch-det"):
        r = rows[name]
        assert r["tp"] == 2 and r["ms"] > 0
        for key in ("err_logprob", "err_grad_hidden", "err_grad_weight"):
            assert r[key] < 1e-6, (name, key, r[key])


# ----------------------------------------------------------------------------- lp check


def test_check_passes_with_tp(capsys):
    assert main(["check", "--quick"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines and all(line.startswith("PASS") for line in lines), out
    assert any("parity" in line for line in lines)
    assert any("bitwise" in line for line in lines)
    assert any("gloo TP=2 uneven" in line for line in lines)
    assert any(
        "gloo TP=2 deterministic, bitwise" in line and "all 5 equal" in line for line in lines
    )


def test_check_fails_with_exit_1_on_wrong_reference(capsys, monkeypatch):
    from lp_bench import check

    right = check.check_reference

    def wrong(*args, **kwargs):
        ref = right(*args, **kwargs)
        ref["lse"] = ref["lse"] + 0.5
        return ref

    monkeypatch.setattr(check, "check_reference", wrong)

    assert main(["check", "--quick", "--no-tp"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  torch parity" in out and "(lse)" in out
    assert "PASS  torch bitwise" in out
    assert " 0 failed" not in out


def test_check_tp_failure_is_reported(capsys, monkeypatch):
    from lp_bench import check

    def broken(payload, world=2, timeout=check.TP_TIMEOUT_S, startup=0.0, on_ready=None):
        raise RuntimeError("TP rank 1 failed: boom")

    monkeypatch.setattr(check, "run_tp_ranks", broken)
    monkeypatch.setattr(check, "check_parity", lambda backend, device, shapes: [])

    assert main(["check"]) == 1
    assert "FAIL  torch gloo TP=2" in capsys.readouterr().out
