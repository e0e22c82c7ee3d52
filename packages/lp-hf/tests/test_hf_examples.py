"""The repository's examples/hf_grpo.py runs at a tiny size: the lp and logits steps agree,
and lp's update peaks lower."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_grpo.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="the examples/ folder of the repository")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_grpo_example_lp_equals_logits_and_peaks_lower(tied):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--vocab", "4099", "--prompts", "2", "--group", "4", "--completion", "8"]
    argv += ["--chunk-size", "16", *(["--tied"] if tied else [])]
    with contextlib.redirect_stdout(io.StringIO()) as text:
        res = module.main(argv)
    lp, logits = res["lp"], res["logits"]
    assert abs(lp["loss"] - logits["loss"]) <= 1e-5 * abs(logits["loss"]), text.getvalue()
    assert abs(lp["grad_norm"] - logits["grad_norm"]) <= 1e-5 * logits["grad_norm"]
    assert res["max_rel_grad_diff"] < 2e-5, text.getvalue()
    assert lp["max_ratio_dev"] == 0.0  # rollout and update log-probs: the same bits
    assert 0 < lp["peak_bytes"] < logits["peak_bytes"], text.getvalue()
    assert "lp saves" in text.getvalue()
