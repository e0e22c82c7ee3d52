"""The steady-state warm-up of ``lp bench`` (bench.steady_warmup), on CPU and over gloo."""

from __future__ import annotations

import time

from lp_kernels.bench import steady_warmup


def _counted(seconds: float):
    calls = []

    def fn():
        calls.append(None)
        if seconds:
            time.sleep(seconds)

    return fn, calls


def test_steady_warmup_counts_calls_that_last_warm_s():
    slow, calls = _counted(0.005)
    count = steady_warmup(slow, 1, 0.05, device="cpu")
    assert len(calls) == 2  # one call to compile / allocate, one timed
    assert 1 <= count <= 10  # each call takes >= 5 ms: at most 10 fill 50 ms
    fast, _ = _counted(0.0)
    assert steady_warmup(fast, 1, 0.01, device="cpu") >= 100  # microseconds per call
    assert steady_warmup(slow, 25, 0.05, device="cpu") == 25  # never below `warmup`


def test_steady_warmup_off_runs_nothing():
    fn, calls = _counted(0.0)
    assert steady_warmup(fn, 3, 0.0, device="cpu") == 3
    assert calls == []


def _tp_rank(rank: int, world_size: int) -> tuple[float, int]:
    """(this rank's own count, the count it returns)."""
    import lp_kernels.bench as bench

    own, real = [], bench._all_ranks_max

    def spy(x, device):
        own.append(x)
        return real(x, device)

    bench._all_ranks_max = spy
    # rank 0's calls take 10x longer, so alone it would warm up with ~10x fewer calls
    fn, _ = _counted(0.02 if rank == 0 else 0.002)
    count = steady_warmup(fn, 1, 0.1, tp=world_size, device="cpu")
    return own[0], count


def test_steady_warmup_gives_every_rank_the_same_count(rank_runner):
    """Under TP the warm-up calls hold collectives: every rank runs the largest count."""
    (own0, count0), (own1, count1) = rank_runner(_tp_rank, 2, timeout=90)
    assert own0 < own1  # the ranks disagreed on their own ...
    assert count0 == count1 == max(own0, own1)  # ... and agree after the exchange
