"""How a call is cut: the triton backend's host planners.

Pure functions of sizes, the tensor-parallel layout and the :class:`KernelConfig` (no
tensors, no launches): the forward's splits, the backward's vocabulary chunks and how many
share a launch, ``deterministic=True``'s tile chunks and rounding, the fused loss's row
chunks, and the GEMM's output block. Two rules hold for every one of them:

- a plan that changes a summation order (a split, a chunk that a sum runs over) follows
  the vocabulary's width, the layout and the config only, never N: a row's bits do not
  depend on the batch, and every rank cuts alike;
- a plan that follows N (a launch's width, how many chunks share a launch) changes only
  which programs run when, never a bit.
"""

from __future__ import annotations

import torch
import triton

from lp_kernels.backends.triton.config import (
    LOSS_GRAD_BYTES,
    LOSS_LOGITS_BYTES,
    KernelConfig,
    pad128,
    sm_count,
)
from lp_kernels.core.stats import N_STATS
from lp_kernels.core.tiles import TileOwnership
from lp_kernels.core.types import LogprobParams

# ----------------------------------------------------------------------------- the forward


def split_width(cols: int, cfg: KernelConfig) -> int:
    """Columns per forward split of a ``cols``-wide vocabulary (the widest shard of the
    group, or a ``deterministic=True`` tile): ``v_split``, or ``narrow_split`` where that
    would leave fewer than ``min_splits`` splits. A function of the vocabulary's width and
    the config only: every N, and every rank, splits alike."""
    fwd = cfg.forward
    if fwd.narrow_split <= 0 or triton.cdiv(cols, fwd.v_split) >= fwd.min_splits:
        return fwd.v_split
    return fwd.narrow_split


def shard_splits(v_real: int, p: LogprobParams, cfg: KernelConfig) -> tuple[int, int]:
    """``(width, count)`` of a shard's forward splits outside ``deterministic=True``: the
    width from the group's widest shard (:func:`split_width`), so every rank cuts alike,
    and as many splits as that shard needs."""
    cols = max(p.max_v_local, v_real)
    width = split_width(cols, cfg)
    return width, triton.cdiv(cols, width)


def tile_splits(tile: int, cfg: KernelConfig) -> int:
    """Forward splits per ``tile``-column tile: ``forward.v_split`` columns each from the
    tile's first column, the last cut at the tile's end."""
    return triton.cdiv(tile, cfg.forward.v_split)


def merge_block_k(entropy: bool, device: torch.device) -> int:
    """Partials whose loads the merges keep in flight at a time (a launch choice: each
    partial is still added in its turn): 16 without entropy and 4 with it (four loads per
    partial) timed best on the GPU."""
    if device.type == "cpu":
        return 4
    return 4 if entropy else 16


# ----------------------------------------------------------------------------- the backward


def narrow_block_n(cfg: KernelConfig) -> int:
    """The GEMM's narrow output block width: half the pinned 256, else the pinned width (the
    configs of smaller GPUs, 4-byte inputs and the interpreter are narrow already)."""
    wide = cfg.gemm.block_n
    return wide // 2 if wide >= 256 else wide


def mm_block_n(cfg: KernelConfig, m: int, n: int, device: torch.device) -> int:
    """Output block width of lp's GEMM ``C [m, n] (+)= A @ B``: the config's, or half of it
    where the pinned grid would leave much of the GPU idle in its last wave (grad_hidden at
    about a thousand rows and H = 2048 has 64 blocks of 128 x 256 for 132 SMs: half the GPU
    idles). The narrow block wins when its waves, each costing ``gemm.narrow_cost`` of a
    wide one, take less time.

    Unlike every other block of this backend, this one follows the sizes, because it does
    not change the bits: each element of C gets the same MMAs in the same K order in a 128-
    or a 256-wide block (tested: test_gpu.py). So a row's grad_hidden stays the same
    whatever N, and batch invariance holds.
    """
    wide, narrow = cfg.gemm.block_n, narrow_block_n(cfg)
    sms = sm_count(device)
    if sms is None or narrow == wide:
        return wide
    rows = triton.cdiv(m, cfg.gemm.block_m)
    waves_wide = triton.cdiv(rows * triton.cdiv(n, wide), sms)
    waves_narrow = triton.cdiv(rows * triton.cdiv(n, narrow), sms)
    return narrow if waves_narrow * cfg.gemm.narrow_cost < waves_wide else wide


def vocab_chunks(v_real: int, cfg: KernelConfig, per_launch: int = 1):
    """``(chunks, width)``: the default backward's launches over a shard's ``v_real``
    columns, ``(v_begin, v_count)`` each, and the d_logits buffer's columns.

    A launch covers ``per_launch`` vocabulary chunks of ``backward.vocab_chunk`` columns
    (:func:`chunks_per_launch`), the last one cut at the shard's end. The width is a
    multiple of 128, so the buffer's row stride specializes alike on every shard (the
    kernels' code must not depend on the shard's width)."""
    step = per_launch * cfg.backward.vocab_chunk
    chunks = [(v_begin, min(step, v_real - v_begin)) for v_begin in range(0, v_real, step)]
    return chunks, min(step, pad128(v_real))


