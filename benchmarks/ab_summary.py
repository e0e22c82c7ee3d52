"""Summary of ``gpu_suite.sh ab``: the ``lp bench`` records ``OUT/ab-{new,old}-{i}.json``
(or, as older runs of the stage left them, ``OUT/ab-{new,old}-{i}/bench.json``).

Prints one line per run and row (milliseconds, x floor), then per row the median
milliseconds of each tree and new / old. Milliseconds compare the trees directly; the
ratio to the floor also carries the floor's own run-to-run drift (1-3 %).

    python benchmarks/ab_summary.py OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys


def rows_of(path: pathlib.Path) -> list[dict]:
    """The timed rows of one ``bench.json`` (skipped and failed rows left out)."""
    rows = json.loads(path.read_text())["rows"]
    return [r for r in rows if r.get("ms") is not None]


def key(row: dict) -> str:
    """What makes two rows comparable: mode, entropy, provider, shape, dtype and options."""
    opts = [f"softcap {row['softcap']:g}"] if row.get("softcap") else []
    opts += ["bias"] if row.get("bias") else []
    ent = "+entropy" if row.get("entropy") else ""
    extra = f" ({', '.join(opts)})" if opts else ""
    return f"{row['mode']}{ent}{extra} {row['provider']} {row['shape']} {row['dtype']}"


def summarize(out: pathlib.Path) -> int:
    """Print the per-run lines and the medians; 1 if a tree has no records."""
    ms: dict[str, dict[str, list[float]]] = {"new": collections.defaultdict(list),
                                             "old": collections.defaultdict(list)}  # fmt: skip
    for tag in ("new", "old"):
        runs = sorted(out.glob(f"ab-{tag}-*.json")) + sorted(out.glob(f"ab-{tag}-*/bench.json"))
        for run in runs:
            name = run.parent.name if run.name == "bench.json" else run.stem
            for row in rows_of(run):
                ms[tag][key(row)].append(row["ms"])
                x = row.get("x_floor")  # None on CPU (no floor)
                x = "     -" if x is None else f"{x:6.3f}"
                print(f"{name:10} {key(row):48} {row['ms']:9.3f} ms {x} x floor")
    if not ms["new"] or not ms["old"]:
        print("ab_summary: no records of one tree under", out, file=sys.stderr)
        return 1
    print(f"\n{'row':48} {'new ms':>9} {'old ms':>9} {'new/old':>8}")
    for name in sorted(ms["new"].keys() & ms["old"].keys()):
        new, old = statistics.median(ms["new"][name]), statistics.median(ms["old"][name])
        print(f"{name:48} {new:9.3f} {old:9.3f} {new / old:8.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="the gpu_suite.sh output folder")
    return summarize(parser.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(main())
