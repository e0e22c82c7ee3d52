"""The one timing harness: CUDA events or perf_counter, steady-state warm-up, the floor.

Every provider and the floor are timed by these functions, in the same process, so that
``x floor`` compares like with like. The benchmark scripts in ``benchmarks/`` import them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int,
    reps: int,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (CUDA events).

    ``before`` runs ahead of each timed call, outside the timing (e.g. queueing GPU work
    so that the call's host work before its first kernel is hidden).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_cpu(fn: Callable[[], object], *, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (``time.perf_counter``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def floor_call(hidden: torch.Tensor, weight: torch.Tensor, matmuls: int = 4) -> Callable[[], None]:
    """The floor's work as one call: ``matmuls`` back-to-back ``hidden @ weight.T``.

    Four for a training step (forward logits, backward recompute, two gradient GEMMs), one
    for a forward-only pass.
    """
    if matmuls < 1:
        raise ValueError(f"floor_call: matmuls must be >= 1, got {matmuls}")

    def floor() -> None:
        for _ in range(matmuls):
            hidden @ weight.T

    return floor


def all_ranks_max(x: float | None, device: str) -> float | None:
    """The maximum of ``x`` over the ranks of the default group (the slowest rank sets a
    TP step's time); None stays None."""
    import torch.distributed as dist

    if x is None:
        return None
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def steady_warmup(
    fn: Callable[[], object], warmup: int, warm_s: float, tp: int = 1, device: str = "cuda"
) -> int:
    """Warm-up calls for :func:`time_cuda` such that they last at least ``warm_s`` seconds
    (and are at least ``warmup``).

    A GPU at its power limit runs sustained work at a lower clock than a burst after idle,
    so each call is timed once its clock has settled under its own load. Runs ``fn`` twice
    to time it (the first call compiles and allocates). Under TP (``tp > 1``, every rank of
    the default group calls this) every rank gets the largest count, so that collectives
    inside ``fn`` stay paired.
    """
    if warm_s <= 0:
        return warmup
    fn()
    timer = time_cuda if device == "cuda" else time_cpu
    ms = statistics.median(timer(fn, warmup=0, reps=1))
    count = max(warmup, math.ceil(warm_s * 1e3 / max(ms, 1e-3)))
    if tp > 1:
        count = int(all_ranks_max(float(count), device))
    return count


def paired_rounds(
    calls: dict, rounds: int, reps: int, warm_s: float, device: str = "cuda"
) -> dict[object, list[float]]:
    """key -> one figure per round for each of ``calls`` (zero-argument callables): a
    round times every call once, the median of ``reps`` queued calls, in an order that
    rotates by one from round to round. Each call first runs :func:`steady_warmup`'s count
    for ``warm_s`` seconds (the first one compiles).

    A board at its power limit drifts by a few percent between runs; a ratio of two calls
    within the same round (then its median over rounds) cancels that drift, which ratios of
    separate runs' medians do not."""
    timer = time_cuda if device == "cuda" else time_cpu
    for fn in calls.values():
        for _ in range(steady_warmup(fn, 1, warm_s, device=device)):
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    keys = list(calls)
    runs: dict[object, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        j = r % len(keys) if keys else 0
        for k in keys[j:] + keys[:j]:
            runs[k].append(statistics.median(timer(calls[k], warmup=0, reps=reps)))
    return runs
