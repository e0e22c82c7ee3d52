"""The repository's documentation and tool layout, checked on the files (nothing imported).

The product holds the current state only; what was tried lives in git and in rows of
``docs/history.md``. These checks keep the notebook from growing back unseen:

(a) ``docs/results/`` holds at most 8 files, each named in a doc (``docs/*.md`` or
    ``README.md``);
(b) ``docs/benchmarks.md`` has at most 300 lines, ``docs/design.md`` at most 600;
(c) ``benchmarks/`` holds only the maintained tools (and an optional README);
(d) no source, test, benchmark or example refers to an issue-tracker number;
(e) no heading of ``docs/benchmarks.md`` names a commit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

MAX_RESULTS = 8
MAX_LINES = {"benchmarks.md": 300, "design.md": 600}
BENCHMARK_TOOLS = {"ab.py", "sweep.py", "profile_step.py", "gpu_suite.sh"}
BENCHMARK_OPTIONAL = {"README.md"}

# The word "issue" or "issues", then a number, with an optional space and "#" between
# (any case); a third-party bug may be cited as "upstream issue <n>".
ISSUE_NUMBER = re.compile(r"(?<!upstream )\bissues? ?#?\d+", re.IGNORECASE)
# A heading that carries a backticked abbreviated or full commit id.
COMMIT_HEADING = re.compile(r"^#{1,6}\s.*`[0-9a-f]{7,40}`", re.MULTILINE)
IGNORED_NAMES = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def _listing(folder: Path) -> list[Path]:
    """The entries of ``folder`` a reader sees: no caches, no hidden files."""
    return sorted(
        p for p in folder.iterdir() if p.name not in IGNORED_NAMES and not p.name.startswith(".")
    )


def _docs_text() -> str:
    files = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    return "\n".join(p.read_text(encoding="utf-8") for p in files if p.is_file())


def _text_files(folder: Path):
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or IGNORED_NAMES.intersection(path.parts) or path.suffix == ".pyc":
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file: no prose to check


def _code_folders() -> list[Path]:
    folders = sorted(ROOT.glob("packages/*/src")) + sorted(ROOT.glob("packages/*/tests"))
    return folders + [p for p in (ROOT / "benchmarks", ROOT / "examples") if p.is_dir()]


def test_results_hold_at_most_eight_files():
    files = _listing(RESULTS)
    assert len(files) <= MAX_RESULTS, (
        f"docs/results/ holds {len(files)} files, at most {MAX_RESULTS} allowed: keep only the "
        "current records (the latest grid, the latest loss run and what a doc cites), move "
        "each superseded record's finding to a row of docs/history.md naming the file, and "
        "delete the file with `rm` (git keeps it: `git show <commit>:docs/results/NAME`). "
        f"Present: {[p.name for p in files]}"
    )


def test_every_result_is_linked_from_a_doc():
    text = _docs_text()
    unlinked = [p.name for p in _listing(RESULTS) if p.name not in text]
    assert not unlinked, (
        f"docs/results/ files that no docs/*.md or README.md names: {unlinked}. Link each "
        "from the doc that shows its figures (docs/benchmarks.md for current results), or "
        "delete it and record its finding as a docs/history.md row."
    )


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_doc_length(name):
    lines = (DOCS / name).read_text(encoding="utf-8").count("\n")
    limit = MAX_LINES[name]
    assert lines <= limit, (
        f"docs/{name} has {lines} lines, at most {limit} allowed. Move lab history (which "
        "commit measured what) to rows of docs/history.md, replace superseded tables by "
        "the current `lp report` output, and describe modules by role rather than listing "
        "identifiers."
    )


def test_benchmarks_hold_only_the_maintained_tools():
    names = {p.name for p in _listing(ROOT / "benchmarks")}
    extra = sorted(names - BENCHMARK_TOOLS - BENCHMARK_OPTIONAL)
    missing = sorted(BENCHMARK_TOOLS - names)
    assert not extra and not missing, (
        f"benchmarks/ must hold exactly {sorted(BENCHMARK_TOOLS)} (and optionally "
        f"README.md). Extra: {extra}; missing: {missing}. Fold a one-off experiment into "
        "ab.py / sweep.py / profile_step.py (a config passed through use_config, not a new "
        "script), or keep it on a branch and record its finding as a docs/history.md row."
    )


def test_no_issue_numbers_in_code():
    hits = []
    for folder in _code_folders():
        for path, text in _text_files(folder):
            for i, line in enumerate(text.splitlines(), 1):
                match = ISSUE_NUMBER.search(line)
                if match:
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {match.group(0)!r}")
    assert not hits, (
        "Code, tests, benchmarks and examples must not refer to issue-tracker numbers: say "
        "what the code does or guarantees instead (a third-party bug may be cited as "
        "'upstream issue <n>'; reword the verb 'issues' before a count).\n" + "\n".join(hits)
    )


def test_benchmarks_doc_headings_name_no_commit():
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    headings = [m.group(0) for m in COMMIT_HEADING.finditer(text)]
    assert not headings, (
        f"docs/benchmarks.md headings that name a commit: {headings}. A section about one "
        "commit's experiment is lab history: make it a row of docs/history.md (date, "
        "commit, what, result, kept?) and keep only current results here, with their "
        "commit in the prose."
    )


def test_issue_number_pattern():
    # Each example is split in two literals so that this file passes its own check.
    for text in ("see issue" " 12", "Issues" " 4 and 8", "issue" " #7", "(issue" "#3)"):
        assert ISSUE_NUMBER.search(text), text
    for text in ("upstream issue" " 1234", "tissue 3", "issued 5", "issue-tracker"):
        assert not ISSUE_NUMBER.search(text), text
