"""The `lp` command line: `lp demo` end to end on a small CPU problem, and argument errors."""

from __future__ import annotations

import json

import pytest

from lp_kernels.cli import main

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
