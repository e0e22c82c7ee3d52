"""The backward of the triton backend: d_logits, one bounded chunk at a time, and the
helpers of the two gradient GEMMs.

``dlogits_kernel`` recomputes the logits block by block and stores ``d l`` in the input
dtype into a scratch ``[token_chunk, vocab_chunk]`` buffer (bounded, any N), with exact
zeros in its padded columns (``v_store``) so the GEMMs that read it vectorize alike on
every shard; its arithmetic is ``softmax.dlogits_block``. :func:`dlogits_chunks` drives it
for both triton modes; ``plan.chunks_per_launch`` picks how many vocabulary chunks one
launch covers at small N.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    even_h,
    launch_opts,
    pad128,
    swizzle_rows,
)
from lp_kernels.backends.triton.forward import logits_sources
from lp_kernels.backends.triton.softmax import (
    dlogits_block,
    dlogits_rows,
    store_column_sums,
    transform_args,
)
from lp_kernels.backends.triton.tl_utils import IGNORED, logits_block, swizzle, target_codes
from lp_kernels.core.matmul import mm_f32, scratch
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums

# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["N", "v_begin", "v_count", "ignore_index", "first_id", "rows"])
def dlogits_kernel(
    h_src,
    w_src,
    t_ptr,
    lse_ptr,
    mean_ptr,
    glp_ptr,
    gent_ptr,
    glse_ptr,
    dl_ptr,
    b_ptr,
    db_ptr,
    N,
    H,
    v_begin,
    v_count,
    v_store,
    ignore_index,
    first_id,
    inv_t,
    cap,
    inv_cap,
    rows,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_dn,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    EVEN_H: tl.constexpr,
    IGNORED: tl.constexpr,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """``d l`` (``softmax.dlogits_block``) of columns ``[v_begin, +v_count)``; ``t_ptr``: the
    raw target ids, ``first_id`` the id of the weight's first row
    (:func:`~lp_kernels.backends.triton.tl_utils.target_codes`).

    Columns ``[v_count, v_store)`` of the output get exact zeros (``v_store``: ``v_count``
    padded to 128). ``HAS_BIAS``: the logits are ``h W^T + b``; ``BIAS_GRAD``: each program
    also writes the fp32 column sums of its stored block (``softmax.store_column_sums``) to
    row ``i_n`` of ``db_ptr`` (``[row blocks, v_store]``).
    """
    i_n, i_v = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_store, BLOCK_V), rows)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column within the chunk
    m_n = o_n < N
    m_v = o_c < v_count
    # the rows' inputs first: their loads overlap the block's MMAs; with the entropy's two
    # more, after them (held across the K loop, ptxas spilled)
    b_t = target_codes(t_ptr, o_n, m_n, ignore_index, first_id, v_begin + v_count, IGNORED)
    if not ENTROPY:
        b_lse, b_glp, b_glse, b_mean, b_gent = dlogits_rows(
            lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
        )
    # [BLOCK_N, BLOCK_V]
    b_l = logits_block(
        h_src,
        w_src,
        b_ptr,
        i_n * BLOCK_N,
        v_begin + i_v * BLOCK_V,
        m_n,
        m_v,
        H,
        stride_hn,
        stride_hh,
        stride_wv,
        stride_wh,
        BLOCK_N,
        BLOCK_V,
        BLOCK_H,
        EVEN_H,
        TMA,
        HAS_BIAS,
    )
    if ENTROPY:
        b_lse, b_glp, b_glse, b_mean, b_gent = dlogits_rows(
            lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
        )
    b_dz = dlogits_block(
        b_l,
        b_t,
        b_lse,
        b_glp,
        b_glse,
        b_mean,
        b_gent,
        v_begin + i_v * BLOCK_V,
        scale,
        cap,
        inv_cap,
        inv_t,
        BLOCK_V,
        ENTROPY,
        HAS_LP,
        CAP,
        SCALE,
    )
    # ignored rows (code IGNORED) and rows past N get exact zeros, even where their hidden
    # is not finite, as do columns past v_count: a select only in blocks that have them
    m_live = m_n & (b_t != IGNORED)
    if (tl.min(m_live.to(tl.int32), axis=0) == 0) | ((i_v + 1) * BLOCK_V > v_count):
        b_dz = tl.where(m_live[:, None] & m_v[None, :], b_dz, 0.0)
    p_d = dl_ptr + o_n[:, None].to(tl.int64) * stride_dn + o_c[None, :]
    b_dl = b_dz.to(dl_ptr.dtype.element_ty)
    tl.store(p_d, b_dl, mask=m_n[:, None] & (o_c < v_store)[None, :])
    if BIAS_GRAD:  # the stored block's column sums (dead rows and columns hold exact zeros)
        p_db = db_ptr + i_n.to(tl.int64) * v_store + o_c
        store_column_sums(p_db, o_c < v_store, b_dl)


@triton.jit(do_not_specialize=["B", "V"])
def colsum_kernel(part_ptr, out_ptr, B, V, stride_pb, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """out[v] += sum_i part[i, v], the rows i summed from +0.0 in order, then added once;
    ``ROWS`` rows' loads at a time, in flight together, then the rest one by one."""
    o_v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    p_i = part_ptr + o_v  # row i (pointer steps: no int32 product of rows and stride)
    full = B - B % ROWS
    for _ in range(0, full, ROWS):
        for r in tl.static_range(ROWS):
            b_acc += tl.load(p_i + r * stride_pb, mask=m_v, other=0.0)
        p_i += ROWS * stride_pb
    for _ in range(full, B):
        b_acc += tl.load(p_i, mask=m_v, other=0.0)
        p_i += stride_pb
    tl.store(out_ptr + o_v, tl.load(out_ptr + o_v, mask=m_v, other=0.0) + b_acc, mask=m_v)


