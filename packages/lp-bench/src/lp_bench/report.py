"""Rows of a ``bench.json`` as tables: the console table of ``lp bench`` and the markdown
of ``lp report`` (docs/benchmarks.md's tables, regenerated from one results file).

Markdown, from one file: a header (device, torch, triton, commit, date); one table per
run (mode x {logprob, +entropy}, and dtype where a run has several; a run with a logit
cap or a bias says so in its title: ``softcap 30, bias``; the loss mode's title names its
loss; the distill mode has a run per kind and teacher width: ``distill, jsd(0.5), H_t=2H``)
with a row per provider and a column per shape, each cell the time over the floor (ms on
CPU, which has no floor); then one memory table (peak above the inputs) and one error
table (the worst norm-wise relative error against the reference of logprob, entropy, the
divergence, the gradients, and the loss in loss mode).
"""

from __future__ import annotations

import json
from pathlib import Path

from lp_bench.environment import card_line
from lp_bench.protocol import ERROR_KEYS, FLOOR_MATMULS, options_label, row_label

LOGPROB_ONLY = "*"
"""Marks a cell whose provider ran logprob only in an entropy run."""
LOSS_TITLE = "DAPO + k3 KL"
"""What the loss mode's step computes, in its table's title."""


def load(path: Path) -> dict:
    """A ``bench.json`` written by ``lp bench --out``; ValueError if it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read a bench.json: {exc}") from None
    if not isinstance(doc, dict) or doc.get("command") != "bench" or "rows" not in doc:
        raise ValueError(f"{path}: not a bench.json of `lp bench --out` (no bench rows)")
    return doc


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ok(row: dict) -> bool:
    return row.get("ms") is not None


def _why(row: dict) -> str:
    if row.get("error"):
        return row["error"]
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return row.get("note") or ""


def row_options(row: dict) -> str:
    """The row's logit options (``softcap 30, bias``; ``""`` for none or an older file)."""
    return options_label(row.get("softcap"), row.get("bias"))


def _run_cell(row: dict) -> str:
    opts = row_options(row)
    return row_label(row) + (f" ({opts})" if opts else "")


def bench_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of ``lp bench``'s table (4 label columns; free text last); the run
    column names the logit options (``train (softcap 30, bias)``)."""
    head = ["run", "shape", "dtype", "provider", "ms", "floor ms", "x floor", "MiB", "mem/mat"]
    keys = []
    if any(r.get("err_loss") is not None for r in rows):
        head.append("err loss")
        keys.append("err_loss")
    if any(r.get("err_divergence") is not None for r in rows):
        head.append("err div")
        keys.append("err_divergence")
    if any(r["mode"] != "distill" for r in rows):
        head += ["err logprob", "maxabs lp"]
        keys += ["err_logprob", "maxabs_logprob"]
    if any(r.get("err_entropy") is not None for r in rows):
        head.append("err entropy")
        keys.append("err_entropy")
    head += ["err grad_h", "err grad_w"]
    keys += ["err_grad_hidden", "err_grad_weight"]
    if any(r.get("err_grad_bias") is not None for r in rows):
        head.append("err grad_b")
        keys.append("err_grad_bias")
    head.append("note")
    base = {
        (_run_cell(r), r["shape"], r["dtype"]): r
        for r in rows
        if r["provider"] == "materialized" and _ok(r)
    }
    cells = []
    for r in rows:
        lead = [_run_cell(r), r["shape"], r["dtype"], r["provider"]]
        if not _ok(r):
            cells.append([*lead, *["-"] * (len(head) - 5), _why(r)])
            continue
        mat = base.get((lead[0], r["shape"], r["dtype"]))
        ratio = r["peak_bytes"] / mat["peak_bytes"] if mat and mat["peak_bytes"] else None
        cells.append(
            [
                *lead,
                f"{r['ms']:.2f}",
                _fmt(r["floor_ms"], ".2f"),
                _fmt(r["x_floor"], ".3f"),
                f"{r['peak_bytes'] / 2**20:.2f}",
                _fmt(ratio, ".2f"),
                *[_fmt(r.get(k), ".2e") for k in keys],
                _why(r),
            ]
        )
    return head, cells


def md_table(head: list[str], cells: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in cells]
    return "\n".join(lines)


def _grid(rows: list[dict], cell, label) -> tuple[list[str], list[list[str]]]:
    """Providers (by ``label(row)``) down, shapes across, ``cell(row)`` in each cell."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    labels = list(dict.fromkeys(label(r) for r in rows))
    at = {(label(r), r["shape"]): r for r in rows}
    cells = [
        [lab, *(cell(at[(lab, s)]) if (lab, s) in at else "" for s in shapes)] for lab in labels
    ]
    return ["provider", *shapes], cells


