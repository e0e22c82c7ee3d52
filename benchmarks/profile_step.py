"""Where does one forward + backward step of the triton backend spend its time, kernel by
kernel? (GPU; the issue 3 gap between the sum of the phases and the whole step.)

    python benchmarks/profile_step.py --shapes S1,S4 [--det] [--softcap C] [--bias]
        [--out step.json]

For each shape: the step's wall time (CUDA events, median of 3) started on an idle GPU
and queued behind ~20 ms of GPU work (the host's work before the first kernel hidden, as
in a training loop), the host time to enqueue it; the same three for the forward alone;
one GEMM of the floor timed both ways; the time the GPU was busy (the sum of kernel and
memcpy/memset durations from torch.profiler, one profiled step after warm-up), the
largest idle gaps between kernels, and the busy time per kernel name, largest first.
``--trace DIR`` also writes chrome traces. On CPU it runs a tiny shape through the
interpreter, as a smoke test of the script (CPU op times only).

``--host`` adds a cProfile of the forward alone and of the step (20 calls each, no
synchronization between them): the Python functions with the most host time of their
own per call, to find what the host does before the first kernel.

``--tp P`` under ``torchrun --nproc-per-node P`` (NCCL; gloo on CPU) profiles one rank's
step of the head split P ways on Megatron's layout (``lp_bench.protocol.tp_shard``): each
rank's figures, collectives included, are printed and written by rank 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lp_bench.protocol import make_inputs, parse_shapes, tile_arg, tp_shard
from lp_bench.timing import time_cpu, time_cuda
from lp_kernels import linear_logprob

DET_TILE = {"tile": "128"}  # --det-tile: an int, or tpN (bench.tile_arg, per shape)
TP: dict = {}  # --tp: linear_logprob's tp_group / vocab_start / vocab_size
LOGITS: dict = {}  # --softcap / --bias: linear_logprob's softcap and bias


def _det_kw(det: bool, vocab: int) -> dict:
    if not det:
        return {"deterministic": False}
    return {"deterministic": True, "deterministic_tile": tile_arg(DET_TILE["tile"], vocab)}


def _step(hidden, weight, targets, grad_out, det: bool):
    hidden.grad = weight.grad = None
    if LOGITS.get("bias") is not None:
        LOGITS["bias"].grad = None
    out = linear_logprob(
        hidden, weight, targets, backend="triton", validate=False,
        **_det_kw(det, TP.get("vocab_size", weight.shape[0])), **TP, **LOGITS,
    )  # fmt: skip
    out.logprob.backward(grad_out)


def _wall_ms(fn, device: str, reps: int = 3) -> float:
    timer = time_cuda if device == "cuda" else time_cpu
    return statistics.median(timer(fn, warmup=1, reps=reps))


def _host_ms(fn, device: str, reps: int = 3) -> float:
    """Host time to enqueue one step (no synchronization inside): when it is close to the
    wall time, the step is launch-bound and the GPU waits on the host."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def _queued_ms(fn, device: str, reps: int = 3) -> float:
    """Wall time of one step queued behind ~20 ms of GPU sleep, so that the host's work
    before the first kernel is hidden (as in a training step, where the host runs ahead)."""
    if device != "cuda":
        return float("nan")

    def sleep():
        torch.cuda._sleep(40_000_000)  # cycles, ~20 ms

    return statistics.median(time_cuda(fn, warmup=0, reps=reps, before=sleep))


def _host_profile(fn, device: str, calls: int = 20, top: int = 15) -> list[dict]:
    """The functions with the most host time of their own (cProfile ``tottime``) over
    ``calls`` calls made back to back after a warm-up call, per call in microseconds."""
    import cProfile
    import pstats

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [
        {
            "function": f"{os.path.basename(file)}:{line}({func})",
            "own_us": tt / calls * 1e6,
            "cum_us": ct / calls * 1e6,
            "calls": nc / calls,
        }
        for (file, line, func), (_, nc, tt, ct, _) in stats.items()
    ]
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def _gaps(prof, top: int = 8) -> list[dict]:
    """The largest idle gaps between consecutive GPU activities of the profiled step, with
    the activities on either side (where the GPU waited)."""
    evs = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    gaps = []
    for a, b in itertools.pairwise(evs):
        gap = (b.time_range.start - a.time_range.end) / 1e3
        if gap > 0.02:
            gaps.append({"ms": gap, "after": a.name[:60], "before": b.name[:60]})
    total = sum(g["ms"] for g in gaps)
    gaps.sort(key=lambda g: -g["ms"])
    summary = {"ms": total, "after": "(all gaps > 20 us)", "before": f"{len(gaps)} gaps"}
    return [summary, *gaps[:top]]


