"""The logit transform, the forward's online softmax and the d_logits arithmetic, as
``@triton.jit`` helpers: every kernel's math on a block of logits, in one place.

The transform (``lp_kernels.core.transform``) maps a raw logit ``l`` (fp32, bias included)
to ``z = c tanh(s l / c) / T``: ``SCALE`` multiplies by ``s`` (``scale``), ``CAP`` applies
the softcap ``c`` (``cap``, ``inv_cap = 1 / c``), ``inv_t = 1 / T``; its derivative is
``dz / dl = k_grad (1 - tanh^2)`` with ``k_grad = s / T`` (:func:`grad_factor`).
:func:`transform_args` makes these kernel arguments from the host's spec.

- :func:`softmax_update` / :func:`softmax_finish`: the online ``(m, s, a)`` of a row over
  blocks of raw logits, and the partial's ``m`` and target ``z`` at its end. The Triton
  forward kernel and the ping-pong one (Gluon, on its own layouts) both call them, so
  their partials are the same bits.
- :func:`dlogits_rows` / :func:`dlogits_block`: ``d l`` of a block of raw logits, for the
  d_logits kernel that recomputes them and the fused loss's that reads them.
- :func:`store_column_sums`: grad_bias' share of a stored block of ``d l``.

Numerics. The partial statistics follow ``lp_kernels.core.stats``: exponents relative to a
running maximum seeded with -inf, entropy assembled from ``z - m``. Under a cap the softmax
terms take ``tanh = 2 r - 1`` and the slope ``(1 - tanh^2) / 4 = r (1 - r)`` from ``r = 1 /
(1 + e^(-2 x / c))`` (:func:`cap_r`), where only absolute errors matter (a few 2^-24),
element by element on the GPU (``tl.map_elementwise``, in the ``*_block`` helpers, which
run the same function on the blocks under the interpreter: as blocks beside the logits
block, ptxas spills); the target's logit, which a log-prob
returns as it is, takes the accurate form of :func:`cap_value` (a series below ``|x| =
1/8``). Without entropy the capped terms are ``2^(x - b)`` in base 2 (:func:`cap_x`), with
the running maximum held as ``b = (m + c / T) log2(e)``. Non-finite logits stay non-finite
(a ``-inf`` mask stays a mask).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lp_kernels.backends.triton.tl_utils import INTERPRET, exp_ftz, reciprocal
from lp_kernels.core.transform import LogitTransform

LOG2E = 1.4426950408889634
"""``log2(e)`` (as the fp32 literals below round it)."""


def transform_args(t: LogitTransform) -> dict:
    """The keyword arguments of every kernel that transforms logits, from the host's spec:
    ``scale``, ``cap``, ``inv_cap`` and ``inv_t`` (floats; 1.0 where a step is absent) and
    the constexpr flags ``SCALE`` and ``CAP``."""
    cap = 1.0 if t.softcap is None else t.softcap
    scale = t.logit_scale
    return {
        "scale": 1.0 if scale is None else scale,
        "cap": cap,
        "inv_cap": 1.0 / cap,
        "inv_t": t.inv_temperature,
        "SCALE": scale is not None,
        "CAP": t.capped,
    }


# ----------------------------------------------------------------------------- the cap


@triton.jit
def cap_constants(cap, inv_cap, inv_t):
    """``(k_e, k_z, k_a, k_t)``: ``-2 log2(e) / c``, ``c / T``, ``2 c log2(e) / T`` and
    ``log2(e) / T``, the capped terms' factors."""
    k_e = inv_cap * -2.8853900817779268  # -2 log2(e) / c
    k_z = cap * inv_t
    k_a = k_z * 2.8853900817779268  # 2 log2(e) c / T
    k_t = inv_t * 1.4426950408889634  # log2(e) / T
    return k_e, k_z, k_a, k_t


@triton.jit
def with_sign_of(t, x):
    """``t >= 0`` with ``x``'s sign bit (one ``LOP3``, no compare and select)."""
    return (t.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(
        tl.float32, bitcast=True
    )


@triton.jit
def cap_value(l, cap, inv_cap):
    """``(c tanh(l / c), 1 - tanh^2(l / c))`` of fp32 ``l`` (the formula of
    ``lp_kernels.core.transform``): ``e = exp(-2|x|)``, ``r = 1 / (1 + e)``, ``tanh =
    sign(x) (r - e r)``, its series below ``|x| = 1/8``, slope ``4 e r^2``; non-finite logits
    pass through. Two ``MUFU`` per element: the flush-to-zero ``ex2`` and one reciprocal."""
    x = l * inv_cap
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2a): -2 log2(e) in fp32 (exact x 2)
    r = reciprocal(1.0 + e)
    er = e * r
    t = r - er
    a2 = a * a
    ts = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = with_sign_of(tl.where(a < 0.125, ts, t), x)
    return tl.where(a < float("inf"), cap * t, l), 4.0 * (er * r)