def chunks_per_launch(n: int, h_dim: int, v_real: int, cfg: KernelConfig, device) -> int:
    """Vocabulary chunks the default backward handles per launch: 1, or, when its N rows fill
    at most half a token chunk and grad_hidden's GEMM takes the narrow block anyway
    (:func:`mm_block_n`), as many chunks as a full token chunk's d_logits buffer holds
    (``token_chunk // N``; the same scratch bound), at most the shard's.

    At a thousand tokens the host, issuing three to four launches per vocabulary chunk,
    would otherwise set the step's pace. A launch of several chunks makes one d_logits
    launch, one grad_W GEMM and one grad_hidden GEMM whose ``chunk_k`` keeps each chunk's
    sum and the order of the additions: a row's bits are those of one launch per chunk,
    whatever N. It needs the narrow GEMM block, so where the pinned one fills the GPU the
    default stays one chunk per launch.
    """
    bc = cfg.backward
    if n == 0 or 2 * n > bc.token_chunk:
        return 1
    if mm_block_n(cfg, n, h_dim, device) != narrow_block_n(cfg):
        return 1
    return max(1, min(bc.token_chunk // n, triton.cdiv(v_real, bc.vocab_chunk)))


# ----------------------------------------------------------------------------- deterministic=True

# Tiles wider than half a vocabulary chunk (the default tile's plan): the memory that the
# fp32 products waiting to be rounded (DeterministicConfig.round_tiles tiles, each its own
# [N, H] buffer) may take beyond the first. A pass reads and writes the int64 sum (16 bytes
# per element) once per round instead of once per tile.
ROUND_EXTRA_BYTES = 512 << 20
STATS_BYTES = 128 << 20
"""All-gathered forward partials per token chunk (:func:`stats_rows`)."""


def tile_chunks(v_real: int, tile: int, chunk: int) -> tuple[list[tuple[int, int]], int]:
    """The backward's vocabulary chunks ``(v_begin, v_count)`` of owned tiles and the widest.

    Tiles up to ``chunk`` columns: chunks of as many whole tiles as fit in ``chunk``, from
    the first tile's start. Wider tiles: each tile cut into the same number of near-equal
    chunks (multiples of 128) from its start. With one tile per chunk (tiles wider than
    half a chunk) the cuts and the width (a multiple of 128) depend only on ``tile`` and
    ``chunk``, never on the shard, so every layout cuts a global tile alike."""
    if tile <= chunk:
        step = chunk // tile * tile
        chunks = [(b, min(step, v_real - b)) for b in range(0, v_real, step)]
        # one tile per chunk: the width must not follow the shard (see the backward)
        return chunks, step if 2 * tile > chunk else min(step, pad128(v_real))
    width = pad128(triton.cdiv(tile, triton.cdiv(tile, chunk)))
    chunks = []
    for l0 in range(0, v_real, tile):
        end = min(l0 + tile, v_real)
        chunks += [(b, min(width, end - b)) for b in range(l0, end, width)]
    return chunks, width


def tile_launch_k(n: int, tile: int, cfg: KernelConfig) -> int | None:
    """The chunk width (:func:`tile_chunks`) whose chunks the backward joins into one
    launch per tile, or None (one launch per chunk).

    Tiles wider than half a vocabulary chunk, at small N: when the N rows fill at most half
    a token chunk and a whole tile's d_logits fits the chunk's scratch bound, a tile takes
    one d_logits launch, one grad_W GEMM and grad_hidden's GEMM with ``chunk_k`` (the chunk
    width), which keeps each chunk's sum and the order of the additions
    (``gemm.matmul_acc``): grad_hidden's bits are those of one launch per chunk, whatever N.
    The choice follows N, the tile and the config, never the shard or the rank's device,
    so every layout makes the same calls (grad_W's cuBLAS GEMM takes the joined shape)."""
    bc = cfg.backward
    if 2 * tile <= bc.vocab_chunk or n == 0 or 2 * n > bc.token_chunk:
        return None
    if n * pad128(tile) > bc.token_chunk * bc.vocab_chunk:
        return None
    chunks, width = tile_chunks(tile, tile, bc.vocab_chunk)
    return width if len(chunks) > 1 else None


def tiles_per_round(tiles: int, n: int, h_dim: int, most: int) -> int:
    """Tiles rounded into grad_hidden's int64 sum per pass (one fp32 [n, h_dim] buffer
    each): at most ``most`` (``DeterministicConfig.round_tiles``) and the owned ``tiles``,
    and the buffers past the first within ``ROUND_EXTRA_BYTES``. Any value gives the same
    bits."""
    extra = ROUND_EXTRA_BYTES // max(1, 4 * n * h_dim)
    return max(1, min(most, tiles, 1 + extra))


def stats_rows(p: LogprobParams, cfg: KernelConfig, max_tiles: int) -> int:
    """Rows per forward token chunk: this rank's partials (every split of its tiles) and the
    gathered ones (one per tile and rank) stay within STATS_BYTES."""
    splits, ranks = tile_splits(p.deterministic_tile, cfg), max(p.tp_size, 1)
    tiles = max(max_tiles, 1) * max(splits, ranks)
    rows = STATS_BYTES // (tiles * N_STATS * 4)
    block_n = cfg.logits.block_n
    return max(block_n, rows // block_n * block_n)


def backward_chunks(own: TileOwnership, p: LogprobParams, chunk: int, need_w: bool):
    """``(chunks, heads, width)``: the backward's vocabulary chunks ``(v_begin, v_count)``
    over this shard's real rows followed by its halo, the number of leading head chunks
    (grad_W only), and the d_logits buffer's width.

    Owned tiles are cut by :func:`tile_chunks` from the first one's start (column
    ``own.skip``). The head (the shard's first ``skip`` columns, in a tile that starts on an
    earlier rank) is one chunk when tiles share a chunk. With one tile per chunk it has
    none: the tile's owner computes the head's grad_W rows with the rest of its chunk, in
    the call it makes on a layout where the tile is whole, and sends them here
    (:func:`~lp_kernels.distributed.halo.return_halo_grad`)."""
    tile = p.deterministic_tile
    owned, width = tile_chunks(own.ext, tile, chunk)
    chunks = []
    if need_w and own.skip and 2 * tile <= chunk:
        chunks.append((0, own.skip))
        width = max(width, pad128(own.skip))
    heads = len(chunks)
    chunks += [(own.skip + b, c) for b, c in owned]
    return chunks, heads, width


# ----------------------------------------------------------------------------- the fused loss


def pow2_floor(x: int) -> int:
    """The largest power of two at most ``x`` (1 for ``x <= 1``)."""
    return 1 << max(int(x).bit_length() - 1, 0)


def chunk_rows(p: LogprobParams, cfg: KernelConfig, itemsize: int, rows: int | None):
    """``(R, G)``: rows of a logits chunk and of a gradient chunk (a multiple of R).

    From the config, the byte budgets and the widest shard of the group (so every rank
    makes the same chunks and exchanges), or the caller's ``rows`` (``chunk_size``) for
    both; never from N."""
    if rows is not None:
        return rows, rows
    width = pad128(max(1, min(p.max_v_local, p.vocab_size)))
    r = max(16, min(cfg.loss.rows, pow2_floor(LOSS_LOGITS_BYTES // (4 * width))))
    g = min(cfg.loss.grad_rows, pow2_floor(LOSS_GRAD_BYTES // (itemsize * width)))
    return r, max(r, g // r * r)


def logits_chunks(rows: int, r_max: int, block_n: int, splits: int, sms: int | None) -> list[int]:
    """Row counts of the logits chunks that cover a gradient chunk of ``rows`` rows, each at
    most ``r_max``: the count and sizes whose forward launches waste the fewest program
    slots on ``sms`` multiprocessors.

    A chunk of ``k`` rows launches ``cdiv(k, block_n) * splits`` programs of equal work
    (the last split's may be shorter), so it takes ``cdiv(programs, sms)`` waves; the
    count with the fewest waves in all wins, the fewer chunks on a tie (each chunk costs
    a launch, an exchange and a ``loss_fn`` call), among equal chunks of ``r_max`` rows
    and a shorter last one, and row blocks spread evenly over each count from the
    fewest up (larger first). Only the launch changes: every row's statistics and
    logits are its own. ``sms`` None (no waves to fit, or ranks that need not agree on
    it), or ``r_max`` not a multiple of ``block_n``: equal chunks of ``r_max`` rows and a
    shorter last one.
    """
    if rows <= 0:
        return []
    plain = [min(r_max, rows - r0) for r0 in range(0, rows, r_max)]
    if sms is None or rows <= block_n or r_max % block_n:
        return plain
    units = triton.cdiv(rows, block_n)
    unit_max = max(1, r_max // block_n)
    candidates = [[triton.cdiv(k, block_n) for k in plain]]  # full blocks, then the rest
    first = triton.cdiv(units, unit_max)
    for count in range(first, min(units, first + 8) + 1):  # balanced, larger first
        q, extra = divmod(units, count)
        candidates.append([q + 1] * extra + [q] * (count - extra))
    best = min(
        (sum(triton.cdiv(u * splits, sms) for u in parts), len(parts), i)
        for i, parts in enumerate(candidates)
        if max(parts) <= unit_max
    )
    sizes = [u * block_n for u in candidates[best[2]]]
    sizes[-1] -= sum(sizes) - rows  # the last block ends at the gradient block's end
    return sizes
