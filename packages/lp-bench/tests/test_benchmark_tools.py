"""CPU smoke tests of the maintained tools in ``benchmarks/``: every script answers
``--help``; ``ab.py bits`` and ``compare`` tell equal digests from doctored ones; ``ab.py
prepare`` makes a tree that imports beside this checkout's ``lp_kernels``; ``ab.py time``
checks bits and pairs rounds on a tiny CPU shape; ``sweep.py`` lists its variants and, under
the interpreter, finds the order-only ones bitwise equal to the pinned config (and times a
variant); ``profile_step.py`` runs on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
TOOLS = sorted((ROOT / "benchmarks").glob("*.py"))


def _load(name: str):
    """A script of ``benchmarks/`` as a module (registered: its dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ab():
    yield _load("ab")
    del sys.modules["ab"]


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_every_tool_answers_help(tool):
    got = _run(str(tool), "--help")
    assert got.returncode == 0, got.stderr
    assert "usage:" in got.stdout


@pytest.mark.parametrize("command", ["bits", "compare", "prepare", "time"])
def test_ab_commands_answer_help(command):
    got = _run("benchmarks/ab.py", command, "--help")
    assert got.returncode == 0, got.stderr


def test_bits_compare_equal_to_itself_and_not_to_a_doctored_copy(ab, tmp_path, capsys):
    out = tmp_path / "a.json"
    got = _run("benchmarks/ab.py", "bits", "--device", "cpu", "-k", "torch.fp32.plain", "--out",
               str(out), "--no-tp")  # fmt: skip
    assert got.returncode == 0, got.stderr
    record = json.loads(out.read_text())
    assert list(record["cases"]) == ["torch.fp32.plain"]
    digests = record["cases"]["torch.fp32.plain"]
    assert set(digests) == {"logprob", "entropy", "lse", "grad_hidden", "grad_weight"}
    assert ab.compare(str(out), str(out)) == 0

    doctored = json.loads(out.read_text())
    doctored["cases"]["torch.fp32.plain"]["grad_weight"] = "0" * 64
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps(doctored))
    capsys.readouterr()
    assert ab.compare(str(out), str(bad)) == 1
    assert "DIFFERS torch.fp32.plain: grad_weight" in capsys.readouterr().out

    extra = json.loads(out.read_text())
    extra["cases"]["other"] = {"logprob": "0" * 64}
    more = tmp_path / "c.json"
    more.write_text(json.dumps(extra))
    assert ab.compare(str(out), str(more)) == 1  # a case in one file only
    assert ab.compare(str(out), str(more), only_common=True) == 0
    disjoint = tmp_path / "d.json"
    disjoint.write_text(json.dumps({"cases": {"other": {}}}))
    assert ab.compare(str(out), str(disjoint), only_common=True) == 1  # nothing in common


def test_bits_case_names_are_unique(ab):
    for device, with_tp in (("cpu", True), ("cuda", True), ("cpu", False)):
        names = [name for name, _, _ in ab.cases(device, with_tp)]
        assert len(names) == len(set(names)), device


