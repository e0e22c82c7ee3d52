"""Problem generation, vocabulary splitting, shapes and tolerances."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lp_testing import (
    AWKWARD_SHAPES,
    DTYPES,
    make_problem,
    nan_tensor,
    random_upstream,
    shard,
    split_vocab,
    tolerance,
)
from lp_testing.problems import PADDING_SCALE


def test_deterministic_given_seed() -> None:
    a = make_problem(37, 64, 1009, ignore_frac=0.2, seed=7)
    b = make_problem(37, 64, 1009, ignore_frac=0.2, seed=7)
    c = make_problem(37, 64, 1009, ignore_frac=0.2, seed=8)
    for x, y, z in ((a.hidden, b.hidden, c.hidden), (a.weight, b.weight, c.weight)):
        assert torch.equal(x, y) and not torch.equal(x, z)
    assert torch.equal(a.targets, b.targets) and not torch.equal(a.targets, c.targets)
    # Same draw in every dtype (rounded), and the weight does not depend on N.
    bf = make_problem(37, 64, 1009, ignore_frac=0.2, seed=7, dtype=torch.bfloat16)
    assert torch.equal(bf.hidden, a.hidden.to(torch.bfloat16))
    assert torch.equal(bf.weight, a.weight.to(torch.bfloat16))
    assert torch.equal(make_problem(5, 64, 1009, seed=7).weight, a.weight)


def test_shapes_dtypes_and_padding() -> None:
    p = make_problem((3, 5), 16, 100, padded_vocab=128, dtype=torch.float16, temperature=0.5)
    assert p.hidden.shape == (3, 5, 16) and p.hidden.dtype == torch.float16
    assert p.weight.shape == (128, 16) and p.weight.dtype == torch.float16
    assert p.targets.shape == (3, 5) and p.targets.dtype == torch.int64
    assert (p.n, p.h, p.v, p.v_padded) == (15, 16, 100, 128)
    assert p.op_kwargs() == {"temperature": 0.5, "ignore_index": -100, "vocab_size": 100}
    assert p.id == "N15-H16-V100-pad128-float16"
    real = p.weight[:100].float().pow(2).mean().sqrt()
    pad = p.weight[100:].float().pow(2).mean().sqrt()
    assert 0.7 * PADDING_SCALE < pad / real < 1.3 * PADDING_SCALE


def test_realistic_logit_magnitudes() -> None:
    p = make_problem(256, 512, 4096, seed=1)
    z = p.hidden @ p.weight.T
    assert 2.7 < z.std().item() < 3.3  # scale = 3 by default
    assert 8.0 < z.max(-1).values.mean().item() < 15.0


def test_targets_range_edges_and_ignored_rows() -> None:
    p = make_problem(50, 8, 33, padded_vocab=40, ignore_frac=0.3, seed=3)
    kept = p.targets[~p.ignored]
    assert int(p.ignored.sum()) == 15
    assert kept.min() == 0 and kept.max() == 32  # column 0 and the last real column
    assert kept[0] == 0 and kept[-1] == 32
    assert (p.targets[p.ignored] == -100).all()
    # At least one ignored row when asked (N > 1), at least one kept unless all asked.
    assert int(make_problem(2, 8, 33, ignore_frac=0.01).ignored.sum()) == 1
    assert int(make_problem(3, 8, 33, ignore_frac=0.99).ignored.sum()) == 2
    assert bool(make_problem(4, 8, 33, ignore_frac=1.0).ignored.all())
    single = make_problem(1, 8, 33)
    assert single.targets.tolist() == [32]
    assert make_problem(6, 8, 33, ignore_index=-1, ignore_frac=0.5).targets.min() == -1
    real = make_problem(40, 8, 33, ignore_index=3, ignore_frac=0.25)  # a real id: allowed
    assert bool((real.targets[real.ignored] == 3).all()) and int(real.ignored.sum()) >= 10
    with pytest.raises(ValueError, match="padded_vocab"):
        make_problem(6, 8, 33, padded_vocab=32)


def test_problem_helpers() -> None:
    p = make_problem(6, 8, 10, ignore_frac=0.5)
    q = p.with_grad()
    assert q.hidden.requires_grad and q.hidden.is_leaf and not p.hidden.requires_grad
    assert p.to(dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    up = p.upstream()
    assert set(up) == {"grad_logprob", "grad_entropy", "grad_lse"}
    assert all(g.shape == (6,) and g.dtype == torch.float32 for g in up.values())
    assert not torch.equal(up["grad_logprob"], up["grad_lse"])
    assert torch.equal(random_upstream((4,), seed=1), random_upstream((4,), seed=1))


def test_nan_tensor() -> None:
    assert nan_tensor((2, 3), dtype=torch.bfloat16).isnan().all()
    assert (nan_tensor((2,), dtype=torch.int32) == torch.iinfo(torch.int32).max).all()


@pytest.mark.parametrize("mode", ["even", "uneven"])
def test_split_vocab_covers_contiguously(mode: str) -> None:
    for v in (1, 2, 7, 31, 64, 100, 257, 1009, 4096, 4099):
        for world_size in range(1, 9):
            for multiple in (1, 4, 64, 128):
                if -(-v // multiple) < world_size:
                    with pytest.raises(ValueError, match="non-empty"):
                        split_vocab(v, world_size, mode=mode, multiple=multiple)
                    continue
                bounds = split_vocab(v, world_size, mode=mode, multiple=multiple)
                assert len(bounds) == world_size
                assert bounds[0][0] == 0 and sum(size for _, size in bounds) == v
                for (start, size), (next_start, _) in itertools.pairwise(bounds):
                    assert size > 0 and start + size == next_start
                    assert next_start % multiple == 0
                assert bounds[-1][1] > 0
                units = [-(-size // multiple) for _, size in bounds]
                if mode == "even":
                    assert max(units) - min(units) <= 1
                elif sum(units) > world_size > 1:
                    assert len(set(units)) > 1, (v, world_size, multiple, bounds)


def test_split_vocab_examples() -> None:
    assert split_vocab(1009, 2) == [(0, 505), (505, 504)]
    assert split_vocab(1024, 4) == [(0, 256), (256, 256), (512, 256), (768, 256)]
    assert split_vocab(1000, 3, mode="uneven", multiple=64) == [(0, 192), (192, 320), (512, 488)]
    assert split_vocab(100, 4, mode="uneven") == [(0, 10), (10, 20), (30, 30), (60, 40)]
    with pytest.raises(ValueError, match="mode"):
        split_vocab(10, 2, mode="random")  # type: ignore[arg-type]


def test_shard() -> None:
    w = torch.arange(20.0).reshape(10, 2)
    bounds = split_vocab(10, 3, mode="uneven")
    pieces = [shard(w, bounds, r) for r in range(3)]
    assert torch.equal(torch.cat(pieces), w)
    assert pieces[1].data_ptr() == w[bounds[1][0]].data_ptr()  # a view
    logits = torch.arange(30.0).reshape(3, 10)
    assert torch.equal(torch.cat([shard(logits, bounds, r, dim=-1) for r in range(3)], -1), logits)


def test_awkward_shapes_and_dtypes() -> None:
    ids = [str(s) for s in AWKWARD_SHAPES]
    assert len(set(ids)) == len(ids) and "N1-H17-V31" in ids
    assert any(s.n == 1 for s in AWKWARD_SHAPES)
    assert any(
        s.v % 2 == 1 and all(s.v % d for d in range(2, math.isqrt(s.v) + 1)) for s in AWKWARD_SHAPES
    )
    assert all(s.n * s.h * s.v <= 40_000_000 for s in AWKWARD_SHAPES)  # CPU friendly
    assert [str(t) for t in DTYPES] == ["fp32", "bf16", "fp16"]
    assert tolerance(torch.bfloat16).kwargs() == {"k": 2.0, "atol": 1e-5, "rtol": 8e-3}
    with pytest.raises(KeyError):
        tolerance(torch.int8)
