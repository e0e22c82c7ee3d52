"""``deterministic=True`` for the triton backend: bitwise tensor-parallel invariance.

Outputs and both gradients are bitwise identical for any TP degree and any shard layout
whose bounds are multiples of 128, for a given tile width ``w = deterministic_tile``
(default ``default_deterministic_tile(V)``, about V / 8; any multiple of 128), and stay
batch-invariant and reproducible run to run. A rank owns the global w-column tiles that
start in its shard; the rows of the next shards that its last tile needs (the halo) arrive
by point-to-point sends (``core.tiles.tile_ownership``, ``distributed.halo``). Data flow
for one rank::

    forward   halo rows; the owned tiles are the shard's real rows, then the halo (never
              joined whole: the tiles within the shard read it in place, the crossing tile
              a copy of its own rows joined to the halo, in a launch of its own)
              per token chunk (rows fixed by the global tile count, never by N):
                fwd_stats_kernel over the owned tiles, S = cdiv(w, v_split) splits per
                    tile, cut from the tile's first column (TILE_W = w): one partial
                    (m, s, a, t) per row, owned tile and split   [T_max * S, rows, 4]
                merge_runs_kernel: each tile's S partials in order -> one per tile
                all-gather -> [P, T_max, rows, 4]; merge_kernel visits the partials in
                    (rank, tile) order = the global order, with empty partials
                    (m = -inf, s = a = t = 0) after each rank's owned tiles; adding an
                    exact zero leaves an fp32 sum unchanged, so every layout merges alike
    backward  the default path's loop (backward.run_chunks) over vocabulary chunks of the
              owned tiles (backward_chunks; from the first chunk that runs into the halo
              on, over a copy of those rows joined to it: owned_chunks), with two sinks:
                grad_hidden (FixedRows): grad_h (int64) += round(2^e_n * leaf) per tile,
                    exact, so neither the tile order nor the TP all-reduce (int64) can
                    change the bits; grad_h = acc * 2^-e_n, one rounding at the end
                  w <= half a vocabulary chunk: a chunk holds several whole tiles and
                    fixed_point.matmul_fixed rounds each tile's fp32 dot in registers
                  wider tiles (the default tile): a chunk lies within one tile, cut from
                    the tile's start by the tile's width alone; the default path's fp32
                    GEMM sums the tile's product, and up to round_tiles tiles at a time are
                    rounded in one pass (fixed_point.round_into)
                grad_weight (TileWeights):
                  several tiles per chunk: the chunk's width follows the layout, so lp's
                    fixed-block GEMM (a row's result never depends on the width); the
                    head chunk (the shard's columns in an earlier rank's tile) feeds it
                  one tile per chunk: cuBLAS, as the default path (the same shapes,
                    strides and alignment on every layout); a chunk that runs into the
                    halo is computed whole and the halo's rows go back to their shards
                    (distributed.halo.return_halo_grad)

Cost: each tile's partial statistics and each tile's rounding of an [N, H] product are
the price of invariance, so wider tiles cost less: with the default tile the mode runs
within a few percent of the default path; halos and head chunks add work per shard bound
crossed (docs/design.md).

Every owned tile is computed whole, from its first column, in launches that start on the
global column grid, and every element of a tile is computed by the same instruction
sequence whatever its position, so each tile's numbers are the same on every layout.
That also needs every layout to run the same compiled variant of each kernel: see
"Determinism" in ``lp_kernels.backends.triton.linear`` on Triton's integer specialization.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from lp_kernels.backends.triton.backward import (
    Chunk,
    DlogitsChunks,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
    run_chunks,
    upstream,
)
from lp_kernels.backends.triton.config import KernelConfig, config_for, pad128
from lp_kernels.backends.triton.fixed_point import (
    HeadAbsMax,
    fixed_blocks_for,
    from_fixed_point,
    matmul_fixed,
    round_into,
    row_scales,
)
from lp_kernels.backends.triton.forward import (
    forward_stats,
    gather_partials,
    merge_outputs,
    merged_extras,
)
from lp_kernels.backends.triton.gemm import matmul_acc
from lp_kernels.backends.triton.plan import (
    backward_chunks,
    split_width,
    stats_rows,
    tile_launch_k,
    tile_splits,
    tiles_per_round,
)
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.extras import NO_EXTRAS, mark_extras
from lp_kernels.core.matmul import addmm_f32_, scratch
from lp_kernels.core.stats import bias_grad
from lp_kernels.core.tiles import DETERMINISTIC_TILE as TILE
from lp_kernels.core.tiles import TileOwnership
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums
from lp_kernels.distributed.halo import (
    bias_halo,
    owned_halo,
    return_halo_bias_grad,
    return_halo_grad,
    with_halo,
)

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def deterministic_config(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, tile: int = TILE
) -> tuple[KernelConfig, tuple[int, int, int]]:
    """The call's config (``config_for``) with forward splits of ``split_width(tile, cfg)``
    columns (at most the tile) cut from each ``tile``-column tile's first column
    (``forward.tile_splits`` per tile; 128-column logits blocks for 128, else the config's),
    and the fixed-point GEMM's blocks (``deterministic.fixed_blocks``, else the pinned
    ones)."""
    base = config_for(device, dtype)
    block_v = TILE if tile < base.logits.block_v else base.logits.block_v
    v_split = min(tile, split_width(tile, base))
    cfg = base.replace(logits={"block_v": block_v}, forward={"v_split": v_split})
    return cfg, base.deterministic.fixed_blocks or fixed_blocks_for(device, dtype)


def weight_parts(w_real, halo, start: int, cross: int):
    """``[(c0, w), (cross, w_x)]``: the shard's columns ``[start, cross)`` as a view of its
    real rows, then, with a halo, the columns from ``cross`` on as a copy of those real rows
    joined to the halo (:func:`with_halo`), so that only the columns that run into the halo
    are copied, never the whole shard. Either may be empty."""
    parts = [(start, w_real[start:cross])]
    if halo.shape[0]:
        parts.append((cross, with_halo(w_real, halo, cross)))
    return parts


def owned_chunks(
    hidden, w_real, halo, targets, stats, grads, p, cfg, chunks, heads, width, bias=None
):
    """The backward loop's :class:`~lp_kernels.backends.triton.backward.Chunk` s over
    ``chunks`` (columns of the shard's real rows, then the halo; the first ``heads`` are
    head chunks). Chunks within the real rows read them in place; those from the first one
    that runs past them (into the halo) read a copy of the rows from its start joined to the
    halo (:func:`weight_parts`): at most a tile or a vocabulary chunk. The d_logits buffer
    keeps its width, so every GEMM call is the one it would be on one joined operand.
    ``bias``: None, or ``(b_real, b_halo, grad_bias)``: the fp32 bias of the shard's real
    rows and of its halo, and the fp32 grad_bias over both (the column sums of d l are added
    to it)."""
    v_real = w_real.shape[0]
    own = p.tile_ownership()
    k = next((j for j, (b, c) in enumerate(chunks) if b + c > v_real), len(chunks))
    cross = chunks[k][0] if k < len(chunks) else v_real
    parts = weight_parts(w_real, halo, 0, cross)  # one part without a halo (k = all)
    b_parts = [(None, None)] * len(parts)
    if bias is not None:
        b_real, b_halo, grad_bias = bias
        b_parts = [
            (b, None if grad_bias is None else grad_bias[c0 : c0 + b.shape[0]])
            for c0, b in weight_parts(b_real, b_halo, 0, cross)
        ]
    j = 0
    for (c0, w), (b, g_b), sub in zip(parts, b_parts, (chunks[:k], chunks[k:]), strict=False):
        if not sub:
            continue
        local = [(b0 - c0, c) for b0, c in sub]
        dl = DlogitsChunks(
            hidden, w, targets, p.vocab_start + c0, stats, grads, p, cfg, local, width, b, g_b
        )
        for v_begin, v_count, blocks in dl:
            place = tile_place(c0 + v_begin, v_count, j < heads, own, p.deterministic_tile, v_real)
            w_chunk = w[v_begin : v_begin + v_count]
            yield Chunk(c0 + v_begin, v_count, w_chunk, blocks, place.final, j, place)
            j += 1


def forward(hidden, weight, bias, targets, p: LogprobParams, cfg: KernelConfig):
    """``((logprob, entropy, lse), saved)``: the outputs and what the backward reads,
    ``(hidden, weight, bias, targets, lse, E, halo, bias halo)``."""
    hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
    own, halo = owned_halo(w_real, p)
    b_real, b_halo = bias_halo(bias, w_real.shape[0], p)
    launches = _forward_launches(w_real, halo, b_real, b_halo, own, p)
    tile = p.deterministic_tile
    n = hidden.shape[0]
    parts = []
    step = stats_rows(p, cfg, own.max_tiles)
    for r0 in range(0, max(n, 1), step):
        r1 = min(n, r0 + step)
        stats = [
            forward_stats(
                hidden[r0:r1],
                w,
                targets[r0:r1],
                first,
                pf,
                cfg,
                b,
                tile=tile,
                extras=bool(p.extras),
            )
            for w, first, pf, b in launches
        ]
        if p.extras:  # (stats, x, i) per launch
            stats, x_parts, i_parts = ([s[k] for s in stats] for k in range(3))
        stats = stats[0] if len(stats) == 1 else torch.cat(stats)  # [T_max * S, rows, 4]
        # each tile's splits merged into one partial, then gathered: [P * T_max, rows, 4]
        gathered = gather_partials(stats, p, tile_splits(tile, cfg))
        lse, mean_z, outputs = merge_outputs(
            gathered,
            targets[r0:r1],
            p.ignore_index,
            entropy=p.return_entropy,
            return_lse=p.return_lse,
        )
        extra = NO_EXTRAS
        if p.extras:  # the same runs and order: empty partials add exact zeros
            x_i = (torch.cat(x_parts), torch.cat(i_parts))
            extra = merged_extras(x_i, lse, targets[r0:r1], p, tile_splits(tile, cfg))
        parts.append((lse, mean_z, *outputs, *extra))
    lse, mean_z, *outputs = (
        None if part[0] is None else torch.cat(part) if len(part) > 1 else part[0]
        for part in zip(*parts, strict=True)
    )
    return tuple(outputs), (hidden, weight, bias, targets, lse, mean_z, halo, b_halo)


def _forward_launches(w_real, halo, b_real, b_halo, own: TileOwnership, p: LogprobParams):
    """``[(w, first_id, params, bias)]``: the forward's launches over the owned tiles, one over
    the shard's rows or, with a halo, two: the tiles within the shard (a view), then the last
    one over its rows joined to the halo (a copy of one tile); each launch's splits are whole
    tiles. Every rank sends ``max_tiles`` partials: its owned tiles, then empty ones (the
    last launch's, through its ``max_v_local``)."""
    tile = p.deterministic_tile
    cross = own.skip + (own.tiles - 1) * tile if halo.shape[0] else own.skip + own.ext
    parts = weight_parts(w_real, halo, own.skip, cross)
    b_parts = [None] * len(parts)
    if b_real is not None:
        b_parts = [b for _, b in weight_parts(b_real, b_halo, own.skip, cross)]
    launches = [(c0, w, b) for (c0, w), b in zip(parts, b_parts, strict=True) if w.shape[0]]
    launches = launches or [(*parts[0], b_parts[0])]
    out = []
    for i, (c0, w, b) in enumerate(launches):
        tiles = triton.cdiv(w.shape[0], tile)
        if i == len(launches) - 1:
            tiles = own.max_tiles - (c0 - own.skip) // tile
        # the launch's first row is vocabulary id vocab_start + c0 (the halo follows the
        # shard's real rows)
        out.append((w, p.vocab_start + c0, _with_max_v_local(p, tiles * tile), b))
    return out


def _with_max_v_local(p: LogprobParams, cols: int) -> LogprobParams:
    return dataclasses.replace(p, max_v_local=cols)


class FixedRows:
    """grad_hidden as an exact int64 sum (``fixed_point``): the rows' scales ``2^e_n`` wait
    for ``max |W|`` until the first rounding (on one GPU it is read on a side stream
    meanwhile, :class:`~lp_kernels.backends.triton.fixed_point.HeadAbsMax`; under tensor
    parallel at once, where every rank makes the MAX all-reduce in the same order).

    Tiles up to half a vocabulary chunk: each chunk's tiles go through
    :func:`~lp_kernels.backends.triton.fixed_point.matmul_fixed`. Wider tiles
    (``per_tile``): each tile's fp32 product is summed by lp's GEMM into its own buffer,
    ``per_round`` tiles at a time, rounded into the sum when a round is full or the owned
    tiles end (:func:`~lp_kernels.backends.triton.fixed_point.round_into`)."""

    def __init__(
        self, hidden, w_real, b_real, lse, targets, grads, p, cfg, fixed, per_tile, chunk_k
    ):
        n, h_dim = hidden.shape
        own = p.tile_ownership()
        self.p, self.cfg, self.fixed, self.per_tile, self.chunk_k = p, cfg, fixed, per_tile, chunk_k
        self.args = (hidden, w_real, b_real, lse, targets, grads, p)
        self.rows = self.head = None
        if p.tp_size > 1:
            self.rows = row_scales(*self.args)
        else:
            self.head = HeadAbsMax(w_real)
        # the first rounding overwrites it (ACC=False), unless no tile is here
        alloc = torch.empty if own.ext > 0 else torch.zeros
        self.acc = alloc((n, h_dim), dtype=torch.int64, device=hidden.device)
        self.per_round = tiles_per_round(own.tiles, n, h_dim, cfg.deterministic.round_tiles)
        self.leaf32 = None
        if per_tile and own.ext > 0:
            shape = (self.per_round, n, h_dim)
            self.leaf32 = scratch.empty(shape, dtype=torch.float32, device=hidden.device)
        self.written = False  # whether acc holds sums (a round of tiles was rounded)
        self.pending = 0  # tiles whose products wait in leaf32 (per_tile)
        self.place = None

    def scales(self):
        if self.rows is None:
            self.rows = row_scales(*self.args, self.head.get())
        return self.rows

    def begin(self, chunk: Chunk) -> None:
        self.place = chunk.place
        # per_tile: round the waiting products when the round is full or none follow
        last, final = self.place.last, self.place.final
        self.flush = last and (self.pending + 1 == self.per_round or final)

    def add(self, chunk: Chunk, r0: int, r1: int, dl, cols: int) -> None:
        if self.place.head:
            return  # a head chunk feeds grad_W only
        if self.per_tile:  # the default path's fp32 GEMM, then one rounding
            f = self.leaf32[self.pending, r0:r1]
            matmul_acc(
                f,
                dl,
                chunk.weight,
                self.cfg,
                k_a=cols,
                accumulate=not self.place.first,
                chunk_k=self.chunk_k,
            )
            if self.flush:
                f = self.leaf32[: self.pending + 1, r0:r1]
                scale = self.scales().scale[r0:r1]
                round_into(self.acc[r0:r1], f, scale, accumulate=self.written)
        else:
            matmul_fixed(
                self.acc[r0:r1],
                dl,
                chunk.weight,
                self.scales().scale[r0:r1],
                cols,
                self.fixed,
                self.cfg,
                leaf=self.p.deterministic_tile,
                accumulate=self.written,
            )

    def end(self, chunk: Chunk) -> None:
        if self.flush or (self.place.last and not self.per_tile):
            self.written, self.pending = True, 0
        elif self.place.last:
            self.pending += 1

    def finish(self, dtype: torch.dtype) -> torch.Tensor:
        rows = self.scales()
        return from_fixed_point(self.acc, rows.inv, rows.bad, dtype)


@dataclass(frozen=True)
class TilePlace:
    """Where a backward chunk lies among this rank's owned tiles."""

    head: bool
    """A head chunk (the shard's columns in an earlier rank's tile): grad_W only."""
    first: bool
    """It starts a tile."""
    last: bool
    """It ends a tile."""
    final: bool
    """It ends the owned tiles."""
    local: int
    """Its columns among this shard's real rows (its rows of grad_W here)."""
    halo_rows: tuple[int, int]
    """Its rows of the halo's grad_W (the columns past the real rows)."""


def tile_place(v_begin: int, v_count: int, head: bool, own, tile: int, v_real: int) -> TilePlace:
    """:class:`TilePlace` of the chunk of columns ``[v_begin, +v_count)`` (a head chunk, or
    one of ``own``'s owned tiles) of a shard with ``v_real`` real columns."""
    rel = v_begin - own.skip
    final = not head and rel + v_count == own.ext
    local = max(0, min(v_begin + v_count, v_real) - v_begin)
    return TilePlace(
        head=head,
        first=not head and rel % tile == 0,
        last=final or (not head and (rel + v_count) % tile == 0),
        final=final,
        local=local,
        halo_rows=(max(0, v_begin + local - v_real), max(0, v_begin + v_count - v_real)),
    )


class TileWeights:
    """grad_weight's rows of each chunk (see the module docstring). ``per_tile`` (one tile
    per chunk): cuBLAS as the default path, the chunk's halo rows into ``grad_halo`` (sent to
    their shards at the end); else lp's fixed-block GEMM, whose rows never depend on the
    chunk's width. Several token chunks accumulate in fp32, the first overwriting."""

    def __init__(self, weight, hidden, v_real: int, p, cfg, per_tile: bool, width: int, whole):
        n, h_dim = hidden.shape
        own = p.tile_ownership()
        self.hidden, self.cfg, self.per_tile = hidden, cfg, per_tile
        self.grad = grad_weight_buffer(weight, v_real, n)
        self.one_chunk = min(cfg.backward.token_chunk, n) == n
        self.acc_w = None  # the fp32 accumulator of a chunk
        fp32_w = weight.dtype == torch.float32 and whole  # grad_W sums in place
        if n > 0 and (not self.one_chunk or not per_tile) and not fp32_w:
            self.acc_w = scratch.empty((width, h_dim), dtype=torch.float32, device=hidden.device)
        # per_tile: the grad_W rows of the halo (other shards' rows) go back to their
        # shards, which compute no head chunk
        self.back = per_tile and p.tp_size > 1
        self.grad_halo = None
        if self.back:  # every halo row lies in an owned chunk (zeros without rows)
            alloc = torch.empty if n > 0 else torch.zeros
            self.grad_halo = alloc((own.halo, h_dim), dtype=weight.dtype, device=hidden.device)
        self.p = p

    def begin(self, chunk: Chunk) -> None:
        place = chunk.place
        halo = place.halo_rows
        self.live = place.local > 0 or (self.back and halo[1] > halo[0])
        if not self.live:
            return
        self.rows = self.grad[chunk.v_begin : chunk.v_begin + place.local]
        count = chunk.v_count if self.per_tile else place.local
        self.acc = self.rows if self.acc_w is None else self.acc_w[:count]

    def add(self, chunk: Chunk, r0: int, r1: int, dl, cols: int) -> None:
        if not self.live:
            return
        local = chunk.place.local
        if self.per_tile and self.one_chunk:  # one cuBLAS GEMM, as the default path
            if local == chunk.v_count:
                grad_weight_slice(dl, self.hidden, self.rows)
            else:  # the whole chunk's call: this shard's rows, then the halo's
                h_dim = self.hidden.shape[1]
                tmp = torch.empty((chunk.v_count, h_dim), dtype=self.grad.dtype, device=dl.device)
                grad_weight_slice(dl, self.hidden, tmp)
                self._store(chunk, tmp)
        elif self.per_tile:  # the first token chunk overwrites acc
            addmm_f32_(self.acc, dl.T, self.hidden[r0:r1], accumulate=r0 > 0)
        else:  # lp's fixed-block GEMM (the first token chunk overwrites acc)
            matmul_acc(
                self.acc,
                dl[:, :local].T,
                self.hidden[r0:r1],
                self.cfg,
                m_a=cols,
                accumulate=r0 > 0,
            )

    def end(self, chunk: Chunk) -> None:
        if not self.live or self.acc_w is None:
            return
        if self.per_tile:
            self._store(chunk, self.acc)
        else:
            self.rows.copy_(self.acc)

    def _store(self, chunk: Chunk, full: torch.Tensor) -> None:
        """A chunk's grad_W rows computed whole: this shard's, then the halo's."""
        local = chunk.place.local
        self.rows.copy_(full[:local])
        if self.back:
            self.grad_halo[slice(*chunk.place.halo_rows)].copy_(full[local:])

    def finish(self) -> torch.Tensor:
        """grad_weight, after the halo's rows went back to their shards (call after every
        all-reduce: the same order of collectives on every rank)."""
        if self.back:
            p = self.p
            return_halo_grad(self.grad_halo, self.grad, p)
        return self.grad


def backward(saved, grads: Grads, needs, p: LogprobParams, cfg, fixed) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no) from the
    forward's ``saved`` tensors and the upstream gradients ``(g_lp, g_ent, g_lse)``."""
    hidden, weight, bias, targets, lse, mean_z, halo, b_halo = saved
    need_h, need_w, need_b = needs
    n = hidden.shape[0]
    tile = p.deterministic_tile
    v_real = p.local_real_columns(weight.shape[0])
    w_real = weight[:v_real]
    own = p.tile_ownership()
    grads = upstream(*grads)
    # the head chunk (several tiles per chunk) serves grad_W and grad_bias
    chunks, heads, width = backward_chunks(own, p, cfg.backward.vocab_chunk, need_w or need_b)
    chunk_k = tile_launch_k(n, tile, cfg)
    if chunk_k is not None:  # one chunk per tile (the chunks' sums kept: chunk_k)
        chunks = [(own.skip + t0, min(tile, own.ext - t0)) for t0 in range(0, own.ext, tile)]
        width = pad128(tile)
    b_real = None if bias is None else bias[:v_real].float()
    acc_b = None  # grad_bias over the real rows, then the halo
    if need_b:
        acc_b = torch.zeros(v_real + own.halo, dtype=torch.float32, device=hidden.device)
    # Chunks within one tile each (tiles wider than half a vocabulary chunk) are cut alike
    # on every layout, and so are the d_logits buffer's shape and strides: then cuBLAS may
    # compute grad_W (the same call on every layout). Else a chunk holds several tiles, its
    # width varies with the layout, and grad_W takes lp's fixed-block GEMM.
    per_tile = 2 * tile > cfg.backward.vocab_chunk
    rows_sink = None
    if need_h:
        args = (hidden, w_real, b_real, lse, targets, grads, p, cfg, fixed, per_tile, chunk_k)
        rows_sink = FixedRows(*args)
    weight_sink = None
    if need_w:
        whole = all(b + c <= v_real for b, c in chunks)
        weight_sink = TileWeights(weight, hidden, v_real, p, cfg, per_tile, width, whole)
    rows = min(cfg.backward.token_chunk, n)
    acc = rows_sink and rows_sink.acc
    sums = RowSums(acc, p.tp_group, p.tp_size, rows, p.reduce_grad_hidden)
    own_bias = None if bias is None else (b_real, b_halo, acc_b)
    loop = owned_chunks(
        hidden,
        w_real,
        halo,
        targets,
        (lse, mean_z),
        grads,
        p,
        cfg,
        chunks,
        heads,
        width,
        own_bias,
    )
    run_chunks(loop, rows_sink, weight_sink, sums)
    grad_h = None
    if need_h:
        sums.finish()
        grad_h = rows_sink.finish(hidden.dtype)
    grad_w = None if weight_sink is None else weight_sink.finish()
    return grad_h, grad_w, _bias_grad(acc_b, bias, v_real, per_tile, p)


def _bias_grad(acc_b, bias, v_real: int, per_tile: bool, p: LogprobParams):
    """grad_bias from its fp32 sums over the real rows and the halo (per_tile: the halo's
    entries go to their shards, as grad_W's rows do)."""
    if acc_b is None:
        return None
    if per_tile and p.tp_size > 1:
        acc_b = return_halo_bias_grad(acc_b, v_real, p)
    return bias_grad(acc_b[:v_real], bias)


class LinearLogprobTritonDeterministic(torch.autograd.Function):
    """TP-invariant fused implementation: takes the launch config current at its forward
    (:func:`deterministic_config`), calls :func:`forward` and :func:`backward`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        ctx.cfg = deterministic_config(hidden.device, hidden.dtype, p.deterministic_tile)
        outputs, saved = forward(hidden, weight, bias, targets, p, ctx.cfg[0])
        ctx.save_for_backward(*saved)
        ctx.params = p
        mark_extras(ctx, outputs)
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse, *_):
        needs = tuple(ctx.needs_input_grad[:3])
        upstream_grads = (g_lp, g_ent, g_lse)
        grads = backward(ctx.saved_tensors, upstream_grads, needs, ctx.params, *ctx.cfg)
        return (*grads, None, None)