@triton.jit
def cap_r(l, k_e):
    """``r = 1 / (1 + e^(-2 l / c))`` of fp32 ``l`` with ``k_e = -2 log2(e) / c``: ``tanh(l /
    c) = 2 r - 1`` and ``(1 - tanh^2) / 4 = r (1 - r)``, signed, from one ``exp2`` and one
    :func:`reciprocal`. For ``l / c < -44`` the power is ``+inf`` and ``r = 0``; ``l = +inf``
    gives 1, ``-inf`` 0, NaN stays NaN."""
    return reciprocal(1.0 + tl.math.exp2(l * k_e))


@triton.jit
def cap_z(l, k_e, k_z, inv_t):
    """``z = c tanh(l / c) / T = 2 k_z r - k_z`` (one FMA from :func:`cap_r`'s ``r``) for the
    forward's softmax terms with entropy; non-finite logits pass through as ``l / T``."""
    r = cap_r(l, k_e)
    return tl.where(tl.abs(l) < float("inf"), r * (2.0 * k_z) - k_z, l * inv_t)


@triton.jit
def cap_x(l, k_e, k_a, k_t):
    """``x = (z + k_z) log2(e) = k_a r`` of a logit for the forward's terms without entropy,
    ``2^(x - b)``; non-finite logits pass through as ``l k_t`` (``k_t = log2(e) / T``)."""
    r = cap_r(l, k_e)
    return tl.where(tl.abs(l) < float("inf"), r * k_a, l * k_t)


@triton.jit
def cap_m(b, k_z):
    """The partial's ``m = b ln(2) - k_z`` from the running ``b`` of :func:`cap_x`'s terms
    (``-inf`` and ``+inf`` stay)."""
    return b * 0.6931471805599453 - k_z


@triton.jit
def entropy_terms(z, m):
    """``(e^(z - m), e^(z - m) (z - m))`` of a block or one element: the capped terms with
    entropy."""
    d = z - m
    e = tl.exp(d)
    return e, e * d


@triton.jit
def cap_x_block(l, k_e, k_a, k_t):
    """:func:`cap_x` of a block, element by element on the GPU."""
    if INTERPRET:  # noqa: SIM108  (a constexpr branch)
        x = cap_x(l, k_e, k_a, k_t)
    else:
        x = tl.map_elementwise(cap_x, l, k_e, k_a, k_t)
    return x


@triton.jit
def cap_z_block(l, k_e, k_z, inv_t):
    """:func:`cap_z` of a block, element by element on the GPU."""
    if INTERPRET:  # noqa: SIM108  (a constexpr branch)
        z = cap_z(l, k_e, k_z, inv_t)
    else:
        z = tl.map_elementwise(cap_z, l, k_e, k_z, inv_t)
    return z


@triton.jit
def entropy_terms_block(z, m):
    """:func:`entropy_terms` of a block (``m``: the rows' ``[rows, 1]``), element by element
    on the GPU."""
    if INTERPRET:
        e, ed = entropy_terms(z, m)
    else:
        e, ed = tl.map_elementwise(entropy_terms, z, m)
    return e, ed


# ----------------------------------------------------------------------------- forward


@triton.jit
def real_columns(m_v, b_cols, v0, v_end):
    """``m_v``, or where it is None the mask of the columns ``v0 + b_cols`` below ``v_end``."""
    if m_v is None:  # noqa: SIM108  (a constexpr branch)
        m = (v0 + b_cols) < v_end
    else:
        m = m_v
    return m


