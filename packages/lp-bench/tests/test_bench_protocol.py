"""The protocol of ``lp bench``: the steady-state warm-up (on CPU and over gloo), shapes,
modes, the fwd mode and the grid."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lp_bench.timing import steady_warmup


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
    import lp_bench.timing as timing

    own, real = [], timing.all_ranks_max

    def spy(x, device):
        own.append(x)
        return real(x, device)

    timing.all_ranks_max = spy
    # rank 0's calls take 10x longer, so alone it would warm up with ~10x fewer calls
    fn, _ = _counted(0.02 if rank == 0 else 0.002)
    count = steady_warmup(fn, 1, 0.1, tp=world_size, device="cpu")
    return own[0], count


def test_steady_warmup_gives_every_rank_the_same_count(rank_runner):
    """Under TP the warm-up calls hold collectives: every rank runs the largest count."""
    (own0, count0), (own1, count1) = rank_runner(_tp_rank, 2, timeout=90)
    assert own0 < own1  # the ranks disagreed on their own ...
    assert count0 == count1 == max(own0, own1)  # ... and agree after the exchange


# ----------------------------------------------------------------------------- shapes, modes


def test_shapes_s1_to_s6_and_custom_shapes_parse():
    from lp_bench.protocol import SHAPES, parse_shapes

    assert SHAPES["S5"] == (2048, 4096, 151936) and SHAPES["S6"] == (1024, 2048, 248320)
    assert list(SHAPES) == ["S1", "S2", "S3", "S4", "S5", "S6"]
    got = parse_shapes("S5, S6,cpu,3x4x5")
    assert got == (
        ("S5", 2048, 4096, 151936),
        ("S6", 1024, 2048, 248320),
        ("cpu", 256, 128, 16003),
        ("3x4x5", 3, 4, 5),
    )
    for bad, message in [("S7", "neither a shape name"), ("2x2x1", "V >= 2"), ("", "neither")]:
        with pytest.raises(ValueError, match=message):
            parse_shapes(bad)


def test_modes_parse_in_order_without_repeats():
    from lp_bench.protocol import parse_modes

    assert parse_modes("train") == ("train",)
    assert parse_modes("fwd,train,fwd") == ("fwd", "train")
    for bad in ("eval", "train,bwd", ","):
        with pytest.raises(ValueError, match="mode"):
            parse_modes(bad)


def test_bench_config_rejects_bad_fields():
    from lp_bench.protocol import BenchConfig

    base = dict(shapes=(("x", 2, 2, 3),), providers=("lp-torch",), dtypes=("fp32",), device="cpu")
    assert BenchConfig(**base).size == 1
    assert BenchConfig(**base, modes=("train", "fwd"), entropy=(False, True)).size == 4
    for bad, message in [
        ({"modes": ("eval",)}, "modes"),
        ({"dtypes": ("fp8",)}, "dtypes"),
        ({"entropy": ()}, "non-empty"),
        ({"reps": 0}, "reps >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            BenchConfig(**(base | bad))


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("matmuls", "mode"), [(4, "train"), (1, "fwd")])
def test_floor_is_four_matmuls_in_train_and_one_in_fwd(matmuls, mode):
    from lp_bench.protocol import FLOOR_MATMULS
    from lp_bench.timing import floor_call

    assert FLOOR_MATMULS[mode] == matmuls
    h, w = torch.randn(8, 4), torch.randn(16, 4)
    with _CountMatmuls() as counter:
        floor_call(h, w, FLOOR_MATMULS[mode])()
    assert counter.count == matmuls
    with _CountMatmuls() as counter:
        floor_call(h, w)()  # the signature the benchmark scripts call: four
    assert counter.count == 4
    with pytest.raises(ValueError, match="matmuls must be >= 1"):
        floor_call(h, w, 0)


def test_fwd_step_runs_without_autograd():
    from lp_bench.protocol import make_inputs
    from lp_bench.providers import make_provider

    hidden, weight, targets, grad_out = make_inputs(8, 4, 11, device="cpu", dtype=torch.float32)
    for name in ("lp-torch", "lp-torch-det", "materialized"):
        prep = make_provider(name, mode="fwd", entropy=True)
        assert prep.entropy and prep.note is None
        with torch.no_grad():
            logprob, entropy = prep.step(hidden, weight, targets, grad_out, grad_out)
        assert logprob.shape == entropy.shape == (8,) and not logprob.requires_grad


def test_grid_rows_fwd_and_train_with_and_without_entropy():
    """train and fwd x entropy off/on x three providers: one row each, errors vs fp64."""
    from lp_bench.protocol import ROW_KEYS, BenchConfig, run_bench

    cfg = BenchConfig(
        shapes=(("32x16x301", 32, 16, 301),),
        providers=("lp-torch", "lp-torch-det", "materialized"),
        dtypes=("fp32",),
        device="cpu",
        modes=("train", "fwd"),
        entropy=(False, True),
        reps=1,
        warmup=0,
    )
    env = {"device": "cpu", "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00"}
    seen = []
    rows = run_bench(cfg, env=env, on_row=seen.append)
    assert rows == seen and len(rows) == cfg.size == 12
    assert [(r["mode"], r["entropy"], r["provider"]) for r in rows[:4]] == [
        ("train", False, "lp-torch"),
        ("train", False, "lp-torch-det"),
        ("train", False, "materialized"),
        ("train", True, "lp-torch"),
    ]
    by = {(r["mode"], r["entropy"], r["provider"]): r for r in rows}
    for (mode, entropy, prov), r in by.items():
        assert list(r) == list(ROW_KEYS)
        assert r["error"] is None and r["skipped"] is None, r
        assert r["commit"] == "abc1234" and r["device"] == "cpu"
        assert r["deterministic"] == {"lp-torch": False, "lp-torch-det": True}.get(prov)
        assert r["err_logprob"] < 1e-6 and r["ms"] > 0
        assert (r["err_entropy"] is not None) == entropy
        if entropy:
            assert r["err_entropy"] < 1e-6 and r["entropy_computed"]
        grads = (r["err_grad_hidden"], r["err_grad_weight"])
        if mode == "train":
            assert max(grads) < 1e-6
        else:
            assert grads == (None, None)  # no backward in fwd mode
    # Forward only holds nothing for a backward: the materialized path's saved [N, V]
    # tensors are gone; lp's chunk scratch is its peak in both modes.
    for prov in cfg.providers:
        assert by[("fwd", True, prov)]["peak_bytes"] <= by[("train", True, prov)]["peak_bytes"]
    mat = [by[(mode, True, "materialized")]["peak_bytes"] for mode in ("fwd", "train")]
    assert mat[0] < mat[1]


def test_paired_rounds_rotate_and_time_every_call_each_round():
    from lp_bench.timing import paired_rounds

    order = []

    def call(name):
        return lambda: order.append(name)

    runs = paired_rounds({k: call(k) for k in "abc"}, rounds=4, reps=2, warm_s=0.0, device="cpu")
    assert list(runs) == ["a", "b", "c"]
    assert all(len(x) == 4 and min(x) >= 0.0 for x in runs.values())
    assert order[:3] == list("abc")  # warm_s 0: steady_warmup's one warm-up call each
    timed = order[3:]
    rounds = [timed[i : i + 6 : 2] for i in range(0, 24, 6)]  # each call twice in a row
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert timed[1::2] == timed[0::2] and len(timed) == 24