def _status(row: dict) -> str | None:
    if row.get("error"):
        return "OOM" if row["error"].startswith("OOM") else "error"
    if row.get("skipped"):
        return "-"
    return None


def _run_key(row: dict) -> tuple:
    """The run a row belongs to: one time table each."""
    return row["mode"], row["entropy"], row_label(row), row["dtype"], row_options(row)


def _what(mode: str, entropy: bool, run: str) -> str:
    """What a run's step computes, for its table's title (``run``: its :func:`row_label`)."""
    if mode == "loss":
        return f"{LOSS_TITLE} + entropy bonus" if entropy else LOSS_TITLE
    if mode == "distill":
        return run.removeprefix("distill ")
    return "logprob + entropy" if entropy else "logprob"


def markdown(doc: dict) -> str:
    """The markdown tables of one ``bench.json`` (see the module docstring)."""
    env, rows = doc.get("env", {}), doc["rows"]
    cuda = env.get("device") == "cuda"
    device = env.get("gpu") or env.get("device_name") or env.get("device") or "?"
    out = [
        f"**{device}**, torch {env.get('torch', '?')}, triton {env.get('triton') or '-'}, "
        f"commit {env.get('commit', '?')}, {env.get('date', '?')}",
        "",
    ]
    if card_line(env):
        out[1:1] = ["", f"Card: {card_line(env)}"]
    runs = list(dict.fromkeys(_run_key(r) for r in rows))
    multi_dtype = len({run[3] for run in runs}) > 1
    option_sets = list(dict.fromkeys(run[4] for run in runs))
    multi_options = len(option_sets) > 1
    # one set of logit options for the whole file: named in the memory and error titles
    shared = f" ({option_sets[0]})" if not multi_options and option_sets[0] else ""
    footnotes = set()

    def time_cell(r: dict) -> str:
        status = _status(r)
        if status is not None:
            return status
        text = f"{r['x_floor']:.2f}" if r.get("x_floor") is not None else f"{r['ms']:.1f} ms"
        if r.get("note") and r["mode"] != "distill":  # distill's notes: no entropy involved
            footnotes.add(LOGPROB_ONLY)
            text += LOGPROB_ONLY
        return text

    for mode, entropy, run, dtype, opts in runs:
        sel = [r for r in rows if _run_key(r) == (mode, entropy, run, dtype, opts)]
        what = _what(mode, entropy, run)
        count = FLOOR_MATMULS[mode]
        floor = f"{count} matmul{'s' if count > 1 else ''}"
        unit = f"x floor ({floor})" if cuda else "ms (CPU: no floor)"
        title = f"{mode}, {what}{f', {dtype}' if multi_dtype else ''}"
        title += f"{f', {opts}' if opts else ''}: {unit}"
        head, cells = _grid(sel, time_cell, lambda r: r["provider"])
        out += [f"**{title}**", "", md_table(head, cells), ""]
    if footnotes:
        out += [f"{LOGPROB_ONLY} logprob only: the provider has no entropy.", ""]

    def label(r: dict) -> str:
        tag = row_label(r) + (f", {r['dtype']}" if multi_dtype else "")
        if multi_options and row_options(r):
            tag += f", {row_options(r)}"
        return f"{r['provider']} ({tag})"

    unit, scale = ("GiB", 2**30) if cuda else ("MiB", 2**20)

    def mem_cell(r: dict) -> str:
        status = _status(r)
        return status if status is not None else f"{r['peak_bytes'] / scale:.2f}"

    head, cells = _grid(rows, mem_cell, label)
    out += [f"**peak memory above the inputs, {unit}{shared}**", "", md_table(head, cells), ""]

    def err_cell(r: dict) -> str:
        status = _status(r)
        if status is not None:
            return status
        errs = [r[k] for k in ERROR_KEYS if k != "maxabs_logprob" and r.get(k) is not None]
        return f"{max(errs):.1e}" if errs else "-"

    ref = "fp32" if cuda else "fp64"
    head, cells = _grid(rows, err_cell, label)
    out += [
        f"**worst relative error against the {ref} reference{shared}** ("
        + ("loss, " if any(r["mode"] == "loss" or r.get("err_loss") for r in rows) else "")
        + ("divergence, " if any(r["mode"] == "distill" for r in rows) else "")
        + "logprob, entropy, grad_hidden, grad_weight"
        + (", grad_bias" if any(r.get("bias") for r in rows) else "")
        + ")",
        "",
        md_table(head, cells),
    ]
    failed = [r for r in rows if r.get("error")]
    if failed:
        out += ["", "Errors:", ""]
        out += [f"- {label(r)} {r['shape']}: {r['error']}" for r in failed]
    return "\n".join(out) + "\n"
