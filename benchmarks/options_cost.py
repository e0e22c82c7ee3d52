"""The cost of the logit options (softcap, an LM-head bias, both) in a train step, in paired
rounds on one GPU.

A train step is ``lp bench``'s: ``linear_logprob`` forward with the triton backend, then
backward with a per-token upstream gradient on logprob (the bench's inputs,
``lp_bench.protocol.make_inputs`` / ``make_bias``: bf16, a bf16 bias of std 1). On a board
at its power limit two runs of one step can differ by several percent, and separate
``lp bench`` runs move with the board between them. So here every option set runs in the
same process, in rounds: each round times every set once (``--reps`` queued steps, their
median), in an order that rotates from round to round, after a second of warm-up per set.
The cost of a set is the median over rounds of its time over the plain step's of the same
round (paired), beside the medians of the times themselves. Prints one line per shape and
a table; ``--out`` writes every round's times as JSON.

    python benchmarks/options_cost.py [--shapes S1,S2,S3,S4] [--sets plain,bias,cap,both]
        [--rounds 8] [--reps 5] [--softcap 30] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lp_bench.protocol import make_bias, make_inputs, parse_shapes
from lp_bench.timing import paired_rounds
from lp_kernels import linear_logprob

SETS = ("plain", "bias", "cap", "both")


def train_step(hidden, weight, targets, grad_out, bias, softcap):
    """One forward + backward of the triton backend, the leaves' gradients cleared first."""
    for x in (hidden, weight, bias):
        if x is not None:
            x.grad = None
    extra = {} if bias is None else {"bias": bias}
    out = linear_logprob(hidden, weight, targets, softcap=softcap, backend="triton", **extra)
    torch.autograd.backward([out.logprob], [grad_out])


def measure(n, h, v, sets, rounds, reps, softcap) -> dict:
    """Every round's milliseconds per option set, and the paired costs over ``plain``."""
    hidden, weight, targets, grad_out = make_inputs(n, h, v)
    bias = make_bias(v)
    for x in (hidden, weight, bias):
        x.requires_grad_()
    steps = {}
    for name in sets:
        b = bias if name in ("bias", "both") else None
        c = softcap if name in ("cap", "both") else None

        def step(b=b, c=c):
            train_step(hidden, weight, targets, grad_out, b, c)

        steps[name] = step
    # compiled, then a second of each at its steady clock (as lp bench)
    runs = paired_rounds(steps, rounds, reps, 1.0)
    row = {"runs": runs, "median_ms": {name: statistics.median(x) for name, x in runs.items()}}
    row["cost"] = {
        name: statistics.median(a / p - 1.0 for a, p in zip(runs[name], runs["plain"], strict=True))
        for name in sets if name != "plain"
    }  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="S1,S2,S3,S4")
    ap.add_argument("--sets", default=",".join(SETS), help=f"from {', '.join(SETS)}")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sets = tuple(s for s in args.sets.split(",") if s)
    if "plain" not in sets or any(s not in SETS for s in sets):
        ap.error(f"--sets: expected plain and any of {', '.join(SETS[1:])}; got {args.sets!r}")
    if not torch.cuda.is_available():
        raise SystemExit("options_cost.py times the triton backend on a CUDA GPU")
    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "softcap": args.softcap,
        "rounds": args.rounds,
        "reps": args.reps,
        "shapes": {},
    }
    for name, n, h, v in parse_shapes(args.shapes):
        row = measure(n, h, v, sets, args.rounds, args.reps, args.softcap)
        result["shapes"][name] = row
        costs = "  ".join(f"{s} {100 * c:+.2f} %" for s, c in row["cost"].items())
        print(
            f"{name} ({n}x{h}x{v}): plain {row['median_ms']['plain']:.2f} ms; {costs}", flush=True
        )
        torch.cuda.empty_cache()
    print(f"\ncost over plain, the median of {args.rounds} paired rounds "
          f"({result['device']}, softcap {args.softcap:g})")  # fmt: skip
    print("| shape | plain ms | " + " | ".join(sets[1:]) + " |")
    print("|---|---|" + "---|" * (len(sets) - 1))
    for name, row in result["shapes"].items():
        cells = " | ".join(f"{100 * row['cost'][s]:+.2f} %" for s in sets[1:])
        print(f"| {name} | {row['median_ms']['plain']:.2f} | {cells} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
