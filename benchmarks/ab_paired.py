"""Paired A/B of lp-kernels trees in one process: this checkout's kernels against older
revisions, per logit option set and shape, bits first, then time.

A kernel change worth 1-3 % of a step is inside the spread of separate ``lp bench`` runs
on a board at its power limit (docs/benchmarks.md, "Softcap and an LM-head bias"). Here
every tree is imported once into the same process: this checkout's ``lp_kernels`` and,
for each older revision, a copy of its ``lp_kernels`` package renamed ``lp_kernels_NAME``
(``prepare`` makes it with ``git archive``, here: a device's copied tree has no history;
``_ab_trees`` is git-ignored, so a device call names it among the paths it carries).

``run`` then, per shape: runs one train step (``linear_logprob`` forward, backward with a
per-token upstream gradient; with entropy, one on it too) of every (set, tree) on the same
inputs and compares each tree's outputs and gradients with the first tree's by
``torch.equal``; then times them in rounds, every (set, tree) once per round
(``--reps`` queued steps after a warm-up, their median) in an order that rotates from
round to round. It prints, per set, the median over rounds of each tree's time over the
first tree's in the same round, and each tree's cost of the set over its own plain step.

    python benchmarks/ab_paired.py prepare REV NAME [--dir _ab_trees]
    python benchmarks/ab_paired.py run --trees NAME[:set+set][,NAME2...] [--dir _ab_trees]
        [--shapes S1,S2,S3,S4] [--sets plain,bias,cap,both,ent,both_ent] [--rounds 6]
        [--reps 5] [--backend triton] [--out f.json]

``--trees base,mid:bias``: ``base`` runs every set, ``mid`` only ``bias``; this checkout
(``new``) runs every set. The first tree is the reference of the bits and the ratios.
Sets: ``plain``, ``bias`` (a bf16 bias, ``lp_bench.protocol.make_bias``), ``cap``
(softcap 30), ``both``, ``ent`` (entropy, plain), ``both_ent``. A tree that skips
``plain`` has its costs over this checkout's plain step.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

SETS = {  # name -> (bias, softcap, entropy)
    "plain": (False, False, False),
    "bias": (True, False, False),
    "cap": (False, True, False),
    "both": (True, True, False),
    "ent": (False, False, True),
    "both_ent": (True, True, True),
}
SOFTCAP = 30.0
PACKAGE = "packages/lp-kernels/src/lp_kernels"


def prepare(rev: str, name: str, folder: Path) -> Path:
    """Copy ``rev``'s ``lp_kernels`` to ``folder / lp_kernels_NAME`` with every reference to
    the package renamed (it then imports beside this checkout's); returns the copy."""
    if not name.isidentifier():
        raise ValueError(f"name must be a Python identifier, got {name!r}")
    dest = folder / f"lp_kernels_{name}"
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, PACKAGE],
        check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
    ).stdout  # fmt: skip
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    word = re.compile(r"\blp_kernels\b")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = Path(member.name).relative_to(PACKAGE)
            data = tar.extractfile(member).read()
            if rel.suffix == ".py":
                data = word.sub(f"lp_kernels_{name}", data.decode()).encode()
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
    return dest


def parse_trees(spec: str, sets: list[str]) -> list[tuple[str, list[str]]]:
    """``base,mid:bias+cap`` -> [("base", sets), ("mid", ["bias", "cap"])]."""
    out = []
    for item in spec.split(","):
        name, _, only = item.partition(":")
        chosen = only.split("+") if only else list(sets)
        unknown = [s for s in chosen if s not in sets]
        if unknown or not name.isidentifier():
            raise ValueError(f"--trees: bad item {item!r} (sets must be among {sets})")
        out.append((name, chosen))
    if out and out[0][1] != list(sets):
        raise ValueError(f"--trees: the first tree ({out[0][0]}) is the reference: every set")
    return out


