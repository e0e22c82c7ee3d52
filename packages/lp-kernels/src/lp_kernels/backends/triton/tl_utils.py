"""Shared ``@triton.jit`` helpers of the triton backend's kernels.

- :func:`grouped`: the launch order (row blocks ``group`` at a time, rows fastest).
- :func:`target_codes`: each row's target column in a weight operand, from the raw ids.
- :func:`logits_tile`: one fp32 tile of ``h W^T`` (the forward and the d_logits kernel).
- :func:`operand_ptrs` and :func:`gemm_step`: one K step of lp's GEMMs (fp32 and fixed point).
- :func:`exp_ftz`: ``e^x`` with subnormal results flushed (the plain softmax terms).
- :func:`softcap`: final-logit softcapping of fp32 logits and its slope, with
  :func:`reciprocal` (one ``MUFU`` on the GPU);
  :func:`cap_r`: ``(1 + tanh) / 2`` of the cap for the softmax terms and d_logits' slope,
  :func:`capped_z`: a capped logit's ``z`` for the forward's softmax terms with entropy,
  :func:`capped_x`: its base-2 offset ``x`` for the terms without entropy, and
  :func:`capped_m`: their partial's ``m``.

Operands come through tensor descriptors (``TMA``) or masked pointer loads; both feed the
same ``tl.dot`` sequence. Under the interpreter (``INTERPRET``) dots are an fp32
broadcast-multiply-and-sum (see the ``function`` module's docstring).
"""

import triton
import triton.language as tl

IGNORED = -2
"""The target code of an ignored row (:func:`target_codes`; kernels take it as a constexpr)."""