@pytest.fixture(scope="module")
def trees(ab, tmp_path_factory):
    """HEAD's lp_kernels twice, as lp_kernels_a and lp_kernels_b."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git history (a source checkout)")
    folder = tmp_path_factory.mktemp("trees")
    for name in ("a", "b"):
        ab.prepare("HEAD", name, folder)
    yield folder
    for name in list(sys.modules):
        if name.split(".")[0] in ("lp_kernels_a", "lp_kernels_b"):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p != str(folder)]


def test_prepare_makes_a_tree_that_imports_beside_this_one(ab, trees):
    import lp_kernels

    copy = trees / "lp_kernels_a"
    files = list(copy.rglob("*.py"))
    assert (copy / "__init__.py").exists() and len(files) > 10
    for path in files:
        assert not re.search(r"\blp_kernels\b", path.read_text()), path
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=True).stdout.strip()  # fmt: skip
    assert (copy / ab.REV_FILE).read_text().strip() == head
    got = ab.load_trees([("a", list(ab.SETS)), ("b", ["bias"])], trees)
    assert [t.name for t in got] == ["a", "b", "new"]
    assert got[-1].mod is lp_kernels and got[-1].sets is None
    assert got[0].mod.linear_logprob is not lp_kernels.linear_logprob
    assert got[0].mod.__file__.startswith(str(copy)) and got[0].rev == head
    assert got[1].runs("bias") and not got[1].runs("cap")


def test_bits_check_tells_equal_trees_from_different_ones(ab, trees):
    a, b = ab.load_trees([("a", list(ab.SETS)), ("b", list(ab.SETS))], trees, with_new=False)
    inputs = ab.make_step_inputs(7, 16, 37, device="cpu")
    for mode in ab.MODES:
        bits, per_token = ab.check_bits([a, b], inputs, mode, list(ab.SETS), "torch")
        assert bits == {s: {"b": True} for s in ab.SETS}, mode
        assert bool(per_token) == (mode == "loss")

    def shifted(*args, **kw):  # one ulp more on every log-prob
        out = b.mod.linear_logprob(*args, **kw)
        return out._replace(logprob=torch.nextafter(out.logprob, out.logprob + 1))

    off = ab.Tree("b", types.SimpleNamespace(linear_logprob=shifted), ["cap"])
    bits, _ = ab.check_bits([a, off], inputs, "train", ["plain", "cap"], "torch")
    assert bits == {"plain": {}, "cap": {"b": False}}


def test_time_on_cpu_writes_a_record(ab, trees, tmp_path, capsys):
    out = tmp_path / "ab.json"
    argv = ["time", "--trees", "a,b:bias", "--dir", str(trees), "--device", "cpu",
            "--backend", "torch", "--shapes", "7x16x37", "--modes", "train,fwd,loss",
            "--sets", "plain,bias,both_ent", "--rounds", "2", "--reps", "1", "--warm-s", "0",
            "--out", str(out)]  # fmt: skip
    assert ab.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["env"]["device"] == "cpu" and record["env"]["torch"] == torch.__version__
    assert set(record["trees"]) == {"a", "b", "new"}
    for mode in ab.MODES:
        got = record["results"][mode]["7x16x37"]
        assert got["bits"]["bias"]["b"] is True and "b" not in got["bits"]["plain"]
        assert set(got["rows"]) == {
            f"{s}/{t}" for s in ("plain", "bias", "both_ent") for t in ("a", "new")
        } | {"bias/b"}
        assert all(len(r) == 2 for r in got["rounds"].values())
        assert got["rows"]["bias/a"]["vs_a"] == 0.0
    assert "loss 7x16x37: bits vs a" in capsys.readouterr().out


def test_tree_specs(ab):
    sets = list(ab.SETS)
    assert ab.parse_trees("base,mid:bias+cap", sets) == [("base", sets), ("mid", ["bias", "cap"])]
    with pytest.raises(ValueError, match="bad item 'mid:nope'"):
        ab.parse_trees("base,mid:nope", sets)
    with pytest.raises(ValueError, match="bad item 'new'"):
        ab.parse_trees("base,new", sets)
    with pytest.raises(ValueError, match="the first tree"):
        ab.parse_trees("base:bias", sets)
    with pytest.raises(ValueError, match="identifier"):
        ab.prepare("HEAD", "not-a-name", Path("unused"))


def test_summary_pairs_rounds(ab):
    """Ratios are medians of per-round ratios (paired), not ratios of medians; a tree that
    skips plain has its cost over this checkout's plain step."""
    runs = {
        ("plain", "base"): [10.0, 20.0, 10.0],
        ("bias", "base"): [11.0, 22.0, 11.0],
        ("plain", "new"): [9.0, 18.0, 9.0],
        ("bias", "new"): [9.9, 21.6, 9.9],
        ("bias", "mid"): [9.0, 19.8, 9.9],
    }
    rows = ab.summarize(runs, ["base", "mid", "new"])
    assert rows["plain/base"]["over_plain"] is None
    assert rows["bias/base"]["over_plain"] == pytest.approx(0.1)
    assert rows["bias/new"]["vs_base"] == pytest.approx(-0.1)
    assert rows["bias/new"]["over_plain"] == pytest.approx(0.1)
    assert rows["bias/mid"]["over_plain"] == pytest.approx(0.1)  # over new's plain
    assert rows["bias/mid"]["vs_base"] == pytest.approx(-0.1)
    assert rows["plain/new"]["median_ms"] == 9.0


@pytest.fixture(scope="module")
def sweep():
    yield _load("sweep")
    del sys.modules["sweep"]