def load_trees(spec: list[tuple[str, list[str]]], folder: Path) -> dict:
    """name -> (module, sets) for the prepared trees, then ``new``: this checkout's."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    mods = {n: (importlib.import_module(f"lp_kernels_{n}"), s) for n, s in spec}
    import lp_kernels

    mods["new"] = (lp_kernels, None)
    return mods


def step(mod, inputs: dict, set_name: str, backend: str):
    """One train step of ``set_name`` through tree ``mod``; the outputs and gradients."""
    has_bias, has_cap, has_ent = SETS[set_name]
    hidden, weight, bias = inputs["hidden"], inputs["weight"], inputs["bias"]
    for x in (hidden, weight, bias):
        x.grad = None
    kw = {"bias": bias} if has_bias else {}
    out = mod.linear_logprob(
        hidden, weight, inputs["targets"], softcap=SOFTCAP if has_cap else None,
        backend=backend, return_entropy=has_ent, **kw,
    )  # fmt: skip
    import torch

    if has_ent:
        torch.autograd.backward([out.logprob, out.entropy], [inputs["g_lp"], inputs["g_ent"]])
    else:
        torch.autograd.backward([out.logprob], [inputs["g_lp"]])
    vals = [out.logprob] + ([out.entropy] if has_ent else []) + [hidden.grad, weight.grad]
    return vals + ([bias.grad] if has_bias else [])


def check_bits(mods: dict, inputs: dict, sets: list[str], backend: str) -> dict:
    """set -> {tree: equal to the first tree's outputs and gradients (torch.equal)}."""
    import torch

    ref_name = next(iter(mods))
    result = {}
    for s in sets:
        ref = [t.detach().clone() for t in step(mods[ref_name][0], inputs, s, backend)]
        result[s] = {}
        for name, (mod, only) in list(mods.items())[1:]:
            if only is not None and s not in only:
                continue
            got = step(mod, inputs, s, backend)
            result[s][name] = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    return result


def make_step_inputs(n: int, h: int, v: int, device: str = "cuda") -> dict:
    """``lp bench``'s inputs of one shape, a bias and an entropy gradient; leaves need grad."""
    import torch

    from lp_bench.protocol import make_bias, make_inputs

    hidden, weight, targets, g_lp = make_inputs(n, h, v, device=device)
    bias = make_bias(v, device=device)
    for x in (hidden, weight, bias):
        x.requires_grad_()
    g_ent = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(g_lp.device) * 0.1
    return dict(hidden=hidden, weight=weight, targets=targets, g_lp=g_lp, g_ent=g_ent, bias=bias)


def time_rounds(mods: dict, inputs: dict, sets: list[str], args) -> dict:
    """(set, tree) -> per-round median ms (``lp_bench.timing.paired_rounds``)."""
    from lp_bench.timing import paired_rounds

    fns = {}
    for s in sets:
        for name, (mod, only) in mods.items():
            if only is None or s in only:
                fns[(s, name)] = lambda mod=mod, s=s: step(mod, inputs, s, args.backend)
    return paired_rounds(fns, args.rounds, args.reps, 0.6)


def summarize(runs: dict, mods: dict) -> dict:
    """``set/tree`` -> its median ms, its paired ratio to the first tree, its cost over
    plain (this checkout's plain step for a tree that skips plain)."""
    ref = next(iter(mods))
    paired = {}
    for (s, name), times in runs.items():
        base = runs[(s, ref)]
        plain = runs.get(("plain", name)) or runs.get(("plain", "new"))
        paired[f"{s}/{name}"] = {
            "median_ms": statistics.median(times),
            "vs_" + ref: statistics.median(t / b - 1 for t, b in zip(times, base, strict=True)),
            "over_plain": None if s == "plain" or plain is None
            else statistics.median(t / p - 1 for t, p in zip(times, plain, strict=True)),
        }  # fmt: skip
    return paired


def run(args) -> None:
    import torch

    from lp_bench.protocol import parse_shapes

    if not torch.cuda.is_available():
        raise SystemExit("run: needs a CUDA GPU (prepare works anywhere)")
    sets = args.sets.split(",")
    for s in sets:
        if s not in SETS:
            raise SystemExit(f"--sets: unknown set {s!r} (known: {', '.join(SETS)})")
    mods = load_trees(parse_trees(args.trees, sets), Path(args.dir))
    result = {}
    for shape, n, h, v in parse_shapes(args.shapes):
        inputs = make_step_inputs(n, h, v)
        bits = check_bits(mods, inputs, sets, args.backend)
        print(shape, "bits equal to", next(iter(mods)), bits, flush=True)
        rows = summarize(time_rounds(mods, inputs, sets, args), mods)
        result[shape] = {"bits": bits, "rows": rows}
        for key, row in rows.items():
            ratio = row[f"vs_{next(iter(mods))}"]
            cost = (
                ""
                if row["over_plain"] is None
                else f"  over plain {100 * row['over_plain']:+.2f} %"
            )
            print(f"  {key:18s} {row['median_ms']:9.3f} ms  {100 * ratio:+.2f} %{cost}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        del inputs
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="copy REV's lp_kernels as lp_kernels_NAME")
    pp.add_argument("rev")
    pp.add_argument("name")
    pp.add_argument("--dir", default="_ab_trees")
    pr = sub.add_parser("run", help="bits, then paired rounds (CUDA)")
    pr.add_argument("--trees", required=True)
    pr.add_argument("--dir", default="_ab_trees")
    pr.add_argument("--shapes", default="S1,S2,S3,S4")
    pr.add_argument("--sets", default=",".join(SETS))
    pr.add_argument("--rounds", type=int, default=6)
    pr.add_argument("--reps", type=int, default=5)
    pr.add_argument("--backend", default="triton")
    pr.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.rev, args.name, Path(args.dir)))
    else:
        run(args)


if __name__ == "__main__":
    main()