@triton.jit
def softmax_update(
    b_m,
    b_s,
    b_a,
    b_l,
    m_v,
    b_cols,
    v0,
    v_end,
    scale,
    inv_t,
    k_e,
    k_z,
    k_a,
    k_t,
    ENTROPY: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """The rows' running ``(m, s, a)`` after one block of raw logits ``b_l [rows, cols]``
    whose columns ``v0 + b_cols`` (``b_cols``: ``0 .. cols - 1`` in the caller's layout) are
    real below ``v_end``: ``m_v [cols]``, or None (then the mask is made where it is needed,
    from ``b_cols``). ``a`` only with ``ENTROPY`` (else returned as it came); without entropy
    under a cap ``m`` is held as ``b`` (:func:`cap_x`; :func:`softmax_finish` turns it back).
    Start from ``m = -inf``, ``s = a = 0``; a row whose logits are all ``-inf`` so far keeps
    them (its entropy term ``0 x -inf`` aside), and drops out when a finite logit comes."""
    partial = v0 + b_l.shape[1] > v_end  # the split's last block, cut: the selects only there
    if SCALE:
        b_l = b_l * scale
    if CAP and not ENTROPY:  # x = (z + c / T) log2(e)
        b_z = cap_x_block(b_l, k_e, k_a, k_t)
    elif CAP:
        b_z = cap_z_block(b_l, k_e, k_z, inv_t)
    else:
        b_z = b_l * inv_t
    if partial:
        b_z = tl.where(real_columns(m_v, b_cols, v0, v_end)[None, :], b_z, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_z, axis=1))
    # a row with no mass yet (every logit so far -inf, a bias' masked columns): its terms are
    # taken against 0, so they are e^-inf = 0, not e^(-inf + inf) = NaN
    b_mz = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    if CAP and not ENTROPY:  # b_m holds b = (m + c / T) log2(e): terms 2^(x - b)
        b_alpha = tl.math.exp2(b_m - b_mz)
        b_e = tl.math.exp2(b_z - b_mz[:, None])
    else:
        b_alpha = exp_ftz(b_m - b_mz)
        if CAP:
            b_e, b_ed = entropy_terms_block(b_z, b_mz[:, None])
        else:
            b_d = b_z - b_mz[:, None]
            b_e = exp_ftz(b_d)
            if ENTROPY:
                b_ed = b_e * b_d
    if ENTROPY:
        if partial:  # masked columns: e = 0, d = -inf
            b_ed = tl.where(real_columns(m_v, b_cols, v0, v_end)[None, :], b_ed, 0.0)
        b_shift = tl.where(b_s > 0, b_m - b_mn, 0.0)
        b_a = b_alpha * (b_a + b_shift * b_s) + tl.sum(b_ed, axis=1)
    b_s = b_s * b_alpha + tl.sum(b_e, axis=1)
    return b_mn, b_s, b_a


