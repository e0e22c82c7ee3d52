"""Generic ``@triton.jit`` helpers of the triton backend's kernels.

- :func:`swizzle`: the launch order (row blocks a few at a time, rows fastest).
- :func:`target_codes`: each row's target column in a weight operand, from the raw ids.
- :func:`logits_block`: one fp32 block of ``h W^T (+ b)`` (the forward and d_logits).
- :func:`operand_ptrs` and :func:`gemm_step`: one K step of lp's GEMMs (fp32 and fixed point).
- :func:`exp_ftz`: ``e^x`` with subnormal results flushed; :func:`reciprocal`: ``1 / x`` in
  one ``MUFU`` on the GPU.

Operands come through tensor descriptors (``TMA``) or masked pointer loads; both feed the
same ``tl.dot`` sequence. Under the interpreter (:data:`INTERPRET`) dots are an fp32
broadcast-multiply-and-sum: the interpreter computes bf16/fp16 dots wrongly, and its fp32
dot is a BLAS call whose result for a row depends on the row's position in the block.
Widening is exact (the products fit in fp32). The GPU path keeps half-precision
tensor-core dots. Every dot accumulates in fp32 with ``input_precision="ieee"`` (fp32
inputs: exact FMAs, never TF32).
"""

import triton
import triton.language as tl

from lp_kernels.backends.platform import triton_interpreting

INTERPRET: tl.constexpr = tl.constexpr(triton_interpreting())
"""Whether the kernels run under Triton's CPU interpreter (read when this module is first
imported, as ``triton.jit`` reads ``TRITON_INTERPRET``)."""
PRECISION: tl.constexpr = tl.constexpr("ieee")
"""The dots' input precision: exact fp32 products for 4-byte inputs (never TF32)."""
IGNORED = -2
"""The target code of an ignored row (:func:`target_codes`; kernels take it as a constexpr)."""


