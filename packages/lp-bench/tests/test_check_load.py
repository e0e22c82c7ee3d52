"""`lp check`'s gloo TP checks pass on a saturated CPU: rank start-up is not timed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lp_bench import check

WORK_TIMEOUT_S = 20.0


@pytest.mark.slow  # about a minute on 2 cores
def test_tp_check_passes_with_the_cpu_saturated():
    """Three busy loops on this 2-core machine for the duration of one check_tp call.

    The ranks' start-up (spawn, import torch, a first call, the process group) then takes
    far longer than the work timeout given here; only the work is timed.
    """
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        start = time.monotonic()
        res = check.check_tp(WORK_TIMEOUT_S, deterministic=True)
        took = time.monotonic() - start
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert res.passed, res
    assert "all 5 equal to TP=1" in res.detail
    startup = float(res.detail.split("start-up ")[1].split(" s")[0])
    print(f"check_tp under load: {took:.1f} s, of which rank start-up {startup:.0f} s")
    # Only meaningful when start-up outlasted the work timeout (with the start-up timed,
    # as before, this check would have failed): say so when the machine was not that busy.
    if startup <= WORK_TIMEOUT_S:
        pytest.skip(f"start-up took only {startup:.0f} s: the load did not slow it enough")


def test_tp_startup_failure_is_reported_at_once(monkeypatch):
    """A rank that dies while starting fails the check without waiting out the allowance."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"TP rank \d failed: UnpicklingError"):
        check.run_tp_ranks(b"not a pickle", 2, timeout=5.0, startup=600.0)
    assert time.monotonic() - start < 300
