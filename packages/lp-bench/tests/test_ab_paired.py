"""``benchmarks/ab_paired.py`` on CPU: ``prepare`` makes an older tree that imports beside
this checkout's ``lp_kernels``, and the bits check (the torch backend here; the timing
needs CUDA) tells equal trees from different ones."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_paired", ROOT / "benchmarks" / "ab_paired.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_prepare_renames_every_reference(ab, trees):
    import lp_kernels

    copy = trees / "lp_kernels_a"
    files = list(copy.rglob("*.py"))
    assert (copy / "__init__.py").exists() and len(files) > 10
    for path in files:
        assert not re.search(r"\blp_kernels\b", path.read_text()), path
    mods = ab.load_trees([("a", list(ab.SETS)), ("b", ["bias"])], trees)
    assert list(mods) == ["a", "b", "new"]
    assert mods["new"][0] is lp_kernels
    assert mods["a"][0].linear_logprob is not lp_kernels.linear_logprob
    assert mods["a"][0].__file__.startswith(str(copy))
    assert mods["b"][1] == ["bias"]


def test_bits_equal_for_the_same_tree_and_not_for_another(ab, trees):
    mods = ab.load_trees([("a", list(ab.SETS)), ("b", list(ab.SETS))], trees)
    del mods["new"]  # the working tree may hold uncommitted changes
    inputs = ab.make_step_inputs(7, 16, 37, device="cpu")
    bits = ab.check_bits(mods, inputs, list(ab.SETS), "torch")
    assert bits == {s: {"b": True} for s in ab.SETS}

    def shifted(*args, **kw):  # one ulp more on every log-prob
        out = mods["b"][0].linear_logprob(*args, **kw)
        return out._replace(logprob=torch.nextafter(out.logprob, out.logprob + 1))

    off = {"a": mods["a"], "b": (types.SimpleNamespace(linear_logprob=shifted), ["cap"])}
    assert ab.check_bits(off, inputs, ["plain", "cap"], "torch") == {
        "plain": {},
        "cap": {"b": False},
    }


def test_tree_specs(ab):
    sets = list(ab.SETS)
    assert ab.parse_trees("base,mid:bias+cap", sets) == [("base", sets), ("mid", ["bias", "cap"])]
    with pytest.raises(ValueError, match="bad item 'mid:nope'"):
        ab.parse_trees("base,mid:nope", sets)
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
    mods = {"base": None, "mid": None, "new": None}
    rows = ab.summarize(runs, mods)
    assert rows["plain/base"]["over_plain"] is None
    assert rows["bias/base"]["over_plain"] == pytest.approx(0.1)
    assert rows["bias/new"]["vs_base"] == pytest.approx(-0.1)
    assert rows["bias/new"]["over_plain"] == pytest.approx(0.1)
    assert rows["bias/mid"]["over_plain"] == pytest.approx(0.1)  # over new's plain
    assert rows["bias/mid"]["vs_base"] == pytest.approx(-0.1)
    assert rows["plain/new"]["median_ms"] == 9.0
