"""Where one train step of the triton backend spends its time, kernel by kernel (GPU).

Per shape: the step's wall time from idle and queued behind ~20 ms of GPU work (the host's
work before the first kernel hidden, as in a training loop), the host time to enqueue it;
the same for the forward alone and for one GEMM of the floor; then one profiled step
(torch.profiler): the GPU's busy time, the largest idle gaps between kernels and the busy
time per kernel name. On CPU it runs a tiny shape through the Triton interpreter (a smoke
test: CPU op times only)::

    python benchmarks/profile_step.py [--shapes S1,S4] [--det] [--softcap 30] [--bias]
        [--host] [--trace DIR] [--out step.json]
    torchrun --nproc-per-node P benchmarks/profile_step.py --tp P --shapes S2

``--host`` adds a cProfile of the forward and of the step (the Python functions with the
most host time of their own); ``--tp P`` profiles one rank's step of the head split P ways
(``lp_bench.protocol.tp_shard``), every rank's figures written by rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU_SHAPE = ("tiny", 64, 32, 1000)


@dataclasses.dataclass
class Problem:
    """One shape's inputs (leaves that require grad) and ``linear_logprob``'s options."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    grad_out: torch.Tensor
    bias: torch.Tensor | None
    kwargs: dict  # tp_group / vocab_start / vocab_size, softcap, bias, deterministic...

    def forward(self):
        from lp_kernels import linear_logprob

        return linear_logprob(
            self.hidden, self.weight, self.targets, backend="triton", validate=False,
            **self.kwargs,
        )  # fmt: skip

    def step(self) -> None:
        """Forward, then backward of logprob with the per-token upstream gradient."""
        self.hidden.grad = self.weight.grad = None
        if self.bias is not None:
            self.bias.grad = None
        self.forward().logprob.backward(self.grad_out)


def make_problem(n: int, h: int, v: int, device: str, det: bool, args) -> Problem:
    """``lp bench``'s inputs of a shape (this rank's shard under TP), with the options."""
    import torch
    import torch.distributed as dist

    from lp_bench.protocol import make_inputs, tile_arg, tp_shard

    hidden, weight, targets, grad_out = make_inputs(n, h, v, device=device)
    kwargs: dict = {"deterministic": det}
    if dist.is_initialized():
        weight, start = tp_shard(weight, dist.get_world_size(), dist.get_rank())
        kwargs.update(tp_group=dist.group.WORLD, vocab_start=start, vocab_size=v)
    if det:
        kwargs["deterministic_tile"] = tile_arg(args.det_tile, v)
    if args.softcap is not None:
        kwargs["softcap"] = args.softcap
    bias = None
    if args.bias:  # a bias of the shard's rows, in the weight's dtype
        gen = torch.Generator(device=device).manual_seed(1)
        b = torch.randn(weight.shape[0], device=device, generator=gen)
        bias = kwargs["bias"] = b.to(weight.dtype).requires_grad_()
    return Problem(
        hidden.requires_grad_(), weight.requires_grad_(), targets, grad_out, bias, kwargs
    )


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _wall_ms(fn: Callable, device: str, reps: int = 3) -> float:
    from lp_bench.timing import time_cpu, time_cuda

    timer = time_cuda if device == "cuda" else time_cpu
    return statistics.median(timer(fn, warmup=1, reps=reps))


