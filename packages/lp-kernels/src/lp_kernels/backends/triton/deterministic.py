"""``deterministic=True`` for the triton backend: bitwise tensor-parallel invariance.

Outputs and both gradients are bitwise identical for any TP degree and any shard
layout whose bounds are multiples of 128, for a given tile width ``w =
deterministic_tile`` (default ``default_deterministic_tile(V)``, about V / 8; any
multiple of 128), and stay batch-invariant and reproducible run to run. A rank owns the
global w-column tiles that start in its shard; the rows of the next shards that its last
tile needs (the halo) arrive by point-to-point sends (``distributed.halo.tile_ownership``,
``exchange_halo``). Data flow for one rank::

    forward   halo rows; W_all = the shard's real rows, then the halo (never joined
              whole: the tiles within the shard read it in place, the crossing tile a copy
              of its own rows joined to the halo, in a launch of its own)
              per token chunk (rows fixed by the global tile count, never by N):
                fwd_stats_kernel over the owned tiles of W_all, S = cdiv(w, v_split)
                    splits per tile, cut from the tile's first column (TILE_W = w): one
                    partial (m, s, a, t) per row, owned tile and split  [T_max * S, rows, 4]
                group_merge_kernel: each tile's S partials in order -> one per tile
                all-gather -> [P, T_max, rows, 4]; merge_kernel visits the partials in
                    (rank, tile) order = the global order, with empty partials
                    (m = -inf, s = a = t = 0) after each rank's owned tiles; adding an
                    exact zero leaves an fp32 sum unchanged, so every layout merges alike
    backward  per vocabulary span of W_all (backward_spans; from the first span that runs into the
              halo on, over a copy of those rows joined to it: _span_blocks), per token chunk:
                dlogits_kernel (as in the default path)
                head fragment (the shard's columns in an earlier rank's tile): grad_W only,
                    here with several tiles per piece, else by the tile's owner (below)
                w <= half a vocabulary chunk: a piece holds several owned tiles from the
                first one's start, so its width follows the layout
                  grad_W[piece] += d l^T @ h   lp's fixed-tile GEMM (gemm.matmul_acc):
                                              a row's result never depends on the width,
                                              unlike cuBLAS' shape-picked kernels
                  grad_h (int64) += round(2^e_n * (d l[:, tile] @ W[tile])) per tile
                                              (fixed_point.matmul_fixed_kernel, which
                                              rounds each tile's fp32 dot in registers)
                wider tiles (the default's plan): a piece lies within one tile, cut from
                the tile's start by the tile's width alone, so every layout makes the same
                calls (a piece that runs into the halo is computed whole; the halo's
                grad_W rows go back to their shards: distributed.halo.return_halo_grad)
                  grad_W[piece] = d l^T @ h   cuBLAS, as the default path (the same
                                              shapes, strides and alignment everywhere)
                  F_t (fp32) += d l @ W[piece]  the default path's GEMM, one buffer per
                                              tile of a group of TileConfig.round_group tiles;
                                              at the group's end, one pass (round_into):
                  grad_h (int64) += round(2^e_n * F_t) + round(2^e_n * F_t+1) + ...
              the int64 sums are exact, so neither the tile order nor the TP all-reduce
              (int64) can change the bits; grad_h = acc * 2^-e_n, one rounding
              (fixed_point.from_fixed_point; the scales from fixed_point.row_scales,
              lp_kernels.core.fixed_point's bound)

Cost: each tile's partial statistics and each tile's rounding of an [N, H] product are
the price of invariance, so wider tiles cost less: with the default tile the mode runs
within a few percent of the default path (docs/benchmarks.md); halos and head fragments
add work per shard bound crossed (docs/design.md).

Every owned tile is computed whole, from its first column, in launches that start on the
global column grid, and every element of a tile is computed by the same instruction
sequence whatever its position, so each tile's numbers are the same on every layout.
That also needs every layout to run the same compiled variant of each kernel: see
"Determinism" in ``lp_kernels.backends.triton.function`` on Triton's integer
specialization. ``benchmarks/profile_step.py --det --det-tile`` profiles a whole step at
any w.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from lp_kernels.backends.triton.backward import (
    dlogits_blocks,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
    upstream,
)
from lp_kernels.backends.triton.config import TileConfig, config_for, pad128, split_width
from lp_kernels.backends.triton.fixed_point import (
    HeadAbsMax,
    RowScales,
    fixed_tiles_for,
    from_fixed_point,
    matmul_fixed,
    round_into,
    row_scales,
)
from lp_kernels.backends.triton.forward import (
    forward_stats,
    gather_partials,
    merge_outputs,
    tile_splits,
)
from lp_kernels.backends.triton.gemm import matmul_acc
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.matmul import addmm_f32_, scratch
from lp_kernels.core.stats import N_STATS, bias_grad
from lp_kernels.core.tiles import DETERMINISTIC_TILE as TILE
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums
from lp_kernels.distributed.halo import bias_halo, owned_halo, return_halo_grad, with_halo

# Tiles wider than half a vocabulary chunk (the default tile's plan): the memory that the
# fp32 products waiting to be rounded (TileConfig.round_group tiles, each its own [N, H]
# buffer) may take beyond the first. A pass reads and writes the int64 sum (16 bytes per
# element) once for the group instead of once per tile.
ROUND_EXTRA_BYTES = 512 << 20
_STATS_BYTES = 128 << 20  # all-gathered forward partials per token chunk


def deterministic_config(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    tile: int = TILE,
    base: TileConfig | None = None,
) -> tuple[TileConfig, tuple[int, int, int]]:
    """``base`` (default: the default path's pinned ``config_for(device, dtype)``) with
    forward splits of ``split_width(tile, base)`` columns (at most the tile) cut from each
    ``tile``-column tile's first column (``forward.tile_splits`` per tile; 128-column logit
    tiles for 128, else the base's), and the fixed-point GEMM's tiles
    (``base.fixed_tiles``, else the pinned ones)."""
    base = config_for(device, dtype) if base is None else base
    block_v = TILE if tile < base.block_v else base.block_v
    cfg = dataclasses.replace(base, block_v=block_v, v_split=min(tile, split_width(tile, base)))
    return cfg, base.fixed_tiles or fixed_tiles_for(device, dtype)


def vocab_pieces(v_real: int, tile: int, chunk: int) -> tuple[list[tuple[int, int]], int]:
    """The backward's vocabulary pieces ``(v_begin, v_count)`` of a shard and the widest.

    Tiles up to ``chunk`` columns: pieces of as many whole tiles as fit in ``chunk``,
    from the shard's start (a tile edge). Wider tiles: each tile cut into the same number
    of near-equal pieces (multiples of 128) from its start. With one tile per piece
    (tiles wider than half a chunk) the cuts and the width (a multiple of 128) depend only
    on ``tile`` and ``chunk``, never on the shard, so every layout cuts a global tile
    alike."""
    if tile <= chunk:
        step = chunk // tile * tile
        spans = [(b, min(step, v_real - b)) for b in range(0, v_real, step)]
        # one tile per piece: the width must not follow the shard (see the backward)
        return spans, step if 2 * tile > chunk else min(step, pad128(v_real))
    width = pad128(triton.cdiv(tile, triton.cdiv(tile, chunk)))
    pieces = []
    for l0 in range(0, v_real, tile):
        end = min(l0 + tile, v_real)
        pieces += [(b, min(width, end - b)) for b in range(l0, end, width)]
    return pieces, width


def tile_groups(n: int, tile: int, chunk: int, cfg: TileConfig) -> int | None:
    """The width of the pieces (:func:`vocab_pieces`) that the backward merges into one span
    per tile, or None (one span per piece).

    Tiles wider than half a chunk, at small N: when the N rows fill at most half a token
    chunk and a whole tile's d_logits fits the chunk's scratch bound, a tile takes one
    d_logits launch (a few row blocks of a piece leave most of the GPU idle in their last
    wave), one grad_W GEMM and grad_hidden's GEMM with ``chunk_k`` (the piece width), which
    keeps each piece's sum and the order of the additions (``gemm.matmul_acc``: one launch
    on the narrow output tile, or one per piece on the wide one): grad_hidden's bits are
    those of one launch per piece, whatever N. The choice follows N, the tile and the
    config, never the shard or the rank's device, so every layout makes the same calls
    (grad_W's cuBLAS GEMM takes the merged shape)."""
    if 2 * tile <= chunk or n == 0 or 2 * n > cfg.token_chunk:
        return None
    if n * pad128(tile) > cfg.token_chunk * cfg.vocab_chunk:
        return None
    pieces, width = vocab_pieces(tile, tile, chunk)
    return width if len(pieces) > 1 else None


def round_slots(tiles: int, n: int, h_dim: int, group: int) -> int:
    """Tiles rounded into grad_hidden's int64 sum per pass (one fp32 [n, h_dim] buffer
    each): at most ``group`` (``TileConfig.round_group``) and the owned ``tiles``, and the
    buffers past the first within ``ROUND_EXTRA_BYTES``. Any value gives the same bits."""
    extra = ROUND_EXTRA_BYTES // max(1, 4 * n * h_dim)
    return max(1, min(group, tiles, 1 + extra))


def _stats_rows(p: LogprobParams, cfg: TileConfig, max_tiles: int) -> int:
    """Token rows per forward chunk: this rank's partials (every split of its tiles) and the
    gathered ones (one per tile and rank) stay within _STATS_BYTES."""
    splits, ranks = tile_splits(p.deterministic_tile, cfg), max(p.tp_size, 1)
    tiles = max(max_tiles, 1) * max(splits, ranks)
    rows = _STATS_BYTES // (tiles * N_STATS * 4)
    return max(cfg.block_n, rows // cfg.block_n * cfg.block_n)


def backward_spans(own, p: LogprobParams, chunk: int, need_w: bool):
    """The backward's vocabulary spans ``(v_begin, v_count)`` over this shard's
    real rows followed by its halo, the number of leading head-fragment spans (grad_W
    only), and the d_logits buffer's width.

    Owned tiles are cut by :func:`vocab_pieces` from the first one's start (column
    ``own.skip``). The head fragment (the shard's first ``skip`` columns, in a tile that
    starts on an earlier rank) is one span when tiles share a piece. With one tile per
    piece it has none: the tile's owner computes the fragment's grad_W rows with the rest
    of its piece, in the call it makes on a layout where the tile is whole, and sends them
    here (:func:`~lp_kernels.distributed.halo.return_halo_grad`)."""
    tile = p.deterministic_tile
    pieces, width = vocab_pieces(own.ext, tile, chunk)
    spans = []
    if need_w and own.skip and 2 * tile <= chunk:
        spans.append((0, own.skip))
        width = max(width, pad128(own.skip))
    n_frag = len(spans)
    spans += [(own.skip + b, c) for b, c in pieces]
    return spans, n_frag, width


def _weight_parts(w_real, halo, start: int, cross: int):
    """``[(c0, w), (cross, w_x)]``: the shard's columns ``[start, cross)`` as a view of its
    real rows, then, with a halo, the columns from ``cross`` on as a copy of those real rows
    joined to the halo (:func:`with_halo`), so that only the columns that run into
    the halo are copied, never the whole shard. Either may be empty."""
    parts = [(start, w_real[start:cross])]
    if halo.shape[0]:
        parts.append((cross, with_halo(w_real, halo, cross)))
    return parts


def _span_blocks(
    hidden, w_real, halo, targets, lse, mean_z, grads, p, cfg, spans, width, bias=None
):  # fmt: skip
    """:func:`dlogits_blocks` over the backward's spans (columns of the
    shard's real rows, then the halo), with each span's weight rows: ``(v_begin, v_count,
    blocks, w_span)``. Spans within the real rows read them in place; the spans from the
    first one that runs past them (into the halo) read a copy of the rows from its start
    joined to the halo (:func:`_weight_parts`): at most a tile or a vocabulary chunk. The
    d_logits buffer keeps its width, so every GEMM call is the one it would be on one
    joined operand. ``bias``: None, or ``(b_real, b_halo, grad_bias)``: the fp32 bias of
    the shard's real rows and of its halo, and the fp32 grad_bias over both (the column
    sums of d l are added to it)."""
    v_real = w_real.shape[0]
    k = next((j for j, (b, c, *_) in enumerate(spans) if b + c > v_real), len(spans))
    cross = spans[k][0] if k < len(spans) else v_real
    parts = _weight_parts(w_real, halo, 0, cross)  # one part without a halo (k = all)
    b_parts = [(None, None)] * len(parts)
    if bias is not None:
        b_real, b_halo, grad_bias = bias
        b_parts = [
            (b, None if grad_bias is None else grad_bias[c0 : c0 + b.shape[0]])
            for c0, b in _weight_parts(b_real, b_halo, 0, cross)
        ]
    for (c0, w), (b, g_b), sub in zip(parts, b_parts, (spans[:k], spans[k:]), strict=False):
        if not sub:
            continue
        local = [(b - c0, c) for b, c in sub]
        for v_begin, v_count, blocks in dlogits_blocks(
            hidden, w, targets, p.vocab_start + c0, lse, mean_z, grads, p, cfg, (local, width),
            b, g_b,
        ):  # fmt: skip
            yield c0 + v_begin, v_count, blocks, w[v_begin : v_begin + v_count]


class LinearLogprobTritonDeterministic(torch.autograd.Function):
    """TP-invariant fused implementation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        cfg, _ = deterministic_config(
            hidden.device, hidden.dtype, p.deterministic_tile, p.tile_config
        )
        hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
        own, halo = owned_halo(w_real, p)
        b_real, b_halo = bias_halo(bias, w_real.shape[0], p)
        # The owned tiles in one launch over the shard's rows, or, with a halo, two: the
        # tiles within the shard (a view), then the last one over its rows joined to the
        # halo (a copy of one tile); each launch's splits are whole tiles. Every rank
        # sends max_tiles partials: its owned tiles, then empty ones (the last launch's).
        tile = p.deterministic_tile
        cross = own.skip + (own.tiles - 1) * tile if halo.shape[0] else own.skip + own.ext
        parts = _weight_parts(w_real, halo, own.skip, cross)
        b_parts = [None] * len(parts)
        if b_real is not None:
            b_parts = [b for _, b in _weight_parts(b_real, b_halo, own.skip, cross)]
        launches = [(c0, w, b) for (c0, w), b in zip(parts, b_parts, strict=True) if w.shape[0]]
        launches = launches or [(*parts[0], b_parts[0])]
        fwd = []
        for i, (c0, w, b) in enumerate(launches):
            tiles = triton.cdiv(w.shape[0], tile)
            if i == len(launches) - 1:
                tiles = own.max_tiles - (c0 - own.skip) // tile
            # the launch's first row is vocabulary id vocab_start + c0 (the halo follows the
            # shard's real rows)
            fwd.append((w, p.vocab_start + c0, dataclasses.replace(p, max_v_local=tiles * tile), b))
        n = hidden.shape[0]
        parts = []
        step = _stats_rows(p, cfg, own.max_tiles)
        for r0 in range(0, max(n, 1), step):
            r1 = min(n, r0 + step)
            stats = [
                forward_stats(hidden[r0:r1], w, targets[r0:r1], first, pf, cfg, b, tile=tile)
                for w, first, pf, b in fwd
            ]
            stats = stats[0] if len(stats) == 1 else torch.cat(stats)  # [T_max * S, rows, 4]
            # each tile's splits merged into one partial, then gathered: [P * T_max, rows, 4]
            gathered = gather_partials(stats, p, tile_splits(tile, cfg))
            lse, mean_z, outputs = merge_outputs(
                gathered, targets[r0:r1], p.ignore_index,
                entropy=p.return_entropy, return_lse=p.return_lse,
            )  # fmt: skip
            parts.append((lse, mean_z, *outputs))
        lse, mean_z, *outputs = (
            None if part[0] is None else torch.cat(part) if len(part) > 1 else part[0]
            for part in zip(*parts, strict=True)
        )
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z, halo, b_halo)
        ctx.params = p
        return tuple(outputs)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, bias, targets, lse, mean_z, halo, b_halo = ctx.saved_tensors
        p: LogprobParams = ctx.params
        tile = p.deterministic_tile
        cfg, fixed = deterministic_config(hidden.device, hidden.dtype, tile, p.tile_config)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        own = p.tile_ownership()
        grads = upstream(g_lp, g_ent, g_lse)
        dev = hidden.device
        # the head fragment's span (several tiles per piece) serves grad_W and grad_bias
        spans, n_frag, width = backward_spans(own, p, cfg.vocab_chunk, need_w or need_b)
        chunk_k = tile_groups(n, tile, cfg.vocab_chunk, cfg)
        if chunk_k is not None:  # one span per tile (the pieces' sums kept: chunk_k)
            spans = [(own.skip + t0, min(tile, own.ext - t0)) for t0 in range(0, own.ext, tile)]
            width = pad128(tile)
        b_real = None if bias is None else bias[:v_real].float()
        span_bias = None  # (b_real, b_halo, grad_bias over the real rows, then the halo)
        if bias is not None:
            acc_b = None
            if need_b:
                acc_b = torch.zeros(v_real + own.halo, dtype=torch.float32, device=dev)
            span_bias = (b_real, b_halo, acc_b)
        # Pieces within one tile each (tiles wider than half a chunk) are cut alike on every
        # layout, and so are the d_logits buffer's shape and strides: then cuBLAS may
        # compute grad_W (the same call on every layout; a piece that runs into the halo
        # is computed whole, its halo rows sent back). Else a piece holds several
        # tiles, its width varies with the layout, and grad_W takes lp's fixed-tile GEMM,
        # whose rows never depend on the width.
        per_tile = 2 * tile > cfg.vocab_chunk
        rows = min(cfg.token_chunk, n)
        leaf32 = None  # fp32 products of wide tiles (per_tile), from their pieces
        slots = round_slots(
            own.tiles, n, h_dim, cfg.round_group
        )  # tiles rounded per pass (per_tile)
        pending = 0  # tiles whose products wait in leaf32 (per_tile)
        rows_s = head = None
        if need_h:
            # The row scales wait for max |W| until the first rounding: on one GPU it is
            # read on a side stream meanwhile (HeadAbsMax); under TP at once, where every
            # rank makes the MAX all-reduce in the same order.
            if p.tp_size > 1:
                rows_s = row_scales(hidden, w_real, b_real, lse, targets, grads, p)
            else:
                head = HeadAbsMax(w_real)
            # the first rounding overwrites it (ACC=False), unless no tile is here
            alloc = torch.empty if own.ext > 0 else torch.zeros
            acc_h = alloc((n, h_dim), dtype=torch.int64, device=dev)
            written = False  # whether acc_h holds sums (a tile or a group was rounded)
            if per_tile and own.ext > 0:
                leaf32 = scratch.empty((slots, n, h_dim), dtype=torch.float32, device=dev)
        grad_w = grad_weight_buffer(weight, v_real, n) if need_w else None
        whole = [b + c <= v_real for b, c in spans]
        acc_w = None  # fp32 accumulator of a grad_W piece
        fp32_w = weight.dtype == torch.float32 and all(whole)  # grad_W sums in place
        if need_w and n > 0 and (rows < n or not per_tile) and not fp32_w:
            acc_w = scratch.empty((width, h_dim), dtype=torch.float32, device=dev)
        sums = RowSums(acc_h if need_h else None, p.tp_group, p.tp_size, rows, p.reduce_grad_hidden)

        def scales() -> RowScales:
            nonlocal rows_s
            if rows_s is None:
                w_abs = head.get()
                rows_s = row_scales(hidden, w_real, b_real, lse, targets, grads, p, w_abs)
            return rows_s

        def grad_h_rows(r0, r1, dl, cols, w_chunk):
            """The current span's grad_h for token rows [r0, r1) (one block of ``dl``);
            reads the span loop's state (frag, first, flush, pending, written)."""
            if frag:
                return  # the head fragment feeds grad_W only
            if per_tile:  # the default path's fp32 GEMM, then one rounding
                f = leaf32[pending, r0:r1]
                matmul_acc(f, dl, w_chunk, cfg, k_a=cols, accumulate=not first, chunk_k=chunk_k)
                if flush:
                    f = leaf32[: pending + 1, r0:r1]
                    round_into(acc_h[r0:r1], f, scales().scale[r0:r1], accumulate=written)
            else:
                matmul_fixed(
                    acc_h[r0:r1], dl, w_chunk, scales().scale[r0:r1], cols, fixed, cfg, leaf=tile,
                    accumulate=written,
                )  # fmt: skip

        # per_tile: the grad_W rows of the halo (other shards' rows) go back to their
        # shards, which compute no head fragment
        back = need_w and per_tile and p.tp_size > 1
        grad_halo = None
        if back:  # every halo row lies in an owned span (zeros without tokens)
            halo_alloc = torch.empty if n > 0 else torch.zeros
            grad_halo = halo_alloc((own.halo, h_dim), dtype=weight.dtype, device=dev)
        for j, (v_begin, v_count, blocks, w_chunk) in enumerate(
            _span_blocks(
                hidden, w_real, halo, targets, lse, mean_z, grads, p, cfg, spans, width, span_bias
            )
        ):
            local = max(0, min(v_begin + v_count, v_real) - v_begin)  # its grad_W rows
            # and its rows of grad_halo (per_tile): the span's columns [local, v_count)
            h_rows = (max(0, v_begin + local - v_real), max(0, v_begin + v_count - v_real))
            frag = j < n_frag
            rel = v_begin - own.skip
            first = not frag and rel % tile == 0  # the piece starts a tile
            final = not frag and rel + v_count == own.ext  # the piece ends the owned tiles
            last = final or (not frag and (rel + v_count) % tile == 0)  # it ends a tile
            # per_tile: round the waiting products when the slots are full or none follow
            flush = last and (pending + 1 == slots or final)
            gw = need_w and (local > 0 or (back and h_rows[1] > h_rows[0]))
            if gw:
                gw_rows = grad_w[v_begin : v_begin + local]
                if per_tile:
                    acc = gw_rows if acc_w is None else acc_w[:v_count]
                else:
                    acc = gw_rows if acc_w is None else acc_w[:local]
            # under TP the last span's rows are final once grad_h has run: their int64
            # all-reduce starts then, beside the span's grad_W GEMM
            early = need_h and sums.active and final
            for r0, r1, dl, cols in blocks:
                if early:
                    grad_h_rows(r0, r1, dl, cols, w_chunk)
                    sums.ready(r1)
                if gw and per_tile and rows == n:  # one cuBLAS GEMM, as the default path
                    if whole[j]:
                        grad_weight_slice(dl, hidden, gw_rows)
                    else:  # the whole piece's call: this shard's rows, then the halo's
                        tmp = torch.empty((v_count, h_dim), dtype=weight.dtype, device=dev)
                        grad_weight_slice(dl, hidden, tmp)
                        gw_rows.copy_(tmp[:local])
                        if back:
                            grad_halo[slice(*h_rows)].copy_(tmp[local:])
                elif gw and per_tile:  # the first token chunk overwrites acc
                    addmm_f32_(acc, dl.T, hidden[r0:r1], accumulate=r0 > 0)
                elif gw:  # lp's fixed-tile GEMM (the first token chunk overwrites acc)
                    matmul_acc(
                        acc, dl[:, :local].T, hidden[r0:r1], cfg, m_a=cols, accumulate=r0 > 0
                    )
                if need_h and not early:
                    grad_h_rows(r0, r1, dl, cols, w_chunk)
            if need_h and (flush or (last and not per_tile)):
                written, pending = True, 0
            elif need_h and last:
                pending += 1
            if gw and acc_w is not None and per_tile:
                gw_rows.copy_(acc[:local])
                if back:
                    grad_halo[slice(*h_rows)].copy_(acc[local:])
            elif gw and acc_w is not None:
                gw_rows.copy_(acc)
        grad_h = None
        if need_h:
            sums.finish()
            rows_s = scales()
            grad_h = from_fixed_point(acc_h, rows_s.inv, rows_s.bad, hidden.dtype)
        if back:  # after every all-reduce: the same order of collectives on every rank
            return_halo_grad(
                grad_halo, grad_w, p.shard_starts, p.shard_sizes, p.vocab_size, tile,
                p.tp_rank, p.tp_group,
            )  # fmt: skip
        grad_b = None
        if need_b:
            acc_b = span_bias[2]
            if per_tile and p.tp_size > 1:  # the halo's entries to their shards, as grad_W's
                head = acc_b[:v_real].clone()
                return_halo_grad(
                    acc_b[v_real:, None], head[:, None], p.shard_starts, p.shard_sizes,
                    p.vocab_size, tile, p.tp_rank, p.tp_group,
                )  # fmt: skip
                acc_b = head
            grad_b = bias_grad(acc_b[:v_real], bias)
        return grad_h, grad_w, grad_b, None, None
