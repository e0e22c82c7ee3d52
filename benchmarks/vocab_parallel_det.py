"""Cost of ``vocab_parallel_logprob(deterministic=True)`` against the default mode, one
process, on materialized logits (forward + backward, per-token upstream gradients).

    python benchmarks/vocab_parallel_det.py --shapes S2,S4 [--tiles 128,4096] [--out f.json]

Times are medians of ``--reps`` calls after one warm-up (CUDA events around the whole
step). The logits are ``[N, V]`` bf16 from random values (time does not depend on them).
On CPU it runs at a tiny shape only, as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lp_kernels import vocab_parallel_logprob

SHAPES = {"S2": (16384, 248320), "S4": (16384, 62080), "tiny": (37, 1000)}


def _step(logits, targets, g, **kw):
    x = logits.detach().requires_grad_()
    out = vocab_parallel_logprob(x, targets, return_entropy=True, validate=False, **kw)
    (out.logprob * g + out.entropy * g.flip(0)).sum().backward()
    return x.grad


def _time(fn, reps: int, device: str) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _shape_rows(name: str, tiles: list[int], reps: int, device: str) -> list[dict]:
    n, v = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, v, device=device, generator=gen).mul_(3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    g = torch.linspace(-1, 1, n, device=device)
    rows = [{"shape": name, "mode": "default", "tile": None}]
    rows += [{"shape": name, "mode": "deterministic", "tile": t} for t in tiles]
    for r in rows:
        kw = {"deterministic": True, "deterministic_tile": r["tile"]} if r["tile"] else {}
        r["ms"] = _time(lambda kw=kw: _step(logits, targets, g, **kw), reps, device)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="S2,S4")
    ap.add_argument("--tiles", default="128,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.shapes.split(",") if device == "cuda" else ["tiny"]
    tiles = [int(t) for t in args.tiles.split(",")]
    rows = [r for name in names for r in _shape_rows(name, tiles, args.reps, device)]
    print("| shape | mode | tile | ms | x default |")
    print("|---|---|---|---|---|")
    for r in rows:
        ref = next(b["ms"] for b in rows if b["shape"] == r["shape"] and b["mode"] == "default")
        print(f"| {r['shape']} | {r['mode']} | {r['tile'] or '-'} | {r['ms']:.2f} | "
              f"{r['ms'] / ref:.2f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
