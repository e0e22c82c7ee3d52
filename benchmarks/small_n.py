"""Small token counts: where a step's time goes, eager against a CUDA graph (session 14).

At a thousand tokens a step of the triton backend is short (10 ms at H 2048, V 248k) and
made of many launches (four per 8192-column vocabulary chunk), so host work can set its
pace. For each shape and variant this times, at steady clocks:

- ``eager``: forward + backward as a trainer calls it (CUDA events around the call);
- ``graph``: the same step captured in a CUDA graph and replayed (``validate=False``):
  GPU time without the host's launch cost;
- ``host``: the host's time to issue one eager step while the GPU is kept busy (a queued
  spin ahead of it), i.e. what the launches cost on the CPU;
- ``gemm``: one grad_hidden GEMM ``C [N, H] += A [N, 8192] @ B [8192, H]`` alone, repeated
  back to back (GPU-bound), in both output tile widths (triton_linear.mm_block_n).

Variants: ``pinned``, ``nogroup`` (one vocabulary chunk per backward launch), ``before``
(that and the GEMM's 128 x 256 tile everywhere: session 13's launches) and ``vs4k``
(the forward's splits of 4096 columns instead of 8192). GPU only::

    python benchmarks/small_n.py --shapes 1024x2048x248320,S4 [--out small_n.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import lp_kernels.backends.triton_linear as tlin
from lp_kernels import linear_logprob
from lp_kernels.bench import floor_call, make_inputs, parse_shapes, steady_warmup, time_cuda

VARIANTS = {
    "pinned": {},
    "nogroup": {"group": False},
    "before": {"group": False, "narrow_cost": float("inf")},  # session 13's launches
    "vs4k": {"v_split": 4096},  # forward splits of 4096 columns (a lead: docs/benchmarks.md)
}
_BASE, _COST, _GROUP = tlin.GPU_CONFIG, tlin.NARROW_TILE_COST, tlin.chunk_group


def _apply(variant: dict) -> None:
    fields = {k: v for k, v in variant.items() if k not in ("narrow_cost", "group")}
    tlin.GPU_CONFIG = dataclasses.replace(_BASE, **fields)
    tlin.NARROW_TILE_COST = variant.get("narrow_cost", _COST)
    tlin.chunk_group = _GROUP if variant.get("group", True) else (lambda *args: 1)


def _median_ms(fn, warm_s: float, reps: int) -> float:
    warm = steady_warmup(fn, 1, warm_s)
    return statistics.median(time_cuda(fn, warmup=warm, reps=reps))


def _host_ms(fn, reps: int) -> float:
    """Host time to issue ``fn`` behind a queued GPU spin (so the host never waits)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # far longer than any step's host work
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def _graph(step):
    """``step`` captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x2048x248320,1024x2048x248320,1152x4096x151936")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, n, h, v in parse_shapes(args.shapes):
        hidden, weight, targets, grad_out = make_inputs(n, h, v)
        hl, wl = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        floor = _median_ms(floor_call(hidden, weight), args.warm_s, args.reps)
        a = torch.randn(n, 8192, device="cuda").to(torch.bfloat16)
        b = weight[:8192]
        c = torch.zeros(n, h, device="cuda")
        cfg = tlin.config_for(hidden.device, hidden.dtype)

        def step(hl=hl, wl=wl, targets=targets, grad_out=grad_out):
            hl.grad = wl.grad = None
            out = linear_logprob(hl, wl, targets, backend="triton", validate=False)
            out.logprob.backward(grad_out)

        for label in args.variants.split(","):
            _apply(VARIANTS[label])
            eager = _median_ms(step, args.warm_s, args.reps)
            host = _host_ms(step, args.reps)
            graph = _graph(step)
            replay = _median_ms(graph.replay, args.warm_s, args.reps)
            del graph
            width = tlin.mm_block_n(cfg, n, h, hidden.device)

            def gemm(c=c, a=a, b=b, cfg=cfg):
                for _ in range(10):
                    tlin._matmul_acc_(c, a, b, cfg, k_a=8192, accumulate=True)

            gemm_ms = _median_ms(gemm, args.warm_s, args.reps) / 10
            row = {
                "shape": name, "variant": label, "floor_ms": floor, "eager_ms": eager,
                "graph_ms": replay, "host_ms": host, "gemm_ms": gemm_ms, "gemm_block_n": width,
                "eager_x_floor": eager / floor, "graph_x_floor": replay / floor,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        _apply({})
        del hidden, weight, hl, wl, a, b, c
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(
        f"{'shape':18} {'variant':8} {'floor':>7} {'eager':>7} {'graph':>7} {'host':>7} "
        f"{'gemm':>7} {'width':>5} {'eager x':>7} {'graph x':>7}"
    )
    for r in rows:
        print(
            f"{r['shape']:18} {r['variant']:8} {r['floor_ms']:7.2f} {r['eager_ms']:7.2f} "
            f"{r['graph_ms']:7.2f} {r['host_ms']:7.2f} {r['gemm_ms']:7.3f} "
            f"{r['gemm_block_n']:5d} {r['eager_x_floor']:7.3f} {r['graph_x_floor']:7.3f}"
        )


if __name__ == "__main__":
    main()
