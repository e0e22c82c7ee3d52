"""The repository's lp-kernels example runs, learns, and starts each update at ratio 1."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_step.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="the examples/ folder of the repository")
def test_grpo_example_ratio_starts_at_one_and_reward_rises():
    spec = importlib.util.spec_from_file_location("grpo_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        module.main(["--steps", "8"])
    rows = [line.split() for line in text.getvalue().splitlines()[1:]]
    assert len(rows) == 8, text.getvalue()
    reward = [float(r[1]) for r in rows]
    ratio_dev = [float(r[3]) for r in rows]
    assert ratio_dev == [0.0] * 8, text.getvalue()  # rollout and update log-probs: same bits
    assert sum(reward[-3:]) > sum(reward[:3]) + 0.1, text.getvalue()
