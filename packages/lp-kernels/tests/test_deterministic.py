"""deterministic=True: bitwise tensor-parallel invariance on CPU over gloo ranks.

For one global problem, outputs and both gradients must be bitwise identical for
TP = 1, 2, 3, 4, 8 and any shard layout whose bounds are multiples of 128 (uneven ones
included), with 128-column tiles or wider ones that cross shard bounds, on the torch
backend and on the triton backend (under Triton's interpreter); and still match fp64
like the default path.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
import torch.distributed as dist
from _parity import check_against_fp64

from lp_kernels import linear_logprob
from lp_testing import (
    AWKWARD_SHAPES,
    DTYPES,
    RankError,
    assert_bitwise_equal,
    assert_close,
    make_problem,
    reference_all,
    reference_from_logits,
    run_ranks,
)

LAYOUTS = {  # shard bounds over V_pad = 1024 rows, all on multiples of 128
    "tp1": [(0, 1024)],
    "tp2": [(0, 512), (512, 512)],
    "tp2-uneven": [(0, 896), (896, 128)],
    "tp3-uneven": [(0, 128), (128, 640), (768, 256)],
    "tp4": [(0, 256), (256, 256), (512, 256), (768, 256)],
    "tp4-uneven": [(0, 384), (384, 128), (512, 384), (896, 128)],
    "tp8": [(128 * r, 128) for r in range(8)],
}


def _problem(dtype):
    return make_problem(
        37, 24, 1000, dtype=dtype, seed=3, ignore_frac=0.1, padded_vocab=1024, temperature=0.8
    )


def _upstream(n):
    g = torch.linspace(-1, 1, n)
    return g, g.flip(0), torch.full((n,), 0.3)


def _rank(rank, world, problem, bounds, backend, tile=128, chunk=None, rows=None):
    config = contextlib.nullcontext()
    if chunk is not None:  # a smaller vocabulary chunk: the same code paths as large tiles
        from lp_kernels.backends.triton.config import config_for, use_config

        vocab_chunk, token_chunk, *v_split = chunk if isinstance(chunk, tuple) else (chunk, None)
        base = config_for(problem.hidden.device, problem.hidden.dtype)
        cfg = base.replace(
            backward={
                "vocab_chunk": vocab_chunk,
                "token_chunk": token_chunk or base.backward.token_chunk,
            },
            forward={"v_split": v_split[0] if v_split else base.forward.v_split},
        )
        config = use_config(cfg)
    start, size = bounds[rank]
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight[start : start + size].clone().requires_grad_()
    with config:  # the backward keeps the config of the forward
        out = linear_logprob(
            h, w, problem.targets, tp_group=dist.group.WORLD, vocab_start=start,
            deterministic=True, deterministic_tile=tile, return_entropy=True, return_lse=True,
            backend=backend, chunk_size=rows, **problem.op_kwargs(),
        )  # fmt: skip
    g_lp, g_ent, g_lse = _upstream(problem.n)
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    return out.logprob, out.entropy, out.lse, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_identical_across_tp_degrees_and_layouts(dtype, backend):
    problem = _problem(dtype)
    results = {}
    for name, bounds in LAYOUTS.items():
        per_rank = run_ranks(_rank, len(bounds), problem, bounds, backend, timeout=180)
        for rank in range(1, len(bounds)):  # every rank returns the same outputs
            for k in range(4):
                assert_bitwise_equal(per_rank[rank][k], per_rank[0][k], f"{name} rank {rank}")
        grad_w = torch.cat([r[4] for r in per_rank])
        results[name] = (*per_rank[0][:4], grad_w)
    names = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")
    for layout, got in results.items():
        for name, a, b in zip(names, got, results["tp1"], strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1")
    g_lp, g_ent, g_lse = _upstream(problem.n)
    truth = reference_all(
        problem.hidden,
        problem.weight,
        problem.targets,
        grad_logprob=g_lp,
        grad_entropy=g_ent,
        grad_lse=g_lse,
        **problem.op_kwargs(),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got in zip(names, results["tp1"], strict=True):
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=tol, atol=tol * scale, name=f"{name} vs fp64")


@pytest.mark.parametrize("tile", [128, 384])
@pytest.mark.parametrize("tol", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_deterministic_parity_awkward_shapes(shape, tol, tile, device, backend):
    """deterministic=True is as accurate as the default path: every dtype, all options,
    the default tile and a wider one (384: not a multiple of the forward's 256-column
    logit tiles)."""
    if backend == "triton" and device == "cpu" and (shape.v > 2000 or tile != 128):
        pytest.skip("Triton's interpreter only at tiny sizes in CI; the GPU run covers it")
    problem = make_problem(
        shape.n, shape.h, shape.v, dtype=tol.dtype, device=device, seed=shape.n + shape.v,
        ignore_frac=0.25, padded_vocab=shape.v + 13, temperature=0.7,
    )  # fmt: skip
    check_against_fp64(
        problem, tol, entropy=True, lse=True, backend=backend, deterministic=True,
        deterministic_tile=tile,
    )  # fmt: skip


def test_deterministic_single_process_batch_invariant_and_reproducible(backend):
    p = _problem(torch.float32)

    def run(rows):
        h = p.hidden[rows].clone().requires_grad_()
        out = linear_logprob(
            h, p.weight, p.targets[rows], deterministic=True, return_entropy=True,
            backend=backend, **p.op_kwargs(),
        )  # fmt: skip
        (out.logprob + out.entropy).sum().backward()
        return out.logprob, out.entropy, h.grad

    full = run(torch.arange(p.n))
    again = run(torch.arange(p.n))
    for a, b in zip(full, again, strict=True):
        assert_bitwise_equal(a, b, "run to run")
    rows = torch.tensor([4, 17, 30])
    for a, b in zip(run(rows), full, strict=True):
        assert_bitwise_equal(a, b[rows], "rows alone vs in the batch")


# deterministic_tile wider than 128, on the three backward plans of the triton backend
# (lp_kernels.backends.triton.deterministic.tile_chunks), chosen under the interpreter by
# its vocabulary chunk: several tiles per chunk; one tile per chunk; a tile cut into chunks.
WIDE_CASES = {  # name -> (tile, vocab chunk [, token chunk] of the interpreter config, V_pad,
    # layouts)
    "tile256-multi": (256, None, 1024, ["tp1", "tp2", "tp4", "tp3-w256", "tp2-x", "tp3-x"]),
    "tile256-per-tile": (256, 256, 1024, ["tp1", "tp2", "tp4", "tp3-w256", "tp2-x"]),
    "tile384-cut": (384, 256, 1152, ["tp1", "tp3-w384", "tp2-w384", "tp4-x", "tp3-x384"]),
    # and token chunks of 16 rows: grad_W summed over them, chunks cut across shards (the
    # torch backend: chunk_size=16)
    "tile384-cut-rows": (384, (256, 16), 1152, ["tp1", "tp4-x", "tp3-x384"]),
    # forward splits of 256 columns cut from each tile's start (two per tile: 256 + 128);
    # the backward's chunks of a tile in one launch (tile_launch_k at 37 rows)
    "tile384-splits": (384, (256, None, 256), 1152, ["tp1", "tp3-w384", "tp4-x", "tp3-x384"]),
    # fp32 weights: grad_W of a chunk that runs into the halo in fp32 scratch, with one
    # token chunk and with several
    "tile256-per-tile-fp32": (256, 256, 1024, ["tp1", "tp2-x", "tp3-x"], torch.float32),
    "tile256-per-tile-rows-fp32": (256, (256, 16), 1024, ["tp1", "tp2-x"], torch.float32),
}
# "-x": bounds on multiples of 128 but not of the tile: tiles cross shard bounds and are
# computed whole by the rank where they start, with the next shards' rows sent to it
# (tp4-x: rank 0's tile takes rows from ranks 1 and 2; tp3-x: rank 1 starts no tile).
WIDE_LAYOUTS = {
    "tp1": lambda v_pad: [(0, v_pad)],
    "tp2": lambda v_pad: [(0, v_pad // 2), (v_pad // 2, v_pad // 2)],
    "tp4": lambda v_pad: [(v_pad // 4 * r, v_pad // 4) for r in range(4)],
    "tp3-w256": lambda v_pad: [(0, 256), (256, 512), (768, v_pad - 768)],
    "tp3-w384": lambda v_pad: [(0, 384), (384, 384), (768, v_pad - 768)],
    "tp2-w384": lambda v_pad: [(0, 768), (768, v_pad - 768)],
    "tp2-x": lambda v_pad: [(0, 640), (640, v_pad - 640)],
    "tp3-x": lambda v_pad: [(0, 384), (384, 128), (512, v_pad - 512)],
    "tp4-x": lambda v_pad: [(0, 128), (128, 128), (256, 512), (768, v_pad - 768)],
    "tp3-x384": lambda v_pad: [(0, 512), (512, 512), (1024, v_pad - 1024)],
}


@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_wider_tiles_bitwise_identical_across_layouts(case, backend):
    """deterministic_tile > 128: the same bits on every 128-aligned layout, on the tile's
    grid or not (uneven ones included), on each backward plan, and still as accurate as
    the default path."""
    tile, chunk, v_pad, layouts, *dtype = WIDE_CASES[case]
    rows = chunk[1] if backend == "torch" and isinstance(chunk, tuple) else None
    problem = make_problem(
        37, 24, 1000, dtype=dtype[0] if dtype else torch.bfloat16, seed=5, ignore_frac=0.1,
        padded_vocab=v_pad, temperature=0.8,
    )  # fmt: skip
    names = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")
    results = {}
    for layout in layouts:
        bounds = WIDE_LAYOUTS[layout](v_pad)
        per_rank = run_ranks(
            _rank, len(bounds), problem, bounds, backend, tile, chunk, rows, timeout=180
        )
        for rank in range(1, len(bounds)):
            for k in range(4):
                assert_bitwise_equal(per_rank[rank][k], per_rank[0][k], f"{layout} rank {rank}")
        results[layout] = (*per_rank[0][:4], torch.cat([r[4] for r in per_rank]))
    for layout, got in results.items():
        for name, a, b in zip(names, got, results["tp1"], strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1 (tile {tile})")
    g_lp, g_ent, g_lse = _upstream(problem.n)
    truth = reference_all(
        problem.hidden, problem.weight, problem.targets, grad_logprob=g_lp, grad_entropy=g_ent,
        grad_lse=g_lse, **problem.op_kwargs(),
    )  # fmt: skip
    for name, got in zip(names, results["tp1"], strict=True):
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=2e-2, atol=2e-2 * scale, name=f"{name} vs fp64")


def test_tile_launches_keep_every_rows_bits():
    """The triton backend at small N takes each wide tile's backward chunks in one launch
    (``tile_launch_k``) and splits the forward from each tile's start: the rows of a batch
    of 3 (one launch per tile) are bitwise those of the same rows in a batch of 100 (2 x
    100 rows pass the interpreter's 128-row token chunk: one launch per chunk), outputs and
    grad_hidden (fp32: a bf16 grad_hidden's last rounding would hide a changed sum)."""
    from lp_kernels.backends.triton.config import INTERPRET_CONFIG, use_config
    from lp_kernels.backends.triton.plan import tile_launch_k

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1 (set when no GPU is present)")
    # K steps of 64: a chunk's sum (4 steps) differs from a running sum over the tile
    cfg = INTERPRET_CONFIG.replace(
        backward={"vocab_chunk": 256}, forward={"v_split": 256}, gemm={"block_k": 64}
    )
    assert tile_launch_k(3, 384, cfg) == 256
    assert tile_launch_k(100, 384, cfg) is None
    p = make_problem(
        100, 24, 1000, dtype=torch.float32, seed=11, ignore_frac=0.1, padded_vocab=1152,
        temperature=0.8,
    )  # fmt: skip

    g_lp, g_ent, g_lse = _upstream(p.n)  # per row of the batch of 100

    def run(rows):
        h = p.hidden[rows].clone().requires_grad_()
        with use_config(cfg):
            out = linear_logprob(
                h, p.weight, p.targets[rows], deterministic=True, deterministic_tile=384,
                return_entropy=True, return_lse=True, backend="triton", **p.op_kwargs(),
            )  # fmt: skip
        (
            out.logprob * g_lp[rows] + out.entropy * g_ent[rows] + out.lse * g_lse[rows]
        ).sum().backward()
        return out.logprob, out.entropy, out.lse, h.grad

    rows = torch.tensor([4, 57, 93])
    names = ("logprob", "entropy", "lse", "grad_hidden")
    for name, a, b in zip(names, run(rows), run(torch.arange(p.n)), strict=True):
        assert_bitwise_equal(a, b[rows], f"{name}: 3 rows vs 100")


def _torch_chunk_rank(rank, world, problem, bounds, tile):
    """A torch-backend rank with the default token chunk, recording the chunk it used."""
    from lp_kernels.backends.torch import deterministic as td

    used = set()
    forward_chunks, backward_chunks = td.logits_chunks, td.dlogits_chunks

    def forward_spy(hidden, w, p, *args, **kwargs):
        used.add(p.chunk_size)
        return forward_chunks(hidden, w, p, *args, **kwargs)

    def backward_spy(hidden, w, targets, lse, mean_z, upstream, p, *args, **kwargs):
        used.add(p.chunk_size)
        return backward_chunks(hidden, w, targets, lse, mean_z, upstream, p, *args, **kwargs)

    td.logits_chunks, td.dlogits_chunks = forward_spy, backward_spy
    try:
        return used, _rank(rank, world, problem, bounds, "torch", tile)
    finally:
        td.logits_chunks, td.dlogits_chunks = forward_chunks, backward_chunks


def test_torch_token_chunk_is_the_same_on_every_layout():
    """The torch backend's default token chunk comes from the tile's width, not the
    shard's: its GEMMs and reductions then have one shape per tile on every layout, which
    is what keeps cuBLAS' and torch's CUDA kernels (they choose their summation order by
    shape) on the same bits. A 262144-column tile, whose chunk (128 rows on CPU) is
    smaller than the 200 rows, on shards of 524288, 262144, 393216 and 131072 columns (by
    width, chunks of 64, 128, 64 and 256 rows); the uneven layout crosses the tile."""
    tile, v_pad = 262144, 524288
    problem = make_problem(
        200, 4, v_pad - 7, dtype=torch.float32, seed=9, ignore_frac=0.1, padded_vocab=v_pad,
        temperature=0.8,
    )  # fmt: skip
    layouts = {
        "tp1": [(0, v_pad)],
        "tp2": [(0, tile), (tile, tile)],
        "tp2-x": [(0, 393216), (393216, 131072)],
    }
    results, chunks = {}, set()
    for name, bounds in layouts.items():
        per_rank = run_ranks(_torch_chunk_rank, len(bounds), problem, bounds, tile, timeout=180)
        chunks |= set().union(*(used for used, _ in per_rank))
        outs = [got for _, got in per_rank]
        results[name] = (*outs[0][:4], torch.cat([r[4] for r in outs]))
    assert chunks == {128}, f"token chunks used: {sorted(chunks)}; want 128 on every layout"
    names = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")
    for layout, got in results.items():
        for name, a, b in zip(names, got, results["tp1"], strict=True):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1")


def _halo_copy_rank(rank, world, problem, bounds, chunk):
    """One triton rank of a layout with a halo, recording the rows of every joined copy
    and of every grad_W GEMM (cuBLAS, per chunk: one call, or the first token chunk's)."""
    import lp_kernels.backends.triton.deterministic as tdet

    copies, gemms = [], []
    join, slice_, addmm = tdet.with_halo, tdet.grad_weight_slice, tdet.addmm_f32_

    def recording(w_real, halo, start=0):
        out = join(w_real, halo, start)
        if halo.shape[0]:
            copies.append(out.shape[0])
        return out

    def grad_weight_slice(dl, hidden, out):
        gemms.append(out.shape[0])
        return slice_(dl, hidden, out)

    def addmm_f32_(acc, a, b, accumulate=True):
        if not accumulate:
            gemms.append(acc.shape[0])
        return addmm(acc, a, b, accumulate=accumulate)

    tdet.with_halo, tdet.grad_weight_slice, tdet.addmm_f32_ = (
        recording, grad_weight_slice, addmm_f32_,
    )  # fmt: skip
    try:
        got = _rank(rank, world, problem, bounds, "triton", 256, chunk)
    finally:
        tdet.with_halo, tdet.grad_weight_slice, tdet.addmm_f32_ = join, slice_, addmm
    return copies, got, gemms


@pytest.mark.parametrize("chunk", [256, (256, 16)], ids=["per-tile", "per-tile-rows"])
def test_triton_halo_rank_copies_one_tile_not_its_shard(chunk):
    """Rank 0 of [(0, 640), (640, 384)] owns three 256-column tiles, the last one running
    128 rows into rank 1's shard. It copies only that tile's rows (its last 128 real rows
    and the 128 halo rows), in the forward and in the backward, never its 640-row shard.
    Its grad_W GEMMs cover the halo rows too, which it sends to rank 1: rank 1 makes one
    GEMM, for its own tile, none for its first 128 rows (in rank 0's tile). The results
    stay bitwise those of one process."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1 (set when no GPU is present)")
    problem = make_problem(
        37, 24, 1000, dtype=torch.bfloat16, seed=5, ignore_frac=0.1, padded_vocab=1024,
        temperature=0.8,
    )  # fmt: skip
    bounds = [(0, 640), (640, 384)]
    per_rank = run_ranks(_halo_copy_rank, 2, problem, bounds, chunk, timeout=180)
    assert per_rank[0][0] == [256, 256]  # the forward's crossing tile, the backward's chunk
    assert per_rank[1][0] == []  # rank 1 has no halo
    # rank 1: its tile, cut by the vocabulary (1000 - 768 rows); no call for rows 640-767
    assert per_rank[0][2] == [256, 256, 256] and per_rank[1][2] == [232], per_rank[1][2]
    single = run_ranks(_rank, 1, problem, [(0, 1024)], "triton", 256, chunk, timeout=180)[0]
    for k in range(4):
        assert_bitwise_equal(per_rank[0][1][k], single[k], f"output {k}")
    grad_w = torch.cat([per_rank[0][1][4], per_rank[1][1][4]])
    assert_bitwise_equal(grad_w, single[4], "grad_weight")


def _misaligned_rank(rank, world):
    p = make_problem(4, 8, 300, seed=0)
    start, size = (0, 100) if rank == 0 else (100, 200)  # 100 is not a multiple of 128
    linear_logprob(
        p.hidden, p.weight[start : start + size], p.targets, tp_group=dist.group.WORLD,
        vocab_start=start, deterministic=True,
    )  # fmt: skip


def test_misaligned_layout_raises_on_every_rank():
    with pytest.raises(RankError) as info:
        run_ranks(_misaligned_rank, 2, timeout=60)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and "multiples of 128" in text


def _tile_rank(rank, world, tiles, bounds):
    p = make_problem(4, 8, 1024, seed=0)
    start, size = bounds[rank]
    linear_logprob(
        p.hidden, p.weight[start : start + size], p.targets, tp_group=dist.group.WORLD,
        vocab_start=start, deterministic=True, deterministic_tile=tiles[rank],
    )  # fmt: skip


@pytest.mark.parametrize(
    "tiles, bounds, message",
    [
        ((256, 256), [(0, 320), (320, 704)], "multiples of 128"),  # 320 is off the grid
        ((128, 256), [(0, 512), (512, 512)], "disagree on the tile size"),
        # the default is recorded as such: an explicit tile on one rank disagrees with it
        ((None, 128), [(0, 512), (512, 512)], "disagree on the tile size"),
    ],
    ids=["off-grid", "disagree", "default-vs-given"],
)
def test_tile_layout_errors_raise_on_every_rank(tiles, bounds, message):
    with pytest.raises(RankError) as info:
        run_ranks(_tile_rank, 2, tiles, bounds, timeout=60)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and message in text


def _logits_off_grid_rank(rank, world):
    from lp_kernels import vocab_parallel_logprob

    start, size = [(0, 384), (384, 640)][rank]
    x = torch.zeros(3, size)
    vocab_parallel_logprob(
        x, torch.zeros(3, dtype=torch.long), tp_group=dist.group.WORLD, vocab_start=start,
        deterministic=True, deterministic_tile=256,
    )  # fmt: skip


def test_vocab_parallel_logprob_needs_bounds_on_the_tile_grid():
    """On logits, tiles never cross shard bounds: 384 is off a 256 grid (linear_logprob
    would take it), and every rank raises."""
    with pytest.raises(RankError) as info:
        run_ranks(_logits_off_grid_rank, 2, timeout=60)
    text = str(info.value)
    assert text.count("ValueError") >= 2 and "multiples of 256" in text


def _logits_rank(rank, world, logits, targets, bounds, tile, columns=None):
    from lp_kernels import vocab_parallel_logprob
    from lp_kernels.core import chunks

    if columns is not None:  # tiles per vocabulary chunk of the reductions: columns // tile
        chunks.CHUNK_COLUMNS = columns
        assert chunks.chunk_tiles(tile) == columns // tile

    start, size = bounds[rank]
    x = logits[:, start : start + size].clone().requires_grad_()
    out = vocab_parallel_logprob(
        x, targets, tp_group=dist.group.WORLD, vocab_start=start, vocab_size=1000,
        return_entropy=True, return_lse=True, temperature=0.8, deterministic=True,
        deterministic_tile=tile,
    )  # fmt: skip
    g_lp, g_ent, g_lse = _upstream(targets.shape[0])
    (out.logprob * g_lp + out.entropy * g_ent + out.lse * g_lse).sum().backward()
    return out.logprob, out.entropy, out.lse, x.grad


@pytest.mark.parametrize(
    "tile, layouts, columns",
    [
        (128, ("tp1", "tp2-uneven", "tp3-uneven", "tp8"), None),
        (256, ("tp1", "tp2", "tp4"), None),
        (128, ("tp1", "tp2-uneven", "tp3-uneven", "tp4-uneven"), 384),
    ],
    ids=["tile128", "tile256", "tile128-chunks-of-3"],
)
def test_vocab_parallel_logprob_bitwise_identical_across_tp(tile, layouts, columns):
    """Bitwise equal on every layout, and as accurate as the default mode. Chunks of 3
    tiles per reduction: shards of 8, 7, 1, 5, 2, 3 and 1 tiles make full chunks, chunks
    with unused tiles, and the vocabulary's last tile (cut at 1000) at several positions
    of its chunk."""
    p = _problem(torch.bfloat16)
    logits = (p.hidden.float() @ p.weight.float().T).to(torch.bfloat16)  # [37, 1024]
    results = {}
    for name in layouts:
        bounds = LAYOUTS[name]
        per_rank = run_ranks(
            _logits_rank, len(bounds), logits, p.targets, bounds, tile, columns, timeout=120
        )
        for rank in range(1, len(bounds)):
            for k in range(3):
                assert_bitwise_equal(per_rank[rank][k], per_rank[0][k], f"{name} rank {rank}")
        results[name] = (*per_rank[0][:3], torch.cat([r[3] for r in per_rank], dim=1))
    for layout, got in results.items():
        for name, a, b in zip(
            ("logprob", "entropy", "lse", "grad"), got, results["tp1"], strict=True
        ):
            assert_bitwise_equal(a, b, f"{name}: {layout} vs tp1")
    g_lp, g_ent, g_lse = _upstream(p.n)
    truth = reference_from_logits(
        logits, p.targets, temperature=0.8, vocab_size=1000, ignore_index=p.ignore_index,
        grad_logprob=g_lp, grad_entropy=g_ent, grad_lse=g_lse,
    )  # fmt: skip
    for name, got in zip(("logprob", "entropy", "lse", "grad_logits"), results["tp1"], strict=True):
        tol = 1e-5 if name != "grad_logits" else 1e-2  # the gradient is stored in bf16
        scale = float(truth[name].abs().max())
        assert_close(got, truth[name], rtol=tol, atol=tol * scale, name=name)


def _default_tile_rank(rank, world, problem, bounds, tile):
    start, size = bounds[rank]
    out = linear_logprob(
        problem.hidden, problem.weight[start : start + size], problem.targets,
        tp_group=dist.group.WORLD, vocab_start=start, deterministic=True,
        deterministic_tile=tile, return_lse=True, **problem.op_kwargs(),
    )  # fmt: skip
    return out.logprob, out.lse


def test_default_tile_is_an_eighth_of_the_padded_vocabulary_on_any_layout():
    """``deterministic_tile=None`` (the default) is ``default_deterministic_tile(V)``: for
    V = 3000, 3072 / 8 = 384 columns; the same bits as that tile given explicitly, on one
    process and on a 128-aligned layout off its grid (tiles cross shard bounds)."""
    from lp_kernels import default_deterministic_tile, deterministic_tile_for

    assert default_deterministic_tile(3000) == deterministic_tile_for(3000, 8) == 384
    assert default_deterministic_tile(151936) == 19072
    p = make_problem(9, 16, 3000, seed=2, padded_vocab=3072)
    one = [(0, 3072)]
    given = run_ranks(_default_tile_rank, 1, p, one, 384, timeout=60)[0]
    default = run_ranks(_default_tile_rank, 1, p, one, None, timeout=60)[0]
    off_grid = [(0, 640), (640, 1280), (1920, 1152)]  # 640 and 1920 are off the 384 grid
    tp3 = run_ranks(_default_tile_rank, 3, p, off_grid, None, timeout=60)
    for a, b in zip(given, default, strict=True):
        assert_bitwise_equal(b, a, "default tile vs 384")
    for rank in range(3):
        for a, b in zip(given, tp3[rank], strict=True):
            assert_bitwise_equal(b, a, f"TP 3 off the grid, rank {rank}, vs one process")


@pytest.mark.parametrize("tile, chunk", [(384, 256), (31104, 8192), (19072, 8192)])
def test_every_layout_makes_the_single_process_grad_weight_calls(tile, chunk):
    """With one tile per backward chunk, grad_W is one cuBLAS call per chunk, whose kernel
    (hence bits) follows the call's shape: every chunk a rank computes (one that runs into
    the halo included: its halo rows go back to their shards, which compute no head
    chunk) must be a chunk of the single-process plan, same global start and width,
    and every chunk of that plan must be computed. Pure bookkeeping, on many layouts."""
    import dataclasses

    from lp_kernels.backends.triton.plan import backward_chunks
    from lp_kernels.core.transform import LogitTransform
    from lp_kernels.core.types import LogprobParams

    vocab = 248320 if tile > 1000 else 1000
    base = LogprobParams(
        transform=LogitTransform(), ignore_index=-100, return_entropy=False, return_lse=False,
        vocab_start=0, vocab_size=vocab, chunk_size=64, deterministic=True,
        deterministic_tile=tile, shard_sizes=(vocab,),
    )  # fmt: skip

    def calls(p):
        chunks, _, _ = backward_chunks(p.tile_ownership(), p, chunk, True)
        return {(p.vocab_start + b, c) for b, c in chunks}

    single = calls(base)
    pad = -(-vocab // 128) * 128
    layouts = [[(0, pad)]]
    for world in (2, 3, 4, 8):  # Megatron's even shards, and uneven ones
        size = -(-vocab // (128 * world)) * 128
        layouts.append([(r * size, size) for r in range(world)])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        cuts = sorted(set(torch.randint(1, pad // 128, (5,), generator=gen).tolist()))
        bounds = [0, *(128 * c for c in cuts), pad]
        layouts.append([(a, b - a) for a, b in itertools.pairwise(bounds)])
    for layout in layouts:
        starts, sizes = tuple(a for a, _ in layout), tuple(s for _, s in layout)
        got = set()
        for rank, (start, _) in enumerate(layout):
            p = dataclasses.replace(
                base, vocab_start=start, shard_starts=starts, shard_sizes=sizes, tp_rank=rank
            )
            got |= calls(p)
        assert got <= single, f"{layout}: calls not made by one process: {sorted(got - single)}"
        assert got == single, f"{layout}: chunks no rank computes: {sorted(single - got)}"
