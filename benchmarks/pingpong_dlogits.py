"""Time the backward's d_logits kernels against one matmul, and check their bits.

One token chunk by one vocabulary chunk of a shape (``token_chunk x vocab_chunk`` of the
pinned config, H of the shape): ``backward.dlogits`` with the pinned config (the ping-pong
kernel where ``TileConfig.pingpong_max_h`` admits H) against ``pingpong_max_h = 0`` (the
Triton kernel), the bias gradient's column sums of that block (``add_column_sums``), and
``torch.mm`` of the same product (the floor). Medians of three rounds of queued calls.
Prints one line per shape and option set, and writes JSON.

    python benchmarks/pingpong_dlogits.py [--shapes S2,S4] [--reps 20] [--out f.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types

import torch
import triton

from lp_bench.protocol import SHAPES
from lp_kernels.backends.triton import backward
from lp_kernels.backends.triton.config import config_for
from lp_kernels.backends.triton.pingpong import pingpong_ok

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pingpong_fwd import timed


def run(name: str, reps: int, softcap: float | None, bias: bool) -> dict:
    _, h, v = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    pinned = config_for(torch.device("cuda"), torch.bfloat16)
    n, cols = pinned.token_chunk, min(pinned.vocab_chunk, v)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(cols, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    b = torch.randn(cols, device="cuda", generator=gen) if bias else None
    on = dataclasses.replace(pinned, pingpong_max_h=max(h, 1))
    off = dataclasses.replace(pinned, pingpong_max_h=0)
    p = types.SimpleNamespace(  # dlogits's parameters of a default-mode call
        inv_temperature=1 / 0.7, return_entropy=False, ignore_index=-100, softcap=softcap,
        deterministic=False,
    )  # fmt: skip
    assert pingpong_ok(hidden, weight, p, on)
    lse = torch.rand(n, device="cuda", generator=gen) + 12.0
    grads = (torch.randn(n, device="cuda", generator=gen), None, None)
    outs, dbs = [], []
    for _ in range(2):
        outs.append(torch.empty((n, cols), device="cuda", dtype=torch.bfloat16))
        dbs.append(torch.empty((2 * triton.cdiv(n, 128), cols), device="cuda") if bias else None)

    def call(cfg, i):
        backward.dlogits(
            hidden, weight, targets, 0, lse, None, grads, outs[i], 0, cols, p, cfg, b, dbs[i]
        )

    call(on, 0)
    call(off, 1)
    row = {
        "shape": name, "n": n, "h": h, "cols": cols, "softcap": softcap, "bias": bias,
        "bitwise": torch.equal(outs[0], outs[1]) and (not bias or torch.equal(dbs[0], dbs[1])),
        "mm_ms": timed(lambda: torch.mm(hidden, weight.T), reps),
        "triton_ms": timed(lambda: call(off, 1), reps),
        "pingpong_ms": timed(lambda: call(on, 0), reps),
    }  # fmt: skip
    if bias:
        acc = torch.zeros(cols, device="cuda")
        row["colsum_ms"] = timed(lambda: backward.add_column_sums(acc, dbs[0]), reps)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="S2,S4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.shapes.split(","):
        for softcap, bias in ((None, False), (30.0, False), (None, True), (30.0, True)):
            row = run(name, args.reps, softcap, bias)
            rows.append(row)
            extra = f"  colsum {row['colsum_ms']:.4f} ms" if bias else ""
            print(
                f"{name} cap={softcap} bias={bias}: mm {row['mm_ms']:.3f} ms  triton "
                f"{row['triton_ms']:.3f} ({row['triton_ms'] / row['mm_ms']:.3f} x)  pingpong "
                f"{row['pingpong_ms']:.3f} ({row['pingpong_ms'] / row['mm_ms']:.3f} x)  "
                f"bitwise {row['bitwise']}{extra}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
