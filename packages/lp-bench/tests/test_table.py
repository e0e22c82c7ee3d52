"""Tables readable everywhere: rich only on a terminal that fits, plain text otherwise,
and never a cell cut to "…"."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from lp_bench.table import plain_table, print_table

HEAD = ["run", "shape", "provider", "ms", "x floor", "err grad_w", "note"]
CELLS = [
    ["train+entropy", "S1", "lp-triton-det128", "1234.56", "1.093", "2.41e-03", ""],
    [
        "fwd",
        "2048x4096x151936",
        "cce",
        "-",
        "-",
        "-",
        "skipped: cut_cross_entropy is not importable",
    ],
    ["fwd+entropy", "S6", "liger", "12.00", "1.620", "-", "logprob only: liger has no entropy"],
]


def _every_cell_whole(text: str) -> None:
    assert "…" not in text
    for cell in [*HEAD, *(c for row in CELLS for c in row)]:
        assert cell in text, cell


def _console(width: int):
    """A rich console that says it is a terminal of ``width`` columns, and its output."""
    console = pytest.importorskip("rich.console")
    buf = io.StringIO()
    return console.Console(file=buf, force_terminal=True, width=width, color_system=None), buf


def test_wide_table_on_an_80_column_terminal_is_plain_and_whole():
    console, buf = _console(80)
    print_table(HEAD, CELLS, left=3, console=console)
    text = buf.getvalue()
    _every_cell_whole(text)
    assert "┃" not in text and "│" not in text  # not a rich table
    lines = text.splitlines()
    assert lines[0].startswith("run") and set(lines[1]) == {"-"}
    # Aligned: each numeric column ends at the same offset on every row.
    end = lines[0].index("x floor") + len("x floor")
    assert all(line[end - 5 : end] in ("1.093", "    -", "1.620") for line in lines[2:])


def test_table_that_fits_a_terminal_is_rich_and_whole():
    console, buf = _console(240)
    print_table(HEAD, CELLS, left=3, console=console)
    text = buf.getvalue()
    _every_cell_whole(text)
    assert "┃" in text or "│" in text  # rich's box


def test_table_through_capsys_is_plain(capsys):
    print_table(HEAD, CELLS, left=3, title="results")
    out = capsys.readouterr().out
    _every_cell_whole(out)
    assert out.startswith("results\n") and "│" not in out


def test_table_through_a_pipe_is_plain_and_whole():
    code = "from lp_bench.table import print_table\n" f"print_table({HEAD!r}, {CELLS!r}, left=3)\n"
    env = os.environ | {"COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    _every_cell_whole(proc.stdout)
    assert "│" not in proc.stdout


def test_plain_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="a row has 2 cells, the header 3"):
        plain_table(["a", "b", "c"], [["1", "2"]])


def test_lp_bench_runs_and_prints_plain_tables_without_rich():
    """A GPU host runs lp-bench from source in its own environment, where rich may be absent."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rich":
            raise ImportError("rich is blocked")
sys.meta_path.insert(0, Block())
import importlib.util
importlib.util.find_spec = lambda name, *a, _f=importlib.util.find_spec: (
    None if name.split(".")[0] == "rich" else _f(name, *a)
)
from lp_bench.cli import main
code = main(["bench", "--shapes", "8x4x17", "--reps", "1", "--warmup", "0", "--device", "cpu",
             "--dtype", "fp32", "--backends", "lp-torch,materialized"])
assert "rich" not in sys.modules
sys.exit(code)
"""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "run    shape   dtype  provider" in proc.stdout and "8x4x17" in proc.stdout
