"""The triton backend's host planners (``lp_kernels.backends.triton.plan``): pure functions
of sizes, the layout and the config. Their contracts: chunks cover their range in order,
none empty and none past its bound; a plan that sets a summation order never reads N and
cuts every rank alike; a plan that follows N only regroups launches."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import lp_kernels.backends.triton.config as tri
import lp_kernels.backends.triton.plan as plan
from lp_kernels.backends.triton.config import (
    GPU_CONFIG,
    INTERPRET_CONFIG,
    LOSS_GRAD_BYTES,
    LOSS_LOGITS_BYTES,
    use_config,
)
from lp_kernels.backends.triton.deterministic import deterministic_config
from lp_kernels.core.stats import N_STATS
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogprobParams

CUDA = torch.device("cuda", 0)  # never touched: the planners only read the device's type


def _params(vocab: int, **kw) -> LogprobParams:
    base = {
        "transform": LogitTransform(), "ignore_index": -100, "return_entropy": False,
        "return_lse": False, "vocab_start": 0, "vocab_size": vocab, "chunk_size": 64,
        "shard_sizes": (vocab,), "max_v_local": vocab,
    }  # fmt: skip
    return LogprobParams(**{**base, **kw})


def _covers(chunks: list[tuple[int, int]], begin: int, end: int) -> bool:
    """Whether ``(v_begin, v_count)`` chunks tile ``[begin, end)`` in order, none empty."""
    if not chunks:
        return begin == end
    ordered = all(b + c == nb for (b, c), (nb, _) in itertools.pairwise(chunks))
    last_b, last_c = chunks[-1]
    return (
        chunks[0][0] == begin
        and ordered
        and last_b + last_c == end
        and min(c for _, c in chunks) > 0
    )


# ----------------------------------------------------------------------------- the forward


def test_split_width_follows_the_vocabulary_width():
    """1024 columns where that leaves at least 32 splits, else 512; never from N."""
    assert GPU_CONFIG.forward.v_split == 1024 and GPU_CONFIG.forward.narrow_split == 512
    assert plan.split_width(151936, GPU_CONFIG) == 1024
    assert plan.split_width(31 * 1024 + 1, GPU_CONFIG) == 1024  # 32 splits, the last 1 column
    assert plan.split_width(31 * 1024, GPU_CONFIG) == 512
    assert plan.split_width(18992, GPU_CONFIG) == 512  # a TP 8 shard of a 152k vocabulary
    assert plan.split_width(1, GPU_CONFIG) == 512
    # the interpreter's config never narrows; a config may turn it off
    assert plan.split_width(300, INTERPRET_CONFIG) == INTERPRET_CONFIG.forward.v_split
    assert plan.split_width(300, GPU_CONFIG.replace(forward={"narrow_split": 0})) == 1024
    # deterministic=True: the rule on the tile's width (the same on every layout)
    cpu = torch.device("cpu")
    for tile, width in ((151936 // 8 // 128 * 128 + 128, 512), (65536, 1024), (128, 128)):
        with use_config(GPU_CONFIG):
            cfg, _ = deterministic_config(cpu, torch.bfloat16, tile)
        assert cfg.forward.v_split == width, (tile, cfg.forward.v_split)


@pytest.mark.parametrize("vocab, world", [(151936, 8), (151936, 1), (1000, 3), (50, 2)])
def test_shard_splits_are_the_same_on_every_rank(vocab, world):
    """Every rank of a layout splits with the width and count of the group's widest shard,
    whatever its own width: the partials line up for the merge across ranks."""
    size = -(-vocab // (128 * world)) * 128
    widths = [min(size, vocab - r * size) for r in range(world)]
    plans = {
        plan.shard_splits(v, _params(vocab, max_v_local=size), GPU_CONFIG) for v in widths if v > 0
    }
    assert len(plans) == 1
    width, count = plans.pop()
    assert (
        width == plan.split_width(size, GPU_CONFIG) and count * width >= size > (count - 1) * width
    )


def test_tile_splits_cover_the_tile():
    for tile in (128, 1000, 1024, 1025, 20096):
        splits = plan.tile_splits(tile, GPU_CONFIG)
        v = GPU_CONFIG.forward.v_split
        assert splits * v >= tile > (splits - 1) * v


def test_merge_block_k_is_a_positive_launch_width():
    for entropy in (False, True):
        for dev in (torch.device("cpu"), CUDA):
            assert plan.merge_block_k(entropy, dev) in (4, 16)


# ----------------------------------------------------------------------------- the backward


@pytest.mark.parametrize(
    ("m", "n", "width"),
    [
        (1024, 2048, 128),  # 64 blocks of 128 x 256 for 132 SMs: the narrow grid, one wave
        (1024, 4096, 256),  # 128 wide blocks: one wave either way
        (2048, 2048, 256),
        (1152, 4096, 128),  # 144 wide blocks: two waves, the second almost empty
        (16384, 2048, 256),  # S2's grad_hidden: 1024 blocks
        (8192, 4096, 256),  # S1's
        (1, 2048, 128),
        (300, 100, 128),
    ],
)
def test_gemm_output_block_follows_the_grid(m, n, width, monkeypatch):
    """lp's GEMM takes the narrow output block only where the pinned one leaves the GPU
    mostly idle (a wave model with the narrow program's measured cost). This is the one block
    chosen by size: it does not change the bits (test_determinism, test_gpu)."""
    monkeypatch.setattr(tri, "smem_per_block", lambda device: 227 << 10)
    monkeypatch.setattr(plan, "sm_count", lambda device: 132)  # where mm_block_n reads it
    bf16, fp32 = tri.config_for(CUDA, torch.bfloat16), tri.config_for(CUDA, torch.float32)
    assert plan.narrow_block_n(bf16) == 128 and plan.narrow_block_n(fp32) == fp32.gemm.block_n
    assert plan.mm_block_n(bf16, m, n, CUDA) == width
    assert plan.mm_block_n(fp32, m, n, CUDA) == fp32.gemm.block_n  # already narrow: kept
    monkeypatch.setattr(plan, "sm_count", lambda device: None)  # the interpreter: no waves
    assert plan.mm_block_n(bf16, m, n, CUDA) == bf16.gemm.block_n
    monkeypatch.undo()
    assert tri.sm_count(torch.device("cpu")) is None


@pytest.mark.parametrize("v_real", [1, 127, 128, 2048, 8191, 8192, 8193, 151936, 18992])
@pytest.mark.parametrize("per_launch", [1, 2, 3])
def test_vocab_chunks_cover_the_shard(v_real, per_launch):
    """The default backward's launches cover the shard in order, each ``per_launch``
    vocabulary chunks wide but the last; the buffer holds the widest, its width a multiple
    of 128 set by the chunk and the shard alone (the same on every rank of even shards)."""
    chunks, width = plan.vocab_chunks(v_real, GPU_CONFIG, per_launch)
    step = per_launch * GPU_CONFIG.backward.vocab_chunk
    assert _covers(chunks, 0, v_real)
    assert all(c == step for _, c in chunks[:-1])
    assert width % 128 == 0 and max(c for _, c in chunks) <= width <= step


def test_chunks_per_launch_follows_n_within_the_scratch_bound(monkeypatch):
    """Several vocabulary chunks per launch only at small N with the narrow GEMM block, and
    never more rows x chunks than one token chunk's d_logits buffer holds, nor more chunks
    than the shard has."""
    monkeypatch.setattr(tri, "smem_per_block", lambda device: 227 << 10)
    monkeypatch.setattr(plan, "sm_count", lambda device: 132)
    cfg = tri.config_for(CUDA, torch.bfloat16)
    bc = cfg.backward
    v = 151936
    assert plan.chunks_per_launch(0, 2048, v, cfg, CUDA) == 1
    assert plan.chunks_per_launch(bc.token_chunk, 2048, v, cfg, CUDA) == 1
    for n in (1, 13, 1000, 1024, 2048, 4096):
        k = plan.chunks_per_launch(n, 2048, v, cfg, CUDA)
        assert 1 <= k <= -(-v // bc.vocab_chunk) and (k == 1 or k * n <= bc.token_chunk)
        if k > 1:
            assert plan.mm_block_n(cfg, n, 2048, CUDA) == plan.narrow_block_n(cfg)
    assert plan.chunks_per_launch(3, 2048, 5000, cfg, CUDA) == 1  # one chunk in the shard


# ----------------------------------------------------------------------------- deterministic=True


@pytest.mark.parametrize(
    "v_real, tile, chunk, chunks, width",
    [
        (1000, 128, 512, [(0, 512), (512, 488)], 512),  # several tiles per chunk
        (300, 128, 512, [(0, 300)], 384),  # a narrow shard: a narrower buffer
        (1000, 384, 512, [(0, 384), (384, 384), (768, 232)], 384),  # one tile per chunk
        (200, 384, 512, [(0, 200)], 384),  # ... its width set by the tile alone
        (1000, 640, 512, [(0, 384), (384, 256), (640, 360)], 384),  # tiles cut in two
        (2000, 1408, 512, [(0, 512), (512, 512), (1024, 384), (1408, 512), (1920, 80)], 512),
    ],
)
def test_tile_chunks(v_real, tile, chunk, chunks, width):
    """The backward's vocabulary chunks: tile-aligned, in order, covering the shard, and (one
    tile per chunk or less) cut by the tile alone, so every layout cuts a global tile alike."""
    got, got_width = plan.tile_chunks(v_real, tile, chunk)
    assert (got, got_width) == (chunks, width)
    assert _covers(got, 0, v_real)


@pytest.mark.parametrize("tile", [384, 640, 1408, 20096])
def test_tile_chunks_cut_a_tile_alike_on_every_shard(tile):
    """With one tile per chunk or fewer, a whole tile's cuts and the width depend on the tile
    and the chunk only: a shard of 1, 2 or 5 tiles (the last cut short) cuts each alike."""
    chunk = 512 if tile < 20000 else 8192
    alone, width = plan.tile_chunks(tile, tile, chunk)
    for tiles in (2, 5):
        v_real = tiles * tile - 77
        got, got_width = plan.tile_chunks(v_real, tile, chunk)
        assert got_width == width and _covers(got, 0, v_real)
        first = [c for c in got if c[0] < tile]
        assert first == alone


def test_tile_launch_k_joins_chunks_only_at_small_n():
    cfg = INTERPRET_CONFIG.replace(backward={"vocab_chunk": 256}, forward={"v_split": 256})
    assert plan.tile_launch_k(3, 384, cfg) == 256  # 384 columns: two chunks of one tile
    assert plan.tile_launch_k(100, 384, cfg) is None  # 2 x 100 rows pass the token chunk
    assert plan.tile_launch_k(0, 384, cfg) is None
    assert plan.tile_launch_k(3, 128, cfg) is None  # several tiles per chunk
    assert plan.tile_launch_k(3, 256, cfg) is None  # one chunk per tile: nothing to join


def test_tiles_per_round_within_its_memory_budget():
    """DeterministicConfig.round_tiles tiles rounded per pass, fewer where the rank owns fewer
    tiles or the buffers past the first would pass ROUND_EXTRA_BYTES (4 bytes per element
    of [N, H])."""
    assert plan.ROUND_EXTRA_BYTES == 512 << 20
    assert plan.tiles_per_round(8, 16384, 2048, 4) == 4  # S4: 3 x 128 MiB
    assert plan.tiles_per_round(8, 32768, 4096, 4) == 2  # S3: 1 x 512 MiB
    assert plan.tiles_per_round(8, 65536, 8192, 4) == 1  # 2 GiB per buffer: one at a time
    assert plan.tiles_per_round(3, 16384, 2048, 4) == 3  # as many as the rank's tiles
    assert plan.tiles_per_round(0, 0, 2048, 4) == 1


@pytest.mark.parametrize("tile, world, max_tiles", [(128, 1, 1187), (20096, 8, 1), (384, 3, 9)])
def test_stats_rows_keep_the_partials_within_budget(tile, world, max_tiles):
    """Rows per forward token chunk of ``deterministic=True``: whole row blocks, and the
    partials of the rank's splits or of the gathered tiles within STATS_BYTES (at least one
    row block)."""
    p = _params(151936, deterministic=True, deterministic_tile=tile, tp_size=world)
    rows = plan.stats_rows(p, GPU_CONFIG, max_tiles)
    block_n = GPU_CONFIG.logits.block_n
    per_row = max_tiles * max(plan.tile_splits(tile, GPU_CONFIG), world) * N_STATS * 4
    assert rows % block_n == 0 and rows >= block_n
    assert rows == block_n or rows * per_row <= plan.STATS_BYTES


def test_backward_chunks_cover_the_owned_columns():
    """A rank's chunks: the head (columns of a tile that starts on an earlier rank) first when
    tiles share a chunk, then its owned tiles and halo in order."""
    vocab, tile, chunk = 1000, 128, 512
    layout = {"shard_starts": (0, 384, 768), "shard_sizes": (384, 384, 256), "tp_size": 3}
    for rank, start in enumerate(layout["shard_starts"]):
        p = _params(
            vocab, deterministic=True, deterministic_tile=tile, tp_rank=rank,
            vocab_start=start, max_v_local=384, **layout,
        )  # fmt: skip
        own = p.tile_ownership()
        chunks, heads, width = plan.backward_chunks(own, p, chunk, need_w=True)
        assert heads == (1 if own.skip else 0)
        assert _covers(chunks, 0, own.skip + own.ext)
        assert width % 128 == 0 and max(c for _, c in chunks) <= width
        no_w, heads_no_w, _ = plan.backward_chunks(own, p, chunk, need_w=False)
        assert heads_no_w == 0 and no_w == chunks[heads:]
    wide = dataclasses.replace(p, deterministic_tile=384)  # one tile per chunk: no head chunk
    assert plan.backward_chunks(wide.tile_ownership(), wide, chunk, True)[1] == 0


# ----------------------------------------------------------------------------- the fused loss


def test_pow2_floor():
    assert [plan.pow2_floor(x) for x in (0, 1, 2, 3, 4, 1000, 1024, 1025)] == [
        1, 1, 2, 2, 4, 512, 1024, 1024,
    ]  # fmt: skip


@pytest.mark.parametrize("vocab, max_v_local", [(151936, 151936), (151936, 18992), (262144, 32768)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_loss_chunk_rows_within_the_byte_budgets(vocab, max_v_local, itemsize):
    """``(R, G)``: from the config, the budgets and the group's widest shard (never N): R at
    least 16 and at most the config's rows, its fp32 logits within LOSS_LOGITS_BYTES; G a
    multiple of R, its d_logits within LOSS_GRAD_BYTES unless R alone passes it. The
    caller's chunk_size sets both."""
    p = _params(vocab, max_v_local=max_v_local)
    r, g = plan.chunk_rows(p, GPU_CONFIG, itemsize, None)
    width = -(-max_v_local // 128) * 128
    assert 16 <= r <= GPU_CONFIG.loss.rows and (r == 16 or r * width * 4 <= LOSS_LOGITS_BYTES)
    assert g % r == 0 and (g == r or g * width * itemsize <= LOSS_GRAD_BYTES)
    assert plan.chunk_rows(p, GPU_CONFIG, itemsize, 100) == (100, 100)


def test_logits_chunks_fill_the_waves():
    """The logits chunks of a gradient chunk: they cover it in order, none past the bound,
    and take no more waves than equal chunks of the bound do."""

    def waves(sizes, splits, sms):
        return sum(-(-(-(-k // 128) * splits) // sms) for k in sizes)

    assert plan.logits_chunks(8192, 2048, 128, 19, None) == [2048] * 4
    assert plan.logits_chunks(8192, 2048, 128, 19, 132) == [1664] * 4 + [1536]  # 10 waves
    assert plan.logits_chunks(2048, 2048, 128, 38, 132) == [2048]
    assert plan.logits_chunks(0, 2048, 128, 38, 132) == []
    for rows in (1, 127, 128, 129, 1000, 4096, 8191, 8192, 12345):
        for r_max in (128, 640, 2048, 8192):
            for splits, sms in ((1, 132), (19, 132), (38, 132), (31, 78), (8, 7)):
                sizes = plan.logits_chunks(rows, r_max, 128, splits, sms)
                plain = plan.logits_chunks(rows, r_max, 128, splits, None)
                assert sum(sizes) == rows and all(0 < k <= r_max for k in sizes)
                assert all(k % 128 == 0 for k in sizes[:-1])
                assert waves(sizes, splits, sms) <= waves(plain, splits, sms)