def profile_shape(
    name: str, n: int, h: int, v: int, device: str, det: bool, trace_dir: str | None = None,
    host: bool = False,
) -> dict:  # fmt: skip
    hidden, weight, targets, grad_out = make_inputs(n, h, v, device=device)
    if dist.is_initialized():
        weight, start = tp_shard(weight, dist.get_world_size(), dist.get_rank())
        TP.update(tp_group=dist.group.WORLD, vocab_start=start, vocab_size=v)
    hidden.requires_grad_()
    weight.requires_grad_()
    if "bias" in LOGITS:  # --bias: a bias of the shard's rows, in the weight's dtype
        gen = torch.Generator(device=device).manual_seed(1)
        b = torch.randn(weight.shape[0], device=device, generator=gen)
        LOGITS["bias"] = b.to(weight.dtype).requires_grad_()

    def fn():
        _step(hidden, weight, targets, grad_out, det)

    wall = _wall_ms(fn, device)
    host = _host_ms(fn, device)
    hidden_wall = _queued_ms(fn, device)

    def fwd():
        linear_logprob(
            hidden, weight, targets, backend="triton", validate=False,
            **_det_kw(det, TP.get("vocab_size", weight.shape[0])), **TP, **LOGITS,
        )  # fmt: skip

    fwd_wall, fwd_queued, fwd_host = (
        _wall_ms(fwd, device),
        _queued_ms(fwd, device),
        _host_ms(fwd, device),
    )

    def gemm():  # one GEMM of the floor, timed the same two ways
        hidden.detach() @ weight.detach().T

    gemm_wall, gemm_queued = _wall_ms(gemm, device), _queued_ms(gemm, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    if trace_dir and device == "cuda":
        rank = f"-rank{dist.get_rank()}" if dist.is_initialized() else ""
        prof.export_chrome_trace(f"{trace_dir}/{name}-{'det' if det else 'default'}{rank}.json")
    gaps = _gaps(prof) if device == "cuda" else []
    per_name: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if device == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time
        else:
            if ev.cpu_parent is not None:
                continue
            us = ev.cpu_time_total
        per_name[ev.name[:80]] += us / 1e3
        calls[ev.name[:80]] += 1
    busy = sum(per_name.values())
    kernels = sorted(per_name.items(), key=lambda kv: -kv[1])
    host_rows = {}
    if host:
        with torch.no_grad():
            host_rows["fwd"] = _host_profile(fwd, device)
        host_rows["step"] = _host_profile(fn, device)
    return {
        "host_profile": host_rows,
        "shape": name, "N": n, "H": h, "V": v, "deterministic": det, "wall_ms": wall,
        "host_ms": host, "queued_wall_ms": hidden_wall, "fwd_wall_ms": fwd_wall,
        "fwd_queued_ms": fwd_queued, "fwd_host_ms": fwd_host, "gemm_wall_ms": gemm_wall,
        "gemm_queued_ms": gemm_queued, "busy_ms": busy,
        "idle_ms": wall - busy, "gaps": gaps,
        "kernels": [{"name": k, "ms": ms, "calls": calls[k]} for k, ms in kernels],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S4")
    ap.add_argument("--det", action="store_true", help="also profile deterministic=True")
    ap.add_argument(
        "--det-tile", default="128", help="deterministic_tile of --det: an int, or tpN (e.g. tp8)"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, help="folder for chrome traces (GPU)")
    ap.add_argument("--tp", type=int, default=1, help="under torchrun: the head split P ways")
    ap.add_argument("--host", action="store_true", help="also cProfile the host's calls")
    ap.add_argument("--softcap", type=float, default=None, help="final-logit softcapping C")
    ap.add_argument("--bias", action="store_true", help="with an LM-head bias (and its grad)")
    args = ap.parse_args()
    if args.softcap is not None:
        LOGITS["softcap"] = args.softcap
    if args.bias:
        LOGITS["bias"] = None  # made per shape
    DET_TILE["tile"] = args.det_tile
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tp > 1:
        rank = int(os.environ["LOCAL_RANK"])
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        if dist.get_world_size() != args.tp:
            raise ValueError(f"--tp {args.tp} needs as many torchrun processes")
    shapes = parse_shapes(args.shapes) if device == "cuda" else [("tiny", 64, 32, 1000)]
    rows = [
        profile_shape(*s, device, det, args.trace, args.host)
        for s in shapes
        for det in ((False, True) if args.det else (False,))
    ]
    if args.tp > 1:
        every = [None] * args.tp
        dist.all_gather_object(every, rows)
        rows = [r | {"tp": args.tp, "rank": k} for k, rs in enumerate(every) for r in rs]
        done = dist.get_rank() != 0
        dist.destroy_process_group()
        if done:
            return
    for r in rows:
        mode = "det" if r["deterministic"] else "default"
        if "rank" in r:
            mode += f" TP{r['tp']} rank {r['rank']}"
        print(
            f"{r['shape']} {mode}: wall {r['wall_ms']:.2f} ms (queued {r['queued_wall_ms']:.2f}), "
            f"host enqueue {r['host_ms']:.2f} ms; forward {r['fwd_wall_ms']:.2f} ms (queued "
            f"{r['fwd_queued_ms']:.2f}, host {r['fwd_host_ms']:.2f}); one floor GEMM "
            f"{r['gemm_wall_ms']:.2f} ms (queued {r['gemm_queued_ms']:.2f}); "
            f"busy {r['busy_ms']:.2f} ms, idle {r['idle_ms']:.2f} ms"
        )
        for g in r["gaps"]:
            print(f"   gap {g['ms']:7.3f} ms  after {g['after']}  before {g['before']}")
        for k in r["kernels"][:12]:
            print(f"   {k['ms']:9.2f} ms  x{k['calls']:<4d} {k['name']}")
        for what, funcs in r["host_profile"].items():
            print(f"   host, {what} (us per call: own, cumulative; calls per call):")
            for f in funcs:
                print(
                    f"   {f['own_us']:9.1f} {f['cum_us']:9.1f} {f['calls']:6.1f}  {f['function']}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