@triton.jit
def extras_update(
    b_xm,
    b_xq,
    b_xu,
    b_xi,
    b_l,
    m_v,
    col0,
    scale,
    inv_t,
    k_e,
    k_z,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """The rows' running extras partial (``lp_kernels.core.extras``) after one block of raw
    logits ``b_l [rows, cols]`` whose columns, ids ``col0 + 0 .. cols - 1``, are real where
    ``m_v``: ``x = max z``, ``q = sum e^(2 (z - x))`` (rescaled as ``s`` is), ``u = sum z``
    and ``i``, the first id of the maximum (a later block takes it only when larger).
    ``z`` is the transform's value (``cap_z`` under a cap). Start from the empty partial
    ``(-inf, 0, 0, NO_COLUMN)``."""
    if SCALE:
        b_l = b_l * scale
    if CAP:  # noqa: SIM108  (a constexpr branch)
        b_z = cap_z_block(b_l, k_e, k_z, inv_t)
    else:
        b_z = b_l * inv_t
    b_z = tl.where(m_v[None, :], b_z, float("-inf"))
    b_bm = tl.max(b_z, axis=1)
    b_bi = tl.argmax(b_z, axis=1, tie_break_left=True).to(tl.int64) + col0
    b_xi = tl.where(b_bm > b_xm, b_bi, b_xi)
    b_mn = tl.maximum(b_xm, b_bm)
    b_mz = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # no mass yet: terms e^-inf = 0
    b_q = tl.exp(2.0 * (b_z - b_mz[:, None]))
    b_xq = b_xq * tl.exp(2.0 * (b_xm - b_mz)) + tl.sum(b_q, axis=1)
    b_xu += tl.sum(tl.where(m_v[None, :], b_z, 0.0), axis=1)
    return b_mn, b_xq, b_xu, b_xi


@triton.jit
def softmax_finish(
    b_m,
    b_lt,
    scale,
    cap,
    inv_cap,
    inv_t,
    k_z,
    ENTROPY: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """``(m, t)`` of a partial: ``m`` from the running value of :func:`softmax_update`, and
    the target's ``z`` from its raw logit ``b_lt`` (0 where the target lies elsewhere)."""
    if SCALE:
        b_lt = b_lt * scale
    if CAP:  # the target's z with the series
        b_lt = cap_value(b_lt, cap, inv_cap)[0]
        if not ENTROPY:  # m from b (-inf and +inf stay)
            b_m = cap_m(b_m, k_z)
    return b_m, b_lt * inv_t


# ----------------------------------------------------------------------------- d_logits


@triton.jit
def cap_dl(l, k_e, k_a, b_p, c0, hit, g_lp):
    """``d l`` of a capped logit without the entropy term: ``(p c0 + [hit] g_lp) (1 -
    tanh^2)``, ``p = e^(z - lse) = 2^(k_a r - b_p)`` (``b_p = (lse + c / T) log2(e)``), the
    slope ``r - r^2`` (``c0`` and ``g_lp`` carry ``k_grad`` and the slope's 4). An infinite
    logit has ``r`` 0 or 1, slope 0: its ``d l`` is 0."""
    r = cap_r(l, k_e)
    s = r - r * r
    p = tl.math.exp2(r * k_a - b_p)
    return (p * c0 + tl.where(hit, g_lp, 0.0)) * s


@triton.jit
def cap_dl_entropy(l, k_e, k_a, b_p, c1, c2, hit, g_lp):
    """:func:`cap_dl` with the entropy term: ``(p (c0 - g_ent (z - E)) + [hit] g_lp) (1 -
    tanh^2)``, where ``z = 2 k_z r - k_z`` makes the factor ``c1 - c2 r`` with the rows' ``c1
    = c0 + g_ent (k_z + E)`` and ``c2 = 2 k_z g_ent`` (one FMA)."""
    r = cap_r(l, k_e)
    s = r - r * r
    p = tl.math.exp2(r * k_a - b_p)
    return (p * (c1 - c2 * r) + tl.where(hit, g_lp, 0.0)) * s


@triton.jit
def capped_dlogits(
    b_l,
    b_trel,
    b_lse,
    b_c0,
    b_glp,
    b_mean,
    b_gent,
    cap,
    inv_cap,
    inv_t,
    k_grad,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
):
    """``d l`` of a block of capped logits ``b_l`` (``b_trel``: each row's target column
    relative to the block, int32), element by element on the GPU. ``b_c0`` carries
    ``k_grad``; the slope's 4 joins it and the other per-row factors here (``b_glp``: the
    rows' upstream gradient of logprob, zeros without one). ``g_lp`` is selected into the
    target's column in every block (a branch around it made ptxas spill)."""
    k_e, k_z, k_a, _ = cap_constants(cap, inv_cap, inv_t)
    b_p = (b_lse + k_z) * 1.4426950408889634
    b_c0 = b_c0 * 4.0  # exact: the slope's 4
    if HAS_LP:  # noqa: SIM108  (a constexpr branch)
        b_glp = b_glp * (4.0 * k_grad)
    else:
        b_glp = tl.zeros_like(b_c0)  # a constant: the select folds away
    m_hit = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
    if ENTROPY:
        b_gent = b_gent * (4.0 * k_grad)
        b_c1 = b_c0 + b_gent * (b_mean + k_z)
        b_c2 = b_gent * (2.0 * k_z)
        args = (b_l, k_e, k_a, b_p[:, None], b_c1[:, None], b_c2[:, None], m_hit, b_glp[:, None])
        if INTERPRET:  # noqa: SIM108  (a constexpr branch)
            b_dl = cap_dl_entropy(*args)
        else:
            b_dl = tl.map_elementwise(cap_dl_entropy, *args)
    else:
        args = (b_l, k_e, k_a, b_p[:, None], b_c0[:, None], m_hit, b_glp[:, None])
        if INTERPRET:  # noqa: SIM108  (a constexpr branch)
            b_dl = cap_dl(*args)
        else:
            b_dl = tl.map_elementwise(cap_dl, *args)
    return b_dl


@triton.jit
def dlogits_rows(
    lse_ptr,
    glse_ptr,
    glp_ptr,
    gent_ptr,
    mean_ptr,
    o_n,
    m_n,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """The per-row inputs of :func:`dlogits_block` for rows ``o_n``: ``(lse, g_lp, g_lse, E,
    g_ent)``, fp32 ``[BLOCK_N]``, an absent gradient (and E without ``ENTROPY``) as +0.0.
    Read as they come: an ignored row's may hold anything."""
    b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0)
    b_glp = tl.zeros_like(b_lse)
    b_glse = tl.zeros_like(b_lse)
    b_mean = tl.zeros_like(b_lse)
    b_gent = tl.zeros_like(b_lse)
    if HAS_LP:
        b_glp = tl.load(glp_ptr + o_n, mask=m_n, other=0.0)
    if HAS_LSE:
        b_glse = tl.load(glse_ptr + o_n, mask=m_n, other=0.0)
    if ENTROPY:
        b_mean = tl.load(mean_ptr + o_n, mask=m_n, other=0.0)
        b_gent = tl.load(gent_ptr + o_n, mask=m_n, other=0.0)
    return b_lse, b_glp, b_glse, b_mean, b_gent


@triton.jit
def grad_factor(scale, inv_t, SCALE: tl.constexpr):
    """``k_grad = s / T``: ``d l = d z k_grad (1 - tanh^2)``."""
    if SCALE:  # noqa: SIM108  (a constexpr branch)
        k_grad = inv_t * scale
    else:
        k_grad = inv_t
    return k_grad


@triton.jit
def dlogits_block(
    b_l,
    b_t,
    b_lse,
    b_glp,
    b_glse,
    b_mean,
    b_gent,
    col0,
    scale,
    cap,
    inv_cap,
    inv_t,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """``d l`` of a block of raw logits ``b_l`` (``h W^T + b``, fp32) whose first column is
    ``col0`` (the target codes' numbering), rows with target codes ``b_t`` and the per-row
    inputs of :func:`dlogits_rows`::

        d l = (p (c0 - g_ent (z - E)) + g_lp [col == target]) dz/dl,   c0 = g_lse - g_lp

    with ``k_grad`` folded into the per-row factors. Rows and columns outside the block's
    bounds, and ignored rows, are the caller's to zero."""
    k_grad = grad_factor(scale, inv_t, SCALE)
    b_c0 = (b_glse - b_glp) * k_grad
    if SCALE:
        b_l = b_l * scale
    if CAP:  # d l = d z k_grad (1 - tanh^2), element by element
        b_trel = (b_t - col0).to(tl.int32)  # int32: one compare each
        b_dz = capped_dlogits(
            b_l,
            b_trel,
            b_lse,
            b_c0,
            b_glp,
            b_mean,
            b_gent,
            cap,
            inv_cap,
            inv_t,
            k_grad,
            BLOCK_V,
            ENTROPY,
            HAS_LP,
        )
    else:
        b_zs = b_l * inv_t
        b_p = exp_ftz(b_zs - b_lse[:, None])
        if ENTROPY:
            b_gent = b_gent * k_grad
            b_dz = b_p * (b_c0[:, None] - b_gent[:, None] * (b_zs - b_mean[:, None]))
        else:
            b_dz = b_p * b_c0[:, None]
        if HAS_LP:  # + g_lp k_grad in the target's column, in blocks that hold some target
            b_trel = b_t - col0
            if tl.max(((b_trel >= 0) & (b_trel < BLOCK_V)).to(tl.int32), axis=0) > 0:
                m_hit = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
                b_dz = tl.where(m_hit, b_dz + (b_glp * k_grad)[:, None], b_dz)
    return b_dz


@triton.jit
def store_column_sums(p_db, m_c, b_dl):
    """Store the fp32 column sums of ``b_dl``, a ``[rows, cols]`` block of ``d l`` in the dtype
    the gradient GEMMs read, at ``p_db + [0, cols)`` (mask ``m_c``): grad_bias' share of the
    block, ``1^T d l`` as grad_weight's is ``d l^T h``.

    A 16-bit block goes through the tensor cores: one MMA of a ``[16, rows]`` block of ones
    with it, in fp32 (its 16 rows are the same sums; the first is stored). Each column's sum
    is the same bits wherever the column sits (an MMA column depends on its own inputs
    only), without the cross-lane shuffles of ``tl.sum`` over the MMA layout's rows. An
    fp32 block, and the interpreter, sum with ``tl.sum``; ``rows`` must be at least 16 on
    the GPU."""
    if INTERPRET or b_dl.dtype == tl.float32:
        tl.store(p_db, tl.sum(b_dl.to(tl.float32), axis=0), mask=m_c)
    else:
        b_s = tl.dot(tl.full([16, b_dl.shape[0]], 1.0, b_dl.dtype), b_dl)  # fp32 [16, cols]
        o_r = tl.arange(0, 16)[:, None]
        tl.store(p_db[None, :] + o_r * 0, b_s, mask=(o_r == 0) & m_c[None, :])
