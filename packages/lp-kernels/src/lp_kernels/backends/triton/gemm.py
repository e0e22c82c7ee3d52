"""lp's fp32-accumulating GEMM ``C (+)= A @ B`` (grad_hidden, and grad_weight where cuBLAS'
shape-picked kernels would break an invariance).

One program per C tile, no atomics: A @ B is summed over K in a fixed order from +0.0,
then C added once. Its output tile width is the one launch choice that follows the sizes
(``plan.mm_block_n``): each element of C gets the same MMAs in the same K order in a 128- or
a 256-wide tile, so the bits do not change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    descriptor,
    launch_opts,
    swizzle_rows,
    tma_ok,
)
from lp_kernels.backends.triton.plan import mm_block_n, narrow_block_n
from lp_kernels.backends.triton.tl_utils import gemm_step, operand_ptrs, swizzle
from lp_kernels.core.matmul import scratch

# ----------------------------------------------------------------------------- kernels


def matmul_acc_body(
    a_src,
    b_src,
    c_ptr,
    M,
    M_A,
    N,
    K,
    K_A,
    K_B,
    rows,
    chunk_k,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    A_T: tl.constexpr,
    ACC: tl.constexpr,
    C_TMA: tl.constexpr,
    MULTI: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """C[:M] (fp32) = C + A @ B (``ACC``; else C = A @ B, without reading C). One program
    per C tile: A @ B summed over K in a fixed order from +0.0, then C added once. No
    atomics.

    ``MULTI``: K is several chunks of ``chunk_k`` columns, each summed from +0.0 and added
    to C in order: exactly the arithmetic of one call per chunk, in one launch (the
    backward's vocabulary chunks at small N; see ``plan.chunks_per_launch``). The running C
    tile then sits in registers beside the chunk's sum, which the narrow tile affords.

    ``SPLIT`` (without ACC): program axis 1 is a chunk of ``chunk_k`` columns of K, summed
    from +0.0 into that chunk's ``[M, N]`` slab of a contiguous ``[chunks, M, N]`` C; the
    slabs are then added in order by :func:`ordered_sum_kernel`: the same arithmetic as
    ``MULTI`` on any output tile, with the chunks' programs side by side.

    A's rows are bounded by M_A and its columns by K_A, B's rows by K_B; the loop runs to
    K, which may pass K_B over columns where A holds exact zeros. The bound of A's
    contiguous dimension comes padded to a multiple of 128 so that every call vectorizes
    alike; see the module docstring. With TMA, ``a_src`` / ``b_src`` are tensor
    descriptors with those bounds (``A_T``: ``a_src`` describes A^T, contiguous along M);
    with C_TMA (only with ACC), ``c_ptr`` is one over C's ``M x N`` elements.
    """
    i_m, i_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), rows)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_am = o_m < M_A
    m_n = o_n < N
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    p_a, p_b = operand_ptrs(
        a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA
    )
    k_lo = 0
    k_end = K
    if SPLIT:  # this program's chunk, into its slab of C
        k_lo = tl.program_id(1) * chunk_k
        k_end = tl.minimum(k_lo + chunk_k, K)
        c_ptr += tl.program_id(1).to(tl.int64) * M * stride_cm
    elif MULTI:
        k_end = tl.minimum(chunk_k, K)  # the first chunk
    for k0 in range(k_lo, k_end, BLOCK_K):
        b_acc = gemm_step(
            b_acc,
            a_src,
            b_src,
            p_a,
            p_b,
            k0,
            i_m,
            i_n,
            m_am,
            m_n,
            o_k,
            K_A,
            K_B,
            stride_ak,
            stride_bk,
            BLOCK_M,
            BLOCK_N,
            TMA,
            A_T,
        )
    # With ACC, C is read and written after the K loop through a tensor descriptor where
    # allowed (C_TMA): no [BLOCK_M, BLOCK_N] pointer block is then held in registers next
    # to the accumulator and the loaded tile (with one, the kernel spilled about 1 KB per
    # thread on sm_90). Without ACC a pointer store spills nothing, and a descriptor store
    # would need its own shared memory under Triton 3.6 (over Hopper's 227 KiB).
    if C_TMA:
        b_acc += c_ptr.load([i_m * BLOCK_M, i_n * BLOCK_N])
    elif ACC:
        p_c = c_ptr + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :] * stride_cn
        b_acc += tl.load(p_c, mask=m_m[:, None] & m_n[None, :], other=0.0)
    if MULTI:  # the further chunks, each summed from +0.0, then added: C + P0 + P1 + ..
        for k_lo in range(chunk_k, K, chunk_k):
            b_part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + chunk_k, K), BLOCK_K):
                b_part = gemm_step(
                    b_part,
                    a_src,
                    b_src,
                    p_a,
                    p_b,
                    k0,
                    i_m,
                    i_n,
                    m_am,
                    m_n,
                    o_k,
                    K_A,
                    K_B,
                    stride_ak,
                    stride_bk,
                    BLOCK_M,
                    BLOCK_N,
                    TMA,
                    A_T,
                )
            b_acc += b_part
    if C_TMA:
        c_ptr.store([i_m * BLOCK_M, i_n * BLOCK_N], b_acc)
    else:
        p_c = c_ptr + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :] * stride_cn
        tl.store(p_c, b_acc, mask=m_m[:, None] & m_n[None, :])


@triton.jit
def ordered_sum_kernel(c_ptr, p_ptr, numel, parts, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """``C = ((P_0 [+ C]) + P_1) + ..`` over the ``parts`` slabs of ``P [parts, numel]``
    (fp32, contiguous, as ``C``): ``MULTI``'s additions in ``MULTI``'s order (``ACC``: C
    is added to the first chunk's sum, as there)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    p_p = p_ptr + o
    b_c = tl.load(p_p, mask=m, other=0.0)
    if ACC:
        b_c += tl.load(c_ptr + o, mask=m, other=0.0)
    for _ in range(1, parts):
        p_p += numel
        b_c += tl.load(p_p, mask=m, other=0.0)
    tl.store(c_ptr + o, b_c, mask=m)


# One body, two specializations. Sizes that vary with N or with the shard are not
# specialized; the padded bound of A's contiguous dimension is (it is always a multiple
# of 128, so every call vectorizes alike).
# A = d_logits [rows, cols] (grad_hidden): contiguous along K, bounded by K_A (padded).
matmul_acc_kernel = triton.jit(do_not_specialize=["M", "M_A", "K", "K_B", "rows", "chunk_k"])(
    matmul_acc_body
)
# A = d_logits^T [cols, rows] (grad_weight): contiguous along M, bounded by M_A (padded).
matmul_acc_t_kernel = triton.jit(do_not_specialize=["M", "K", "K_A", "K_B", "rows", "chunk_k"])(
    matmul_acc_body
)


# ----------------------------------------------------------------------------- launchers


def matmul_acc(
    c: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cfg: KernelConfig,
    *,
    m_a: int | None = None,
    k_a: int | None = None,
    accumulate: bool = True,
    chunk_k: int | None = None,
) -> None:
    """``c += a @ b`` (fp32 ``c``; ``accumulate=False``: ``c = a @ b``, bitwise as into a
    zeroed ``c``). ``a`` may extend, with exact zeros, to ``m_a`` rows or ``k_a`` columns
    past its shape: the padded bound of its contiguous dimension (give exactly one of
    them; ``m_a`` means ``a`` is a transposed d_logits buffer).

    ``chunk_k``: K is consecutive chunks of that many columns, and the result is bitwise
    that of one call per chunk in order (``c += a_0 @ b_0``, then ``c += a_1 @ b_1``, ..).
    Where the output's waves take the narrow block (``plan.mm_block_n``): the chunks side by
    side on the pinned block, then their ordered sum (``SPLIT``, where :func:`split_chunks`
    allows), else one launch that holds C's block and the chunk's sum (``MULTI``, on the
    narrow block, with tensor descriptors); otherwise the calls one by one, each on the
    block the waves pick (the pointer path with two fp32 blocks live would spill registers).
    ``chunk_k`` is for grad_hidden's GEMM (no ``m_a``)."""
    if chunk_k is not None and m_a is not None:
        raise ValueError("matmul_acc: chunk_k is for grad_hidden's GEMM (no m_a)")
    m, k = a.shape
    n = b.shape[1]
    k_a = k if k_a is None else k_a
    multi = chunk_k is not None and max(k, k_a) > chunk_k
    block_n = mm_block_n(cfg, m, n, a.device)
    chunks = triton.cdiv(max(k, k_a), chunk_k) if multi else 1
    if multi and split_chunks(cfg, c, m, n, chunks, block_n):
        _split_launch(c, a, b, cfg, k_a=k_a, chunk_k=chunk_k, chunks=chunks, acc=accumulate)
        return
    a_t = m_a is not None
    if multi and not (cfg.tma and tma_ok(a, b) and block_n == narrow_block_n(cfg)):
        for k0 in range(0, max(k, k_a), chunk_k):
            matmul_acc(
                c,
                a[:, k0 : k0 + chunk_k],
                b[k0 : k0 + chunk_k],
                cfg,
                k_a=min(k_a - k0, chunk_k),
                accumulate=accumulate or k0 > 0,
            )
        return
    m_a = m if m_a is None else m_a
    a_src, b_src, tma = gemm_sources(a, b, m_a, k_a, a_t, cfg, block_n)
    c_tma = tma and accumulate and tma_ok(c)
    gc = cfg.gemm
    blocks_m = triton.cdiv(m, gc.block_m)
    kernel = matmul_acc_t_kernel if a_t else matmul_acc_kernel
    kernel[(blocks_m * triton.cdiv(n, block_n),)](
        a_src=a_src,
        b_src=b_src,
        c_ptr=descriptor(c, m, n, (gc.block_m, block_n)) if c_tma else c,
        M=m,
        M_A=m_a,
        N=n,
        K=max(k, k_a),
        K_A=k_a,
        K_B=k,
        rows=swizzle_rows(cfg, blocks_m),
        chunk_k=chunk_k if multi else max(k, k_a),
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        BLOCK_M=gc.block_m,
        BLOCK_N=block_n,
        BLOCK_K=gc.block_k,
        TMA=tma,
        A_T=a_t,
        ACC=accumulate,
        C_TMA=c_tma,
        MULTI=multi,
        SPLIT=False,
        **launch_opts(gc, a.device),
    )


def _split_launch(c, a, b, cfg: KernelConfig, *, k_a: int, chunk_k: int, chunks: int, acc: bool):
    """:func:`matmul_acc`'s ``SPLIT``: each K chunk summed from +0.0 into its slab of an fp32
    ``[chunks, M, N]`` scratch on the pinned block, then the slabs added in order."""
    m, k = a.shape
    n = b.shape[1]
    gc = cfg.gemm
    blocks_m = triton.cdiv(m, gc.block_m)
    a_src, b_src, tma = gemm_sources(a, b, m, k_a, False, cfg, gc.block_n)
    parts = scratch.empty((chunks, m, n), dtype=torch.float32, device=c.device)
    matmul_acc_kernel[(blocks_m * triton.cdiv(n, gc.block_n), chunks)](
        a_src=a_src,
        b_src=b_src,
        c_ptr=parts,
        M=m,
        M_A=m,
        N=n,
        K=max(k, k_a),
        K_A=k_a,
        K_B=k,
        rows=swizzle_rows(cfg, blocks_m),
        chunk_k=chunk_k,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=n,
        stride_cn=1,
        BLOCK_M=gc.block_m,
        BLOCK_N=gc.block_n,
        BLOCK_K=gc.block_k,
        TMA=tma,
        A_T=False,
        ACC=False,
        C_TMA=False,
        MULTI=False,
        SPLIT=True,
        **launch_opts(gc, a.device),
    )
    ordered_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
        c_ptr=c,
        p_ptr=parts,
        numel=m * n,
        parts=chunks,
        ACC=acc,
        BLOCK=SUM_BLOCK,
        **compile_opts(c.device),
    )


SUM_BLOCK = 1024  # elements per program of ordered_sum_kernel
SPLIT_BYTES = 256 << 20
"""The most memory that :func:`matmul_acc`'s split chunks (fp32 ``[chunks, M, N]``) take."""


def split_chunks(cfg: KernelConfig, c: torch.Tensor, m: int, n: int, chunks: int, block_n: int):
    """Whether :func:`matmul_acc` computes its ``chunks`` K chunks side by side (``SPLIT``,
    on the wide output block, then :func:`ordered_sum_kernel`) rather than in one program
    per output block (``MULTI``): where the waves pick the narrow block (the wide grid alone
    leaves SMs idle), the chunks' wide programs fill the GPU instead, within
    :data:`SPLIT_BYTES` of scratch, into a contiguous C. Either way, the same bits."""
    narrow = narrow_block_n(cfg)
    return (
        chunks > 1
        and block_n == narrow != cfg.gemm.block_n
        and c.is_contiguous()
        and chunks * m * n * 4 <= SPLIT_BYTES
    )


def gemm_sources(a, b, m_a: int, k_a: int, a_t: bool, cfg: KernelConfig, block_n: int):
    """``(a_src, b_src, tma)`` for ``a @ b`` with ``a`` bounded by ``m_a x k_a`` (padded, see
    :func:`matmul_acc`): tensor descriptors when the config asks for them and both
    allow them, else the tensors. ``a_t``: ``a`` is the transpose of a row-major buffer."""
    a_rm = a.T if a_t else a  # the row-major buffer behind a
    if not (cfg.tma and tma_ok(a_rm, b)):
        return a, b, False
    k_b, n = b.shape
    block_m, block_k = cfg.gemm.block_m, cfg.gemm.block_k
    if a_t:
        a_src = descriptor(a_rm, a.shape[1], m_a, (block_k, block_m))
    else:
        a_src = descriptor(a_rm, m_a, k_a, (block_m, block_k))
    return a_src, descriptor(b, k_b, n, (block_k, block_n)), True
