"""`lp bench --grid` into one bench.json, and `lp report` back to markdown tables."""

from __future__ import annotations

import json

import pytest

from lp_bench.cli import main


def _row(mode, entropy, provider, shape, x, **extra):
    row = {"mode": mode, "entropy": entropy, "provider": provider, "shape": shape}
    row |= {"dtype": "bf16", "ms": 10 * x, "x_floor": x, "floor_ms": 10.0}
    row |= {"peak_bytes": int(x * 2**30), "err_logprob": 1e-7, "err_grad_hidden": 3e-3}
    row |= {"note": None, "error": None, "skipped": None}
    return row | extra


def test_markdown_tables_from_rows():
    from lp_bench.report import markdown

    env = {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}
    env |= {"commit": "b20ce0a", "date": "2026-12-01T10:00:00+00:00"}
    rows = []
    for mode in ("train", "fwd"):
        for entropy in (False, True):
            for shape, x in (("S1", 1.09), ("S5", 1.2)):
                rows.append(_row(mode, entropy, "lp-triton", shape, x))
                note = "logprob only: cce has no entropy" if entropy else None
                rows.append(_row(mode, entropy, "cce", shape, x + 0.1, note=note))
    rows.append(_row("fwd", True, "materialized", "S1", 0, ms=None, error="OOM: out of memory"))
    text = markdown({"command": "bench", "env": env, "rows": rows})
    assert text.startswith("**NVIDIA H200**, torch 2.11.0, triton 3.6.0, commit b20ce0a, 2026-12")
    for title in (
        "**train, logprob: x floor (4 matmuls)**",
        "**train, logprob + entropy: x floor (4 matmuls)**",
        "**fwd, logprob: x floor (1 matmul)**",
        "**fwd, logprob + entropy: x floor (1 matmul)**",
        "**peak memory above the inputs, GiB**",
        "**worst relative error against the fp32 reference**",
    ):
        assert title in text, title
    assert "| provider | S1 | S5 |" in text
    assert "| lp-triton | 1.09 | 1.20 |" in text
    assert "| cce | 1.19* | 1.30* |" in text  # logprob only under entropy, marked
    assert "| cce | 1.19 | 1.30 |" in text
    assert "* logprob only" in text
    assert "| materialized | OOM |  |" in text
    assert "| lp-triton (fwd+entropy) | 1.09 | 1.20 |" in text  # memory, GiB
    assert "| lp-triton (train) | 3.0e-03 | 3.0e-03 |" in text  # worst error
    assert "materialized" in text.split("Errors:")[1]


def test_grid_run_then_report_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["bench", "--grid", "--shapes", "16x8x97", "--dtype", "fp32", "--reps", "1"]
    assert main([*argv, "--warmup", "0", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and (tmp_path / "bench.png").stat().st_size > 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    runs = {(r["mode"], r["entropy"], r["provider"]) for r in doc["rows"]}
    assert runs == {
        (m, e, p)
        for m in ("train", "fwd")
        for e in (False, True)
        for p in ("lp-torch", "lp-torch-det", "materialized")
    }
    assert doc["config"]["modes"] == ["train", "fwd"] and doc["config"]["entropy"] == [False, True]

    png = tmp_path / "again.png"
    assert main(["report", str(tmp_path / "bench.json"), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert png.stat().st_size > 0
    for title in ("train, logprob: ms", "fwd, logprob + entropy: ms", "peak memory", "fp64"):
        assert title in text, title
    assert "| lp-torch-det |" in text and "| materialized (fwd+entropy) |" in text


def test_report_refuses_a_file_that_is_not_a_bench_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"command": "demo", "runs": []}))
    with pytest.raises(SystemExit):
        main(["report", str(path)])
    assert "not a bench.json" in capsys.readouterr().err


def test_the_report_names_the_card_and_its_limits():
    """A CUDA record's card (name, SMs, memory, max SM clock, power limit) heads its tables,
    so figures of two cards, or of one card under other limits, are told apart."""
    from lp_bench.report import markdown

    card = {
        "name": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "sms": 132,
        "memory_gib": 79.2,
        "clocks.max.sm": "1980",
        "clocks.sm": "1980",
        "power.limit": "700.00",
        "power.max_limit": "700.00",
        "driver_version": "580.95.05",
    }
    env = {"device": "cuda", "gpu": card["name"], "card": card, "torch": "2.11.0"}
    rows = [_row("train", False, "lp-triton", "S1", 1.1)]
    text = markdown({"env": env, "rows": rows})
    assert "Card: NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.2 GiB; max SM clock 1980 MHz" in text
    assert "power limit 700.00 W" in text
    assert "Card:" not in markdown({"env": {**env, "card": None}, "rows": rows})


@pytest.mark.gpu
def test_card_reads_this_gpu():
    import torch

    from lp_bench.environment import card

    got = card()
    assert got["name"] == torch.cuda.get_device_name()
    assert got["sms"] == torch.cuda.get_device_properties(0).multi_processor_count > 0
    assert float(got["power.limit"]) > 0 and int(got["clocks.max.sm"]) > 0