# ----------------------------------------------------------------------------- launchers


def dlogits(
    hidden,
    w_real,
    targets,
    first_id,
    lse,
    mean,
    grads,
    out,
    v_begin,
    v_count,
    p,
    cfg,
    b_real=None,
    db=None,
):
    """d_logits of columns ``[v_begin, +v_count)`` into ``out``; its columns past ``v_count``
    get exact zeros (callers pass ``pad_cols(v_count, buffer)`` columns). ``targets``: the raw
    ids of the rows, ``first_id`` the vocabulary id of ``w_real``'s first row; ``grads``:
    the upstream ``(g_lp, g_ent, g_lse)`` (:func:`upstream`). ``b_real``: the fp32 bias of
    ``w_real``'s rows, or None; ``db``: None, or a contiguous fp32 ``[cdiv(rows,
    block_n), out.shape[1]]`` buffer for the row blocks' column sums."""
    n, h_dim = hidden.shape
    v_store = out.shape[1]
    lc = cfg.logits
    blocks_n = triton.cdiv(n, lc.block_n)
    h_src, w_src, tma = logits_sources(hidden, w_real, cfg)
    g_lp, g_ent, g_lse = grads
    dlogits_kernel[(blocks_n * triton.cdiv(v_store, lc.block_v),)](
        h_src=h_src,
        w_src=w_src,
        t_ptr=targets,
        lse_ptr=lse,
        mean_ptr=mean,
        glp_ptr=g_lp,
        gent_ptr=g_ent,
        glse_ptr=g_lse,
        dl_ptr=out,
        b_ptr=b_real,
        db_ptr=db,
        N=n,
        H=h_dim,
        v_begin=v_begin,
        v_count=v_count,
        v_store=v_store,
        ignore_index=p.ignore_index,
        first_id=first_id,
        rows=swizzle_rows(cfg, blocks_n),
        stride_hn=hidden.stride(0),
        stride_hh=hidden.stride(1),
        stride_wv=w_real.stride(0),
        stride_wh=w_real.stride(1),
        stride_dn=out.stride(0),
        BLOCK_N=lc.block_n,
        BLOCK_V=lc.block_v,
        BLOCK_H=lc.block_h,
        ENTROPY=g_ent is not None,
        HAS_LP=g_lp is not None,
        HAS_LSE=g_lse is not None,
        EVEN_H=even_h(hidden, cfg),
        IGNORED=IGNORED,
        TMA=tma,
        HAS_BIAS=b_real is not None,
        BIAS_GRAD=db is not None,
        **transform_args(p.transform),
        **launch_opts(lc, hidden.device),
    )