@triton.jit
def swizzle(pid, blocks_m, blocks_n, rows):
    """Block ``(i_m, i_n)`` of program ``pid``: ``rows`` row blocks at a time, rows fastest,
    so that the programs running together share their operands in L2 (order only)."""
    width = rows * blocks_n
    first_m = (pid // width) * rows
    size_m = tl.minimum(blocks_m - first_m, rows)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def target_codes(t_ptr, o_n, m_n, ignore_index, col0, cols, IGNORED: tl.constexpr):
    """Per row ``o_n``: the target's column in a weight operand whose first row is vocabulary
    id ``col0`` and which has ``cols`` rows (``t - col0``), -1 where the target lies
    elsewhere (or the row is past ``m_n``), ``IGNORED`` where the target equals
    ``ignore_index`` (any int64, a real id included). ``t_ptr``: the raw int32 or int64
    ids, compared in int64; the codes are int32 (``cols`` < 2^31; half the registers).

    Computed in every kernel that needs it, per row block: the host makes no target codes
    (a handful of elementwise ops before a call's first kernel)."""
    b_t = tl.load(t_ptr + o_n, mask=m_n, other=0).to(tl.int64)
    b_d = b_t - col0
    b_code = tl.where((b_d >= 0) & (b_d < cols), b_d, -1)
    b_code = tl.where(b_t == ignore_index, IGNORED, b_code)
    return tl.where(m_n, b_code, -1).to(tl.int32)


@triton.jit
def logits_block(
    h_src,
    w_src,
    b_ptr,
    row0,
    col0,
    m_n,
    m_v,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """fp32 ``[BLOCK_N, BLOCK_V]`` block of ``h W^T (+ b)`` for rows ``row0 +`` and columns
    ``col0 +``.

    ``h_src`` / ``w_src`` are tensor descriptors (TMA: out-of-bounds reads are zeros) or
    base pointers (masked loads, zeros likewise): the same products in the same order.
    ``HAS_BIAS``: the fp32 bias ``b_ptr[col0 +]`` (zeros past ``m_v``) is added to the
    finished sums, one rounding per logit (the ping-pong kernel adds it so too: on Hopper
    an accumulator that starts from it slows the MMAs).
    """
    if HAS_BIAS:  # loaded first: in flight during the MMAs
        b_b = tl.load(b_ptr + col0 + tl.arange(0, BLOCK_V), mask=m_v, other=0.0)
    b_acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if not TMA:
        o_h = tl.arange(0, BLOCK_H)
        o_n = row0 + tl.arange(0, BLOCK_N)
        o_v = col0 + tl.arange(0, BLOCK_V)
        p_h = h_src + o_n[:, None].to(tl.int64) * stride_hn + o_h[None, :] * stride_hh
        p_w = w_src + o_v[:, None].to(tl.int64) * stride_wv + o_h[None, :] * stride_wh
    for k0 in range(0, H, BLOCK_H):
        if TMA:
            b_h = h_src.load([row0, k0])  # [BLOCK_N, BLOCK_H]
            b_w = w_src.load([col0, k0])  # [BLOCK_V, BLOCK_H]
        elif EVEN_H:
            b_h = tl.load(p_h + k0 * stride_hh, mask=m_n[:, None], other=0.0)
            b_w = tl.load(p_w + k0 * stride_wh, mask=m_v[:, None], other=0.0)
        else:
            m_h = (o_h + k0) < H
            b_h = tl.load(p_h + k0 * stride_hh, mask=m_n[:, None] & m_h[None, :], other=0.0)
            b_w = tl.load(p_w + k0 * stride_wh, mask=m_v[:, None] & m_h[None, :], other=0.0)
        if INTERPRET:
            b_acc += tl.sum(b_h.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
        else:
            b_acc = tl.dot(b_h, tl.trans(b_w), b_acc, input_precision=PRECISION)
    if HAS_BIAS:
        b_acc = b_acc + b_b[None, :]
    return b_acc


@triton.jit
def exp_ftz(x):
    """``e^x`` of fp32 ``x`` (a block, or one element) as ``tl.exp`` computes it on the GPU,
    ``2^(x log2(e))``, but with ``ex2.approx.ftz.f32`` (``tl.math.exp2``'s lowering): a
    result below 2^-126 is 0 instead of a subnormal; every other one is the same bits.
    The softmax never needs those subnormals: a term below 2^-126 vanishes beside the row's
    largest, which is 1. ``tl.exp`` under the interpreter (``np.exp``)."""
    if INTERPRET:  # noqa: SIM108  (a constexpr branch)
        e = tl.exp(x)
    else:
        e = tl.math.exp2(x * 1.4426950408889634)
    return e


@triton.jit
def reciprocal(x):
    """``1 / x`` of fp32 ``x`` (a block, or one element): ``rcp.approx.ftz.f32`` on the GPU
    (at most 1 ulp off; subnormals flushed), a correctly rounded division under the
    interpreter (no inline assembly there). Triton's ``/`` is ``div.full.f32``, the same
    reciprocal behind range checks and rescaling."""
    if INTERPRET:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return r


@triton.jit
def gemm_step(
    acc,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    A_T: tl.constexpr,
):
    """``acc + A[:, k0 : k0 + BLOCK_K] @ B[k0 : k0 + BLOCK_K]`` for one output block.

    Operands come through tensor descriptors (``TMA``; ``A_T``: ``a_src`` describes A^T)
    or through the pointer blocks ``p_a`` / ``p_b`` at K offset 0, masked by A's rows
    (``m_am``), A's columns (``K_A``), B's rows (``K_B``) and B's columns (``m_n``).
    """
    if TMA:
        if A_T:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            b_a = tl.trans(a_src.load([k0, i_m * BLOCK_M]))
        else:
            b_a = a_src.load([i_m * BLOCK_M, k0])
        b_b = b_src.load([k0, i_n * BLOCK_N])
    else:
        # [BLOCK_M, BLOCK_K]
        b_a = tl.load(
            p_a + k0 * stride_ak, mask=m_am[:, None] & ((o_k + k0) < K_A)[None, :], other=0.0
        )
        # [BLOCK_K, BLOCK_N]
        b_b = tl.load(
            p_b + k0 * stride_bk, mask=((o_k + k0) < K_B)[:, None] & m_n[None, :], other=0.0
        )
    if INTERPRET:
        acc += tl.sum(b_a.to(tl.float32)[:, :, None] * b_b.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = tl.dot(b_a, b_b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def operand_ptrs(
    a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA: tl.constexpr
):
    """``(p_a, p_b)`` for :func:`gemm_step`: the pointer blocks of A's rows ``o_m`` and
    B's columns ``o_n`` at K offset 0, or (``TMA``) the descriptors themselves (unused).

    One ``return`` after a constexpr if/else: Triton still compiles the code after an early
    ``return`` under ``if TMA``, and pointer arithmetic on a descriptor fails."""
    if TMA:
        p_a = a_src
        p_b = b_src
    else:
        p_a = a_src + o_m[:, None].to(tl.int64) * stride_am + o_k[None, :] * stride_ak
        p_b = b_src + o_k[:, None].to(tl.int64) * stride_bk + o_n[None, :] * stride_bn
    return p_a, p_b
