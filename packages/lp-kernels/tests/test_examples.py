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


TP_EXAMPLE = EXAMPLE.parent / "tp_invariance.py"


@pytest.mark.skipif(not TP_EXAMPLE.exists(), reason="the examples/ folder of the repository")
def test_tp_invariance_example_is_bitwise_in_deterministic_mode(monkeypatch):
    """The example's deterministic rows are bitwise at TP 2 and 3 (Megatron's shards of a
    5000-id vocabulary: at TP 3 they cut the default 640-column tiles); it runs its ranks
    by spawn, which imports the example by name."""
    monkeypatch.syspath_prepend(str(TP_EXAMPLE.parent))
    module = importlib.import_module("tp_invariance")
    with contextlib.redirect_stdout(io.StringIO()) as text:
        rows = module.main(["--tp", "1,2,3", "--vocab", "5000", "--tokens", "40"])
    assert [(tp, mode) for tp, mode, _ in rows] == [
        (2, "default"),
        (2, "deterministic"),
        (3, "default"),
        (3, "deterministic"),
    ], text.getvalue()
    for tp, mode, cells in rows:
        if mode == "deterministic":
            assert cells == ["bitwise"] * 4, f"TP {tp}: {cells}\n{text.getvalue()}"
        else:  # the default mode agrees to rounding
            assert all(c == "bitwise" or float(c) < 1e-4 for c in cells), text.getvalue()