@pytest.mark.parametrize("op", ["tiles", "loss"])
def test_sweep_ops_answer_help_and_list_every_variant(sweep, op):
    got = _run("benchmarks/sweep.py", op, "--help")
    assert got.returncode == 0, got.stderr
    got = _run("benchmarks/sweep.py", op, "--list")  # builds every variant's config
    assert got.returncode == 0, got.stderr
    table, order_only = sweep.OPS[op]
    listed = [line.split() for line in got.stdout.splitlines()[1:]]
    assert [row[0] for row in listed] == list(table)
    assert [row[0] for row in listed if row[1] == "*"] == [n for n in table if n in order_only]
    assert set(order_only) <= set(table)


def test_sweep_describes_a_variant(sweep):
    variant = {"logits": {"block_v": 128, "num_stages": 4}, "tma": False}
    assert sweep.describe(variant) == "logits.block_v=128, logits.num_stages=4, tma=False"
    assert sweep.describe({}) == "(pinned)"
    with pytest.raises(SystemExit, match="unknown variants"):
        sweep.configs(None, sweep.TILE_VARIANTS, ["nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's smoke test (CPU)")
def test_sweep_bits_and_timing_under_the_interpreter(sweep, tmp_path):
    """Every order-only variant, in the default mode and deterministic=True at two tiles,
    gives the pinned config's bits; ``pinned`` is timed (perf_counter) against the floor."""
    out = tmp_path / "sweep.json"
    timing = ["--variants", "pinned", "--rounds", "1", "--reps", "1", "--warm-s", "0"]
    tiny = ["--shapes", "33x64x517", "--bits", *timing, "--out", str(out)]
    got = _run("benchmarks/sweep.py", "tiles", *tiny)
    assert got.returncode == 0, got.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["env"]["device"] == "cpu"
    bits = [r for r in record["rows"] if r.get("check") == "bits"]
    assert [r["deterministic"] for r in bits[:: len(sweep.ORDER_ONLY)]] == [False, 128, 4224]
    assert [r["variant"] for r in bits] == list(sweep.ORDER_ONLY) * 3
    for r in bits:
        if "error" in r:  # a 64 x 256 x 128 block of products passes the interpreter's limit
            assert r["variant"] == "mm128" and "numel" in r["error"], r
        else:
            assert r["equal"] == dict.fromkeys(
                ("logprob", "entropy", "grad_hidden", "grad_weight"), True
            ), r
    assert sum("equal" in r for r in bits) >= 3 * (len(sweep.ORDER_ONLY) - 1)
    (timed,) = [r for r in record["rows"] if "check" not in r]
    assert timed["variant"] == "pinned" and timed["total_ms"] > timed["fwd_ms"] > 0
    assert timed["x_floor"] == pytest.approx(timed["total_ms"] / timed["floor_ms"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's smoke test (CPU)")
def test_sweep_loss_runs_under_the_interpreter(tmp_path):
    out = tmp_path / "loss.json"
    timing = ["--rounds", "1", "--reps", "1", "--warm-s", "0", "--no-materialized"]
    tiny = ["--shapes", "33x64x517", "--variants", "pinned,w4", "--fwd-variants", "pinned"]
    got = _run("benchmarks/sweep.py", "loss", *tiny, *timing, "--out", str(out))
    assert got.returncode == 0, got.stderr[-2000:]
    rows = {r["provider"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["lp", "lp-loss/pinned", "lp-loss/w4", "fwd/pinned", "fwd/pinned+ent"]
    assert rows["lp"]["err"] == [0.0, 0.0, 0.0]
    assert rows["lp-loss/w4"]["equal_pinned"] is True  # warps: a launch choice
    assert all(r["ms"] > 0 and r["floor_matmuls"] in (1, 4) for r in rows.values())


@pytest.mark.slow
def test_profile_step_runs_on_cpu(tmp_path):
    out = tmp_path / "step.json"
    got = _run("benchmarks/profile_step.py", "--shapes", "64x32x1000", "--out", str(out))
    assert got.returncode == 0, got.stderr[-2000:]
    (row,) = json.loads(out.read_text())  # on CPU its own tiny shape, the same size
    assert (row["N"], row["V"]) == (64, 1000) and row["kernels"] and row["wall_ms"] > 0