def _host_ms(fn: Callable, device: str, reps: int = 3) -> float:
    """Host time to enqueue one call (no synchronization inside): when it is close to the
    wall time, the call is launch-bound and the GPU waits on the host."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def _queued_ms(fn: Callable, device: str, reps: int = 3) -> float:
    """Wall time of one call queued behind ~20 ms of GPU sleep, so that the host's work
    before the first kernel is hidden (as in a training step, where the host runs ahead)."""
    if device != "cuda":
        return float("nan")
    import torch

    from lp_bench.timing import time_cuda

    def sleep():
        torch.cuda._sleep(40_000_000)  # cycles, ~20 ms

    return statistics.median(time_cuda(fn, warmup=0, reps=reps, before=sleep))


def _host_profile(fn: Callable, device: str, calls: int = 20, top: int = 15) -> list[dict]:
    """The functions with the most host time of their own (cProfile ``tottime``) over
    ``calls`` calls made back to back after a warm-up call, per call in microseconds."""
    import cProfile
    import pstats

    fn()
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    _sync(device)
    rows = [
        {
            "function": f"{os.path.basename(file)}:{line}({func})",
            "own_us": tt / calls * 1e6,
            "cum_us": ct / calls * 1e6,
            "calls": nc / calls,
        }
        for (file, line, func), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def _gaps(prof, top: int = 8) -> list[dict]:
    """The largest idle gaps between consecutive GPU activities of the profiled step, with
    the activities on either side (where the GPU waited)."""
    import torch

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


def _kernel_times(prof, device: str) -> tuple[dict[str, float], dict[str, int]]:
    """Busy milliseconds and calls per kernel name (CPU: per top-level op)."""
    import torch

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
    return per_name, calls


def profile_shape(name: str, n: int, h: int, v: int, device: str, det: bool, args) -> dict:
    """Every figure of one shape and mode (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    prob = make_problem(n, h, v, device, det, args)

    def fwd() -> None:
        prob.forward()

    def gemm() -> None:  # one GEMM of the floor, timed the same ways
        prob.hidden.detach() @ prob.weight.detach().T

    figures = {}
    for fn, wall, queued, host in (
        (prob.step, "wall_ms", "queued_wall_ms", "host_ms"),
        (fwd, "fwd_wall_ms", "fwd_queued_ms", "fwd_host_ms"),
        (gemm, "gemm_wall_ms", "gemm_queued_ms", None),
    ):
        figures[wall], figures[queued] = _wall_ms(fn, device), _queued_ms(fn, device)
        if host:
            figures[host] = _host_ms(fn, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        prob.step()
        _sync(device)
    if args.trace and device == "cuda":
        rank = f"-rank{dist.get_rank()}" if dist.is_initialized() else ""
        prof.export_chrome_trace(f"{args.trace}/{name}-{'det' if det else 'default'}{rank}.json")
    per_name, calls = _kernel_times(prof, device)
    busy = sum(per_name.values())
    host_rows = {}
    if args.host:
        with torch.no_grad():
            host_rows["fwd"] = _host_profile(fwd, device)
        host_rows["step"] = _host_profile(prob.step, device)
    return {
        "shape": name, "N": n, "H": h, "V": v, "deterministic": det, **figures,
        "busy_ms": busy, "idle_ms": figures["wall_ms"] - busy,
        "gaps": _gaps(prof) if device == "cuda" else [],
        "kernels": [
            {"name": k, "ms": ms, "calls": calls[k]}
            for k, ms in sorted(per_name.items(), key=lambda kv: -kv[1])
        ],
        "host_profile": host_rows,
    }  # fmt: skip


def report(r: dict) -> None:
    """One shape's figures, printed."""
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
            print(f"   {f['own_us']:9.1f} {f['cum_us']:9.1f} {f['calls']:6.1f}  {f['function']}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="S1,S4", help="S1-S6 or NxHxV (GPU)")
    ap.add_argument("--det", action="store_true", help="also profile deterministic=True")
    ap.add_argument(
        "--det-tile", default="128", help="deterministic_tile of --det: an int, or tpN (e.g. tp8)"
    )
    ap.add_argument("--softcap", type=float, default=None, help="final-logit softcapping C")
    ap.add_argument("--bias", action="store_true", help="with an LM-head bias (and its grad)")
    ap.add_argument("--host", action="store_true", help="also cProfile the host's calls")
    ap.add_argument("--tp", type=int, default=1, help="under torchrun: the head split P ways")
    ap.add_argument("--trace", default=None, help="folder for chrome traces (GPU)")
    ap.add_argument("--out", default=None, help="JSON of every shape's figures")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # before lp_kernels is imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    from lp_bench.protocol import parse_shapes

    if args.tp > 1:
        rank = int(os.environ["LOCAL_RANK"])
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        if dist.get_world_size() != args.tp:
            raise SystemExit(f"--tp {args.tp} needs as many torchrun processes")
    shapes = parse_shapes(args.shapes) if device == "cuda" else [CPU_SHAPE]
    rows = [
        profile_shape(*shape, device, det, args)
        for shape in shapes
        for det in ((False, True) if args.det else (False,))
    ]
    if args.tp > 1:
        every = [None] * args.tp
        dist.all_gather_object(every, rows)
        rows = [r | {"tp": args.tp, "rank": k} for k, rs in enumerate(every) for r in rs]
        done = dist.get_rank() != 0
        dist.destroy_process_group()
        if done:
            return 0
    for r in rows:
        report(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
