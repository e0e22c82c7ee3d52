"""The forward statistics' kernels per option set, for Nsight Compute or queued timing (GPU).

Runs the ping-pong kernel plain, with a bias, with a softcap and with both (``pp``,
``pp_b``, ``pp_c``, ``pp_bc``; whatever ``pingpong_ok`` would pick) and the Triton kernel
with a bias and with both (``tr_b``, ``tr_bc``) on one shape: bf16 operands (weight std
0.02), an fp32 bias, softcap 30. After a warm-up that compiles everything, each runs once
inside the NVTX range ``measured`` / its name::

    ncu --clock-control none --nvtx --nvtx-include "measured/" --section SpeedOfLight \\
        --section WarpStateStats -o prof python3 benchmarks/pingpong_variants.py --shape S2

``--time``: instead, each call queued (``--rounds`` rounds, each ``--reps`` calls after
0.3 s of the same call), the median of the rounds' means in ms, one line. Alone (under
ncu) a kernel's cycles say how it schedules; queued at the board's power limit its
clock follows its power draw, which can reverse the order (docs/benchmarks.md,
"Softcap and an LM-head bias").

    python benchmarks/pingpong_variants.py [--shape S2] [--time] [--rounds 5] [--reps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import types

import torch

from lp_bench.protocol import parse_shapes
from lp_bench.timing import steady_warmup
from lp_kernels.backends.triton import forward
from lp_kernels.backends.triton.config import config_for
from lp_kernels.backends.triton.pingpong import pingpong_stats


def calls(n: int, h: int, v: int) -> dict:
    """name -> a zero-argument call of one forward-statistics kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    bias = torch.randn(v, device="cuda", generator=gen)
    pinned = config_for(hidden.device, hidden.dtype)
    on = dataclasses.replace(pinned, pingpong_max_h=h)
    off = dataclasses.replace(pinned, pingpong_max_h=0)
    out = {}
    for cap in (None, 30.0):
        p = types.SimpleNamespace(  # forward_stats's parameters of a default-mode call
            inv_temperature=1.0, max_v_local=v, return_entropy=False, ignore_index=-100,
            softcap=cap, deterministic=False,
        )  # fmt: skip
        width, splits = forward.shard_splits(v, p, pinned)
        stats = torch.empty((splits, n, 4), device="cuda")
        c = "c" if cap else ""
        for b in (None, bias):
            tag = ("b" if b is not None else "") + c
            out[f"pp_{tag}" if tag else "pp"] = lambda p=p, s=stats, w=width, b=b: pingpong_stats(
                hidden, weight, targets, 0, p, on, s, w, b
            )
        out["tr_b" + c] = lambda p=p: forward.forward_stats(
            hidden, weight, targets, 0, p, off, bias
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="S2")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    ((name, n, h, v),) = parse_shapes(a.shape)
    fns = calls(n, h, v)
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    if not a.time:
        for k, f in fns.items():
            torch.cuda.nvtx.range_push("measured")
            torch.cuda.nvtx.range_push(k)
            f()
            torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print("ran", " ".join(fns))
        return
    ms: dict[str, list[float]] = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.rounds):
        for k, f in fns.items():
            for _ in range(steady_warmup(f, 2, 0.3)):
                f()
            start.record()
            for _ in range(a.reps):
                f()
            end.record()
            torch.cuda.synchronize()
            ms[k].append(start.elapsed_time(end) / a.reps)
    print(name, " ".join(f"{k} {statistics.median(x):.3f}" for k, x in ms.items()))


if __name__ == "__main__":
    main()