def add_column_sums(
    out: torch.Tensor, part: torch.Tensor, block: int = 32, rows: int = 16, warps: int = 1
) -> None:
    """``out [V] += part [B, >= V].sum(0)`` in fp32, the B rows summed in order: the same
    arithmetic for a column whatever its position or the width (no atomics). The launch is
    latency-bound (a few MB, rows in order): ``block`` columns per program, ``rows`` rows'
    loads in flight, ``warps`` warps; none of them changes a bit."""
    v = out.shape[0]
    if v == 0 or part.shape[0] == 0:
        return
    opts = {} if out.device.type == "cpu" else {"num_warps": warps}
    colsum_kernel[(triton.cdiv(v, block),)](
        part_ptr=part,
        out_ptr=out,
        B=part.shape[0],
        V=v,
        stride_pb=part.stride(0),
        BLOCK=block,
        ROWS=rows,
        **opts,
        **compile_opts(out.device),
    )


def kernel_inputs(hidden, weight, targets, p: LogprobParams):
    """``(hidden, w_real, targets)`` as the kernels take them: ``hidden`` with a unit last
    stride, this shard's real weight rows, and the raw ``[N]`` target ids, contiguous (the
    kernels make each row's target code from them:
    :func:`~lp_kernels.backends.triton.tl_utils.target_codes`)."""
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    targets = targets if targets.is_contiguous() else targets.contiguous()
    return hidden, weight[: p.local_real_columns(weight.shape[0])], targets


def upstream(*grads):
    """The upstream gradients ``(g_lp, g_ent, g_lse)`` as the d_logits kernels read them:
    fp32 ``[N]`` with a unit stride (an expanded gradient, as ``out.sum().backward()``
    makes, is copied), None for an absent one. Ignored rows keep what they hold: the
    kernels give those rows exact zeros whatever it is."""
    return tuple(
        (
            None
            if g is None
            else g if g.dtype == torch.float32 and g.is_contiguous() else g.float().contiguous()
        )
        for g in grads
    )


def pad_cols(v_count: int, dl_buf: torch.Tensor) -> int:
    """The padded column bound of a d_logits chunk (what :func:`dlogits` zero-fills)."""
    return min(pad128(v_count), dl_buf.shape[1])


class DlogitsChunks:
    """The backward's d_logits, one bounded chunk at a time (both triton modes): iterating
    gives ``(v_begin, v_count, blocks)`` per vocabulary chunk of ``chunks`` (``(v_begin,
    v_count)`` in order, each at most ``width`` columns, a multiple of 128 that is the
    buffer's width). ``blocks`` yields ``(r0, r1, dl, cols)`` per token chunk of
    ``backward.token_chunk`` rows: ``dl [r1 - r0, v_count]`` (input dtype) is ``d loss /
    d l`` of those rows and columns, in one reused buffer that holds exact zeros in columns
    ``[v_count, cols)``.

    ``targets``: the raw ids, ``first_id``: the vocabulary id of ``w_real``'s first row;
    ``grads``: the upstream ``(g_lp, g_ent, g_lse)`` (:func:`upstream`). ``b_real``: the fp32
    bias of ``w_real``'s rows, or None; ``grad_bias``: None, or fp32 ``[v_real]`` to which
    each block's fp32 column sums of ``d l`` are added before it is yielded (row blocks in
    order, then token chunks)."""

    def __init__(
        self,
        hidden,
        w_real,
        targets,
        first_id: int,
        stats,
        grads,
        p,
        cfg: KernelConfig,
        chunks: list[tuple[int, int]],
        width: int,
        b_real=None,
        grad_bias=None,
    ):
        self.hidden, self.w_real, self.targets, self.first_id = hidden, w_real, targets, first_id
        self.lse, self.mean_z = stats
        self.grads, self.p, self.cfg, self.chunks = grads, p, cfg, chunks
        self.b_real, self.grad_bias = b_real, grad_bias
        n = hidden.shape[0]
        self.rows = min(cfg.backward.token_chunk, n)
        dev = hidden.device
        self.dl_buf = scratch.empty((self.rows, width), dtype=hidden.dtype, device=dev)
        self.db_buf = None
        if grad_bias is not None:  # the row blocks' column sums of one token chunk
            shape = (triton.cdiv(self.rows, cfg.logits.block_n), width)
            self.db_buf = scratch.empty(shape, dtype=torch.float32, device=dev)

    def __iter__(self):
        if self.hidden.shape[0] == 0 or self.w_real.shape[0] == 0:
            return
        for v_begin, v_count in self.chunks:
            yield v_begin, v_count, self.blocks(v_begin, v_count)

    def blocks(self, v_begin: int, v_count: int) -> Iterator:
        """``(r0, r1, dl, cols)`` per token chunk of the vocabulary chunk."""
        n = self.hidden.shape[0]
        cols = pad_cols(v_count, self.dl_buf)
        for r0 in range(0, n, self.rows):
            r1 = min(n, r0 + self.rows)
            db = None
            if self.db_buf is not None:  # contiguous [row blocks, cols]
                blocks_n = triton.cdiv(r1 - r0, self.cfg.logits.block_n)
                db = self.db_buf.view(-1)[: blocks_n * cols].view(-1, cols)
            dlogits(
                self.hidden[r0:r1],
                self.w_real,
                self.targets[r0:r1],
                self.first_id,
                self.lse[r0:r1],
                _rows(self.mean_z, r0, r1),
                tuple(_rows(g, r0, r1) for g in self.grads),
                self.dl_buf[: r1 - r0, :cols],
                v_begin,
                v_count,
                self.p,
                self.cfg,
                self.b_real,
                db,
            )
            if db is not None:
                add_column_sums(self.grad_bias[v_begin : v_begin + v_count], db)
            yield r0, r1, self.dl_buf[: r1 - r0, :v_count], cols