@triton.jit
def grouped(pid, blocks_m, blocks_n, group):
    """Tile (i_m, i_n) of program ``pid``: ``group`` row blocks at a time, rows fastest, so
    that the programs running together share their operands in L2 (order only)."""
    width = group * blocks_n
    first_m = (pid // width) * group
    size_m = tl.minimum(blocks_m - first_m, group)
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
def logits_tile(
    h_src, w_src, b_ptr, row0, col0, m_n, m_v, H, stride_hn, stride_hh, stride_wv, stride_wh,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N, BLOCK_V]`` tile of ``h W^T (+ b)`` for rows ``row0 +`` and columns
    ``col0 +``.

    ``h_src`` / ``w_src`` are tensor descriptors (TMA: out-of-bounds reads are zeros) or
    base pointers (masked loads, zeros likewise): the same products in the same order.
    ``HAS_BIAS``: the fp32 bias ``b_ptr[col0 +]`` (zeros past ``m_v``) is added to the
    finished sums, one rounding per logit (``pingpong``'s kernel adds it so too: on Hopper
    an accumulator that starts from it slowed that kernel's MMAs by up to 13 %).
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
def exp_ftz(x, INTERPRET: tl.constexpr = False):
    """``e^x`` of fp32 ``x`` (a block, or one element) as ``tl.exp`` computes it on the GPU,
    ``2^(x log2(e))``, but with ``ex2.approx.ftz.f32`` (``tl.math.exp2``'s lowering): a
    result below 2^-126 is 0 instead of a subnormal; every other one is the same bits.
    ``tl.exp`` lowers to ``ex2.approx.f32``, which ptxas wraps in a range check, a halving
    and a squaring (three instructions per element around the one ``MUFU.EX2``). The
    softmax never needs those subnormals: a term below 2^-126 vanishes beside the row's
    largest, which is 1. ``tl.exp`` under the interpreter (``np.exp``)."""
    if INTERPRET:  # noqa: SIM108  (a constexpr branch)
        e = tl.exp(x)
    else:
        e = tl.math.exp2(x * 1.4426950408889634)
    return e


@triton.jit
def reciprocal(x, INTERPRET: tl.constexpr):
    """``1 / x`` of fp32 ``x`` (a block, or one element): one ``MUFU.RCP`` on the GPU
    (``rcp.approx.ftz.f32``, at most 1 ulp off; subnormals flushed), a correctly rounded
    division under the interpreter (no inline assembly there). Triton's ``/`` is
    ``div.full.f32``: the same ``MUFU.RCP`` behind range checks and rescaling, nine
    instructions in all."""
    if INTERPRET:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return r


@triton.jit
def tanh_of_exp(e, INTERPRET: tl.constexpr = False):
    """``(|tanh(x)|, (1 - tanh^2(x)) / 4)`` from ``e = exp(-2|x|)``: ``r = 1 / (1 + e)``,
    ``r - e r`` (``(1 - e) / (1 + e)``; one FMA on the GPU) and ``e r^2``, one
    :func:`reciprocal` for both (:func:`softcap`)."""
    r = reciprocal(1.0 + e, INTERPRET)
    er = e * r
    return r - er, er * r


@triton.jit
def with_sign_of(t, x):
    """``t >= 0`` with ``x``'s sign bit (one ``LOP3``, no compare and select)."""
    return (t.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(
        tl.float32, bitcast=True
    )


@triton.jit
def softcap(l, cap, inv_cap, INTERPRET: tl.constexpr = False):
    """``(c tanh(l / c), 1 - tanh^2(l / c))`` of fp32 ``l``, from ``exp2`` and one reciprocal
    (the formula of ``lp_kernels.core.transform``): ``e = exp(-2|x|)``, ``r = 1 / (1 + e)``,
    ``tanh = sign(x) (r - e r)``, its series below ``|x| = 1/8``, slope ``4 e r^2``;
    non-finite logits pass through.

    ``l`` is a block, or one element inside ``tl.map_elementwise`` (whose scalar functions
    take no constexpr: hence the GPU default of ``INTERPRET``). Two ``MUFU`` per element:
    ``exp2`` is the flush-to-zero ``ex2`` (``tl.exp`` adds a subnormal path; its argument
    ``-2|x| log2 e`` here is the same fp32 product), and :func:`reciprocal` serves both
    tanh and the slope."""
    x = l * inv_cap
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2a): -2 log2(e) in fp32 (exact x 2)
    t, slope = tanh_of_exp(e, INTERPRET)
    a2 = a * a
    ts = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = with_sign_of(tl.where(a < 0.125, ts, t), x)
    return tl.where(a < float("inf"), cap * t, l), 4.0 * slope


@triton.jit
def cap_r(l, k_e, INTERPRET: tl.constexpr = False):
    """``r = 1 / (1 + e^(-2 l / c))`` of fp32 ``l`` with ``k_e = -2 log2(e) / c``: ``tanh(l /
    c) = 2 r - 1`` and ``(1 - tanh^2) / 4 = r (1 - r)``, signed (no ``|l|`` and sign bit as
    in :func:`softcap`), from one ``exp2`` and one :func:`reciprocal`: the capped softmax
    terms' and the slope's form in the forward (:func:`capped_z`, :func:`capped_x`) and in
    d_logits (``backward.capped_dl``), where only absolute errors matter (a few 2^-24).
    For ``l / c < -44`` the power is ``+inf`` and ``r = 0``; ``l = +inf`` gives 1, ``-inf``
    0, NaN stays NaN. Elementwise: a block, or one element under ``tl.map_elementwise``.

    The target's logit, which a log-prob returns as it is, comes from :func:`softcap`."""
    return reciprocal(1.0 + tl.math.exp2(l * k_e), INTERPRET)


@triton.jit
def capped_z(l, k_e, k_z, inv_t, INTERPRET: tl.constexpr = False):
    """``z = c tanh(l / c) / T`` of a logit for the forward's softmax terms, ``k_e = -2
    log2(e) / c``, ``k_z = c / T``; non-finite logits pass through (``-inf`` stays a
    mask). Elementwise: a block, or one element under ``tl.map_elementwise``.

    ``tanh(x) = 2 r - 1`` with :func:`cap_r`'s ``r``, so ``z = 2 k_z r - k_z`` is one FMA
    from ``r``: five instructions to ``z`` where the form with ``|x|`` and the sign bit
    takes eight. Its absolute error is a few 2^-24 of ``k_z`` (``r``'s one rounding and the
    FMA's), that of :func:`softcap` without its series; for ``x < -44`` ``e^(-2x)`` is
    ``+inf``, ``r = 0`` and ``z = -k_z``, as the limit.

    Both forward kernels run it element by element on the GPU (with entropy, beside
    ``forward.stats_terms``), as d_logits runs its own cap: op by op, the cap's blocks
    beside the tile made ptxas spill (``python -m lp_testing.aot`` prints the stack
    frames; docs/history.md the figures)."""
    r = cap_r(l, k_e, INTERPRET)
    return tl.where(tl.abs(l) < float("inf"), r * (2.0 * k_z) - k_z, l * inv_t)


@triton.jit
def capped_x(l, k_e, k_a, k_t, INTERPRET: tl.constexpr = False):
    """``x = (z + k_z) log2(e)`` of a logit, ``z = c tanh(l / c) / T``, ``k_z = c / T``: the
    forward's softmax terms without entropy are ``2^(x - b)``, ``b`` the row's largest
    ``x``, ``(m + k_z) log2(e)``. ``x = k_a r`` with ``r = 1 / (1 + e^(-2 l / c))``
    (``tanh = 2 r - 1``; ``k_e = -2 log2(e) / c``, ``k_a = 2 k_z log2(e)``). The term's
    ``exp2`` is the flush-to-zero ``ex2`` (a term below 2^-126 is 0: a sum that holds its
    row's largest term, 1, does not see it) and no ``log2(e)`` factor is left: eight
    instructions to ``x`` and two to the term, where :func:`capped_z` and ``tl.exp(z -
    m)`` take eight and six. Non-finite logits pass through as ``l k_t`` (``k_t =
    log2(e) / T``), the infinity or NaN that ``z`` would be (``-inf`` stays a mask). The
    absolute error of ``x`` is that of :func:`capped_z`'s ``z`` times ``log2(e)`` (a few
    2^-24 of ``k_a``). Elementwise: a block, or one element under ``tl.map_elementwise``.
    """
    r = cap_r(l, k_e, INTERPRET)
    return tl.where(tl.abs(l) < float("inf"), r * k_a, l * k_t)


@triton.jit
def capped_m(b, k_z):
    """The partial's ``m = b ln(2) - k_z`` from the running ``b`` of :func:`capped_x`'s
    terms (``-inf`` and ``+inf`` stay): one expression for both forward kernels, whose
    partials are the same bits."""
    return b * 0.6931471805599453 - k_z


@triton.jit
def gemm_step(
    acc, a_src, b_src, p_a, p_b, k0, i_m, i_n, m_am, m_n, o_k, K_A, K_B, stride_ak, stride_bk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr,
):  # fmt: skip
    """``acc + A[:, k0 : k0 + BLOCK_K] @ B[k0 : k0 + BLOCK_K]`` for one output tile.

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

    One ``return`` after a constexpr if/else: Triton (3.6) still compiles the code after an
    early ``return`` under ``if TMA``, and pointer arithmetic on a descriptor fails."""
    if TMA:
        p_a = a_src
        p_b = b_src
    else:
        p_a = a_src + o_m[:, None].to(tl.int64) * stride_am + o_k[None, :] * stride_ak
        p_b = b_src + o_k[:, None].to(tl.int64) * stride_bk + o_n[None, :] * stride_bn
    return p_a, p_b
