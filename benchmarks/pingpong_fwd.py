"""Time the forward statistics' two kernels against one matmul, and check their bits.

``forward_stats`` with the ping-pong kernel at every H against the same with the Triton
kernel everywhere (``TileConfig.pingpong_max_h`` 0), and ``torch.mm(hidden, weight.T)`` of
the shape (the floor), in rounds of queued calls after a second of warm-up (CUDA events;
the median of three rounds' means). Every shape runs both kernels whatever H, to show
where each is faster; the JSON says which one the pinned config takes. Prints one line per
shape, a table, and writes JSON. ``--softcap C`` and ``--bias`` time those options (an
fp32 bias, as the op passes it to the kernels).

    python benchmarks/pingpong_fwd.py [--shapes S1,...,S6,H1536] [--reps 10] [--softcap C]
        [--bias] [--out f.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types

import torch

from lp_bench.protocol import SHAPES
from lp_bench.timing import steady_warmup
from lp_kernels.backends.triton import forward
from lp_kernels.backends.triton.config import config_for
from lp_kernels.backends.triton.pingpong import pingpong_ok, pingpong_stats

EXTRA = {"H1536": (8192, 1536, 151936), "H3072": (8192, 3072, 151936), "S6x4": (4096, 2048, 248320)}


def timed(fn, reps: int, warm_s: float = 1.0) -> float:
    """Milliseconds per call: the median of three rounds' means of ``reps`` queued calls,
    after at least ``warm_s`` seconds of the same call (steady clocks, as ``lp bench``)."""
    for _ in range(steady_warmup(fn, 3, warm_s)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return sorted(rounds)[1]


def run(name: str, reps: int, softcap: float | None = None, bias: bool = False) -> dict:
    n, h, v = {**SHAPES, **EXTRA}[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    b = torch.randn(v, device="cuda", generator=gen) if bias else None
    pinned = config_for(hidden.device, hidden.dtype)
    on = dataclasses.replace(pinned, pingpong_max_h=max(h, 1))
    off = dataclasses.replace(pinned, pingpong_max_h=0)
    p = types.SimpleNamespace(  # forward_stats's parameters of a default-mode call
        inv_temperature=1 / 0.7, max_v_local=v, return_entropy=False, ignore_index=-100,
        softcap=softcap, deterministic=False,
    )  # fmt: skip
    assert pingpong_ok(hidden, weight, p, on)
    width, splits = forward.shard_splits(v, p, pinned)
    stats = torch.empty((splits, n, 4), device="cuda")

    def pingpong():  # the kernel itself
        return pingpong_stats(hidden, weight, targets, 0, p, on, stats, width, b)

    got = pingpong().clone()
    want = forward.forward_stats(hidden, weight, targets, 0, p, off, b).clone()
    fwd = forward.forward_stats
    row = {
        "shape": name, "n": n, "h": h, "v": v, "bitwise": bool(torch.equal(got, want)),
        "pinned_takes_pingpong": pingpong_ok(hidden, weight, p, pinned),
        "mm_ms": timed(lambda: torch.mm(hidden, weight.T), reps),
        "softcap": softcap, "bias": bias,
        "triton_ms": timed(lambda: fwd(hidden, weight, targets, 0, p, off, b), reps),
        "pingpong_ms": timed(pingpong, reps),
    }  # fmt: skip
    return row


def host_us(reps: int = 300) -> dict:
    """Microseconds per forward-statistics call at a tiny shape (8 x 2048 x 32000), where
    the host's work per call (launch, descriptors) sets the pace, for both kernels."""
    import time

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(8, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(32000, 2048, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (8,), device="cuda", generator=gen)
    pinned = config_for(hidden.device, hidden.dtype)
    p = types.SimpleNamespace(
        inv_temperature=1.0, max_v_local=32000, return_entropy=False, ignore_index=-100,
        softcap=None, deterministic=False,
    )  # fmt: skip
    out = {}
    for name, cfg in (
        ("pingpong", pinned),
        ("triton", dataclasses.replace(pinned, pingpong_max_h=0)),
    ):
        for _ in range(20):
            forward.forward_stats(hidden, weight, targets, 0, p, cfg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            forward.forward_stats(hidden, weight, targets, 0, p, cfg)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out[name] = (t1 - t0) / reps * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="S1,S2,S3,S4,S5,S6")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    host = host_us()
    print("host us per call (8 x 2048 x 32000):", json.dumps(host), flush=True)
    rows = []
    for name in a.shapes.split(","):
        rows.append(run(name, a.reps, a.softcap, a.bias))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print(f"\n{'shape':6} {'H':>5} {'mm ms':>8} {'triton':>8} {'pingpong':>9} bits pinned")
    for r in rows:
        print(
            f"{r['shape']:6} {r['h']:5d} {r['mm_ms']:8.3f} {r['triton_ms'] / r['mm_ms']:7.3f}x "
            f"{r['pingpong_ms'] / r['mm_ms']:8.3f}x {'=' if r['bitwise'] else '!':>4} "
            f"{'pingpong' if r['pinned_takes_pingpong'] else 'triton'}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "host_us": host, "rows": rows}, f, indent=1)  # fmt: skip
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