def _rows(x: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    return None if x is None else x[r0:r1]


def grad_weight_slice(dl: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dl^T @ hidden`` in the input dtype with fp32 accumulation (one GEMM over
    all rows), written in place on CUDA."""
    if hidden.device.type == "cuda":
        torch.mm(dl.T, hidden, out=out)  # cuBLAS accumulates half GEMMs in fp32
    else:
        out.copy_(mm_f32(dl.T, hidden))


def grad_weight_buffer(weight: torch.Tensor, v_real: int, n: int) -> torch.Tensor:
    """grad_weight, uninitialised where the backward writes every element (the real rows,
    when there are rows), zero elsewhere (padding rows): no memset of the whole [V, H]."""
    if n == 0 or v_real == 0:
        return torch.zeros_like(weight)
    out = scratch.empty(tuple(weight.shape), dtype=weight.dtype, device=weight.device)
    out[v_real:].zero_()
    return out


# ----------------------------------------------------------------------------- the loop


@dataclass
class Chunk:
    """One vocabulary chunk of the backward loop (:func:`run_chunks`)."""

    v_begin: int
    """Its first column (the shard's numbering; ``deterministic=True``: then the halo's)."""
    v_count: int
    """Its columns."""
    weight: torch.Tensor
    """Its weight rows ``[v_count, H]``."""
    blocks: Iterator
    """``(r0, r1, dl, cols)`` per token chunk (:class:`DlogitsChunks`)."""
    final: bool
    """grad_hidden's last chunk: its rows are final as it passes them."""
    index: int = 0
    """Its position in the loop."""
    place: Any = None
    """``deterministic=True``: where it lies among the owned tiles
    (``deterministic.TilePlace``)."""


def run_chunks(chunks, rows_sink, weight_sink, sums: RowSums) -> None:
    """The backward's loop, shared by both triton modes: per vocabulary chunk, per token
    chunk of its d_logits, grad_hidden's rows (``rows_sink.add``) and grad_weight's
    (``weight_sink.add``); either sink may be None. In the final chunk grad_hidden's rows
    come first, and each block of rows starts its tensor-parallel sum as soon as it is final
    (``sums.ready``), which then runs beside the block's grad_weight GEMM. The modes differ
    only in their sinks (``begin(chunk)``, ``add(chunk, r0, r1, dl, cols)``, ``end(chunk)``)."""
    for chunk in chunks:
        early = rows_sink is not None and sums.active and chunk.final
        for sink in (rows_sink, weight_sink):
            if sink is not None:
                sink.begin(chunk)
        for r0, r1, dl, cols in chunk.blocks:
            if early:
                rows_sink.add(chunk, r0, r1, dl, cols)
                sums.ready(r1)
            if weight_sink is not None:
                weight_sink.add(chunk, r0, r1, dl, cols)
            if rows_sink is not None and not early:
                rows_sink.add(chunk, r0, r1, dl, cols)
        for sink in (rows_sink, weight_sink):
            if sink is not None:
                sink.end(chunk)
