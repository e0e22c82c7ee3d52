"""``deterministic=True``'s fixed-point kernels: grad_hidden as an exact int64 sum.

Each global tile's contribution to ``grad_hidden`` (a "leaf": an fp32 product computed
from zero over the tile's columns) is scaled by the row's power of two ``2^e_n`` and
rounded to int64 (ties to even); integer addition is associative, so neither the tile
order nor the TP all-reduce can change the bits. One rounding back at the end. The
scale's bound is ``lp_kernels.core.fixed_point``'s (shared with the torch backend).

- ``matmul_fixed_kernel``: ``C += round(s * (A[:, leaf] @ B[leaf]))`` per leaf, one loop
  over K steps that rounds at each leaf's end (tiles of up to half a vocabulary chunk).
- ``round_into_kernel``: rounds the fp32 products of wider tiles, summed by lp's fp32
  GEMM, into the int64 sum (several tiles per pass).
- ``from_fixed_kernel``: int64 -> float32, with NaN rows.
- ``row_scales_kernel``: each row's ``2^e_n`` (``lp_kernels.core.fixed_point.row_exponents``'
  bound, the same float64 operations in the same order) in one launch.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    gpu_tier,
    launch_opts,
    swizzle_rows,
)
from lp_kernels.backends.triton.gemm import gemm_sources
from lp_kernels.backends.triton.tl_utils import INTERPRET, gemm_step, operand_ptrs, swizzle
from lp_kernels.core.fixed_point import E_MAX, E_MIN, MARGIN
from lp_kernels.core.tiles import DETERMINISTIC_TILE as TILE
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import bias_abs_max, global_abs_max, local_abs_max

# Every column tile is one global vocabulary tile. The fixed-point GEMM keeps an int64
# and an fp32 accumulator per output element (chosen by the tile sweep).
FIXED_GPU = (128, 128, 64)  # BLOCK_M, BLOCK_N, BLOCK_K of matmul_fixed_kernel (2-byte)
FIXED_GPU_4BYTE = (64, 128, 16)  # fp32 inputs (FMA dots; see config.FP32_GEMM)
FIXED_SMALL, FIXED_SMALL_4BYTE = (64, 128, 64), (32, 64, 32)  # less shared memory
FIXED_INTERPRET = (64, 64, TILE)
# Pipeline stages of the fixed-point GEMM for leaves wider than 128 columns (2-byte inputs,
# Hopper-class shared memory: 4 x 32 KiB). Its 128 x 128 blocks (the int64 sum needs the
# registers of a wider one) give each stage half the MMAs of the fp32 GEMM's 128 x 256,
# so more stages cover the same load latency. At 128-column leaves the rounding dominates:
# those take the config's stages.
FIXED_WIDE_STAGES = 4
ELEMENTWISE_BLOCK = 1024  # elements per program of the two elementwise kernels (4 warps)


def fixed_blocks_for(device: torch.device, dtype: torch.dtype) -> tuple[int, int, int]:
    """The pinned ``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the fixed-point GEMM.

    A pipeline stage holds a whole 128-column leaf of A and B: (BLOCK_M + BLOCK_N) x 128
    elements. 4-byte inputs: smaller blocks and two stages (see :func:`matmul_fixed`); GPUs
    with less shared memory than Hopper: half the block (a quarter for fp32), two stages
    (untested)."""
    if device.type == "cpu":
        return FIXED_INTERPRET
    if gpu_tier(device) != "large":
        return FIXED_SMALL if dtype.itemsize <= 2 else FIXED_SMALL_4BYTE
    return FIXED_GPU if dtype.itemsize <= 2 else FIXED_GPU_4BYTE


# ----------------------------------------------------------------------------- kernels


@triton.jit
def round_to_int64(x):
    """Round to the nearest integer, ties to even (as ``torch.round``), as int64.

    One conversion instruction on the GPU (``cvt.rni.s64.f32``); the interpreter has no
    libdevice, so there the same rounding is built from fp32 operations (exact: below
    2^23 ``x + 0.5`` is exact, from 2^23 on ``x`` is an integer already)."""
    if INTERPRET:
        r = tl.floor(x + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where(((r - x) == 0.5) & odd, r - 1.0, r)
        return tl.where(tl.abs(x) >= 8388608.0, x, r).to(tl.int64)
    else:
        return libdevice.llrint(x)


@triton.jit(do_not_specialize=["M", "K", "K_B", "rows"])
def matmul_fixed_kernel(
    a_src,
    b_src,
    c_ptr,
    s_ptr,
    M,
    N,
    K,
    K_A,
    K_B,
    rows,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    LEAF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    ACC: tl.constexpr,
):
    """C (int64) += sum over LEAF-wide K tiles of round(s_m * (A[:, tile] @ B[tile])).

    Each tile's product is an fp32 dot from zero (fixed BLOCK_K order); ``s_m`` is a
    power of two per row, so the scaling is exact; rounding is to nearest, ties to even.
    The last leaf may be cut by K (the end of a shard's real columns).
    ``ACC=False``: C = the sum (C is not read: as into a zeroed C).
    A (d_logits) is read up to K_A columns (padded to 128 with zeros, so its loads
    vectorize alike on every shard), B up to its K_B real rows; with TMA ``a_src`` /
    ``b_src`` are tensor descriptors with those bounds. K > 0.
    """
    i_m, i_n = swizzle(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), rows)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    m_c = m_m[:, None] & m_n[None, :]
    p_c = c_ptr + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :] * stride_cn
    # [BLOCK_M, BLOCK_N] int64
    if ACC:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
        b_acc = tl.load(p_c, mask=m_c, other=0)
    else:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int64)
    b_scale = tl.load(s_ptr + o_m, mask=m_m, other=1.0)
    p_a, p_b = operand_ptrs(
        a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA
    )
    b_zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # One loop over K steps (software-pipelined across leaf ends: the loads of the
    # next leaf are in flight while a leaf is rounded); the same steps in the same
    # order for every leaf, so each leaf's product is its own fp32 dot from zero.
    b_leaf = b_zero
    for k0 in range(0, K, BLOCK_K):
        b_leaf = gemm_step(
            b_leaf,
            a_src,
            b_src,
            p_a,
            p_b,
            k0,
            i_m,
            i_n,
            m_m,
            m_n,
            o_k,
            K_A,
            K_B,
            stride_ak,
            stride_bk,
            BLOCK_M,
            BLOCK_N,
            TMA,
            False,
        )
        if ((k0 + BLOCK_K) % LEAF == 0) | (k0 + BLOCK_K >= K):
            b_acc += round_to_int64(b_leaf * b_scale[:, None])
            b_leaf = b_zero
    tl.store(p_c, b_acc, mask=m_c)


@triton.jit(do_not_specialize=["numel", "stride_f"])
def round_into_kernel(
    f_ptr,
    c_ptr,
    s_ptr,
    numel,
    H,
    stride_f,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    COUNT: tl.constexpr,
):
    """C (int64) += round(s_row * F_0) + ... + round(s_row * F_{COUNT-1}) for the fp32
    products F_i of COUNT tiles, ``stride_f`` elements apart (``ACC=False``: C = ...);
    C and every F_i contiguous [rows, H], flattened. Each F_i is rounded on its own and
    the int64 sum is exact, so how the tiles are batched never changes C."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    b_s = tl.load(s_ptr + offs // H, mask=m, other=1.0)
    if ACC:  # noqa: SIM108  (a constexpr branch)
        b_q = tl.load(c_ptr + offs, mask=m, other=0)
    else:
        b_q = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(COUNT):
        b_f = tl.load(f_ptr + stride_f.to(tl.int64) * i + offs, mask=m, other=0.0)
        b_q += round_to_int64(b_f * b_s)
    tl.store(c_ptr + offs, b_q, mask=m)


def round_into(c, f, scale, *, accumulate: bool) -> None:
    """``c (int64) += round(scale_n * f[0]) + ... + round(scale_n * f[k-1])`` (fp32 ``f``
    of shape ``[k, *c.shape]``, each ``f[i]`` contiguous; ``accumulate=False``: ``c =
    ...``): the products of ``k`` wide tiles, summed by lp's fp32 GEMM, join the sum."""
    if not (c.is_contiguous() and f.dim() == 3 and f.shape[1:] == c.shape and f[0].is_contiguous()):
        raise ValueError("round_into: contiguous c [rows, H] and f [k, rows, H]")
    if c.numel() == 0:
        return
    round_into_kernel[(triton.cdiv(c.numel(), ELEMENTWISE_BLOCK),)](
        f_ptr=f,
        c_ptr=c,
        s_ptr=scale,
        numel=c.numel(),
        H=c.shape[1],
        stride_f=f.stride(0),
        BLOCK=ELEMENTWISE_BLOCK,
        ACC=accumulate,
        COUNT=f.shape[0],
        **compile_opts(c.device),
    )


@triton.jit(do_not_specialize=["numel"])
def from_fixed_kernel(acc_ptr, s_ptr, bad_ptr, out_ptr, numel, H, BLOCK: tl.constexpr):
    """out (float32) = acc * s_row (s = 2^-e, float64; NaN on bad rows): int64 -> float64
    (as torch's ``.double()``), the exact power-of-two scaling, one rounding. Contiguous
    [N, H], flattened."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    row = offs // H
    b_x = tl.load(acc_ptr + offs, mask=m, other=0)
    b_s = tl.load(s_ptr + row, mask=m, other=1.0)
    b_bad = tl.load(bad_ptr + row, mask=m, other=0) != 0
    b_y = tl.where(b_bad, float("nan"), b_x.to(tl.float64) * b_s)
    tl.store(out_ptr + offs, b_y.to(tl.float32), mask=m)


def from_fixed_point(acc, inv_scale, bad, dtype):
    """``acc [N, H]`` int64 in units of ``2^-e_n`` -> ``dtype``, NaN on ``bad`` rows (the
    triton backend's :func:`lp_kernels.core.fixed_point.from_fixed_point`, without float64
    temporaries). ``inv_scale``: float64 ``2^-e_n``; ``bad``: int8 or bool ``[N]``.

    The kernel stops at float32 and torch rounds to the input dtype: Triton may fold the
    two conversions into one from float64 (another rounding than torch's), and its
    interpreter rounds float32 to bfloat16 toward zero."""
    acc = acc.contiguous()
    out = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    if out.numel() == 0:
        return out.to(dtype)
    bad = bad.to(torch.int8) if bad.dtype == torch.bool else bad
    from_fixed_kernel[(triton.cdiv(acc.numel(), ELEMENTWISE_BLOCK),)](
        acc_ptr=acc,
        s_ptr=inv_scale,
        bad_ptr=bad,
        out_ptr=out,
        numel=acc.numel(),
        H=acc.shape[1],
        BLOCK=ELEMENTWISE_BLOCK,
        **compile_opts(acc.device),
    )
    return out.to(dtype)


@triton.jit
def _nonfinite(x):
    """1 where ``x`` is NaN or infinite, else 0 (int32)."""
    return tl.where(tl.abs(x) < float("inf"), 0, 1)


@triton.jit(do_not_specialize=["N", "H", "ignore_index", "gain_bits", "zmax_bits", "margin_bits"])
def row_scales_kernel(
    h_ptr,
    lse_ptr,
    t_ptr,
    glp_ptr,
    gent_ptr,
    glse_ptr,
    wabs_ptr,
    babs_ptr,
    scale_ptr,
    inv_ptr,
    bad_ptr,
    N,
    H,
    stride_hn,
    ignore_index,
    gain_bits,
    zmax_bits,
    margin_bits,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_LP: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_LSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZMAX: tl.constexpr,
    E_LO: tl.constexpr,
    E_HI: tl.constexpr,
):
    """Per row: ``scale = 2^e`` (fp32), ``inv = 2^-e`` (fp64) and ``bad`` (int8) of
    ``lp_kernels.core.fixed_point.row_exponents``, whose float64 operations this repeats one
    by one in the same order (compiled without FMA contraction, as torch evaluates them;
    ``log2`` and ``floor`` are libdevice's, as torch's on CUDA; numpy's under the
    interpreter, which has no libdevice). The float64 constants
    arrive as their int64 bit patterns (Triton passes a float argument as fp32).
    Upstream gradients are read raw (fp32 ``[N]``) and zeroed on ignored rows, whose
    targets (raw ids) equal ``ignore_index``. ``gain`` and ``zmax`` are the logit transform's
    (``LogitTransform.gain`` and ``z_max``; ``ZMAX``: there is one)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # max |h| of each row; NaN when the row holds one (as torch's aminmax)
    b_max = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_nan = tl.zeros([BLOCK_N], dtype=tl.int32)
    p_h = h_ptr + o_n[:, None].to(tl.int64) * stride_hn
    for k0 in range(0, H, BLOCK_H):
        o_h = k0 + tl.arange(0, BLOCK_H)
        m = m_n[:, None] & (o_h < H)[None, :]
        b_h = tl.load(p_h + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        b_max = tl.maximum(b_max, tl.max(tl.abs(b_h), axis=1))
        b_nan = tl.maximum(b_nan, tl.max((b_h != b_h).to(tl.int32), axis=1))
    h_abs = tl.where(b_nan > 0, float("nan"), b_max.to(tl.float64))
    gain = gain_bits.to(tl.int64).to(tl.float64, bitcast=True)
    w_abs = tl.load(wabs_ptr)
    head_bad = _nonfinite(w_abs)
    zmax = H.to(tl.float64) * h_abs * w_abs
    if HAS_BIAS:  # |l| <= H max|h| max|W| + max|b|
        b_abs = tl.load(babs_ptr)
        zmax = zmax + b_abs
        head_bad = head_bad | _nonfinite(b_abs)
    zmax = zmax * gain
    if ZMAX:  # clamp(max=z_max); NaN stays NaN
        z_max = zmax_bits.to(tl.int64).to(tl.float64, bitcast=True)
        zmax = tl.where(zmax > z_max, z_max, zmax)
    b_t = tl.load(t_ptr + o_n, mask=m_n, other=0).to(tl.int64)
    dead = b_t == ignore_index
    g_lp = tl.zeros([BLOCK_N], dtype=tl.float64)
    g_ent = tl.zeros([BLOCK_N], dtype=tl.float64)
    g_lse = tl.zeros([BLOCK_N], dtype=tl.float64)
    if HAS_LP:
        g_lp = tl.where(dead, 0.0, tl.load(glp_ptr + o_n, mask=m_n, other=0.0).to(tl.float64))
    if HAS_ENT:
        g_ent = tl.where(dead, 0.0, tl.load(gent_ptr + o_n, mask=m_n, other=0.0).to(tl.float64))
    if HAS_LSE:
        g_lse = tl.where(dead, 0.0, tl.load(glse_ptr + o_n, mask=m_n, other=0.0).to(tl.float64))
    ent_term = tl.where(g_ent != 0, 2.0 * tl.abs(g_ent) * zmax, 0.0)
    bound = tl.abs(g_lse - g_lp) + tl.abs(g_lp) + ent_term
    margin = margin_bits.to(tl.int64).to(tl.float64, bitcast=True)
    bound = tl.where(bound != 0, margin * bound * gain * w_abs, 0.0)
    lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0)
    live = tl.where(dead, 0, 1)
    bad = _nonfinite(bound) | head_bad | (live & (_nonfinite(h_abs) | _nonfinite(lse)))
    if INTERPRET:
        e = tl.floor(60.0 - tl.log2(bound))
    else:
        e = libdevice.floor(60.0 - libdevice.log2(bound))
    e = tl.where(bound > 0, e, 0.0)
    e = tl.minimum(tl.maximum(e, E_LO), E_HI).to(tl.int32)  # -inf (bound inf) -> E_LO
    # 2^e and 2^-e from their exponent bits: exact
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((1023 - e).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    tl.store(scale_ptr + o_n, scale, mask=m_n)
    tl.store(inv_ptr + o_n, inv, mask=m_n)
    tl.store(bad_ptr + o_n, bad.to(tl.int8), mask=m_n)


class RowScales(NamedTuple):
    """Each row's fixed-point scale: ``scale = 2^e_n`` (fp32, the roundings'), ``inv =
    2^-e_n`` (fp64, the conversion's) and ``bad`` (int8: a NaN row)."""

    scale: torch.Tensor
    inv: torch.Tensor
    bad: torch.Tensor


def _bits(x: float) -> int:
    """The int64 bit pattern of a float64 (how a float64 constant reaches a kernel)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def row_scales(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    b_real: torch.Tensor | None,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grads: tuple,
    p: LogprobParams,
    w_abs: torch.Tensor | None = None,
) -> RowScales:
    """:func:`lp_kernels.core.fixed_point.row_exponents` as :class:`RowScales`, in one launch
    after ``max |W|`` (and ``max |b|``) over the group: the same exponents and NaN rows.

    ``targets``: the raw ids (contiguous); ``grads``: the upstream ``(g_lp, g_ent,
    g_lse)``, fp32 ``[N]`` contiguous or None, read raw (zeroed on ignored rows here);
    ``w_abs``: ``max |W|`` over the group when the caller has it (float64, one element:
    :class:`HeadAbsMax`), else read here."""
    n, h_dim = hidden.shape
    dev = hidden.device
    if w_abs is None:
        w_abs = global_abs_max(w_real, p.tp_group, p.tp_size)  # 0-d: the kernel loads it
    b_abs = None if b_real is None else bias_abs_max(b_real, p.tp_group, p.tp_size)
    scale = torch.empty(n, dtype=torch.float32, device=dev)
    inv = torch.empty(n, dtype=torch.float64, device=dev)
    bad = torch.empty(n, dtype=torch.int8, device=dev)
    if n == 0:
        return RowScales(scale, inv, bad)
    g_lp, g_ent, g_lse = grads
    t = p.transform
    block_n, block_h = (16, 256) if dev.type != "cpu" else (16, 64)
    opts = compile_opts(dev)
    if opts:  # no FMA contraction: torch's float64 operations, one rounding each
        opts = dict(opts, enable_fp_fusion=False)
    row_scales_kernel[(triton.cdiv(n, block_n),)](
        h_ptr=hidden,
        lse_ptr=lse,
        t_ptr=targets,
        glp_ptr=g_lp,
        gent_ptr=g_ent,
        glse_ptr=g_lse,
        wabs_ptr=w_abs,
        babs_ptr=b_abs,
        scale_ptr=scale,
        inv_ptr=inv,
        bad_ptr=bad,
        N=n,
        H=h_dim,
        stride_hn=hidden.stride(0),
        ignore_index=p.ignore_index,
        gain_bits=_bits(t.gain),
        zmax_bits=_bits(0.0 if t.z_max is None else t.z_max),
        margin_bits=_bits(MARGIN),
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        HAS_LP=g_lp is not None,
        HAS_ENT=g_ent is not None,
        HAS_LSE=g_lse is not None,
        HAS_BIAS=b_abs is not None,
        ZMAX=t.z_max is not None,
        E_LO=E_MIN,
        E_HI=E_MAX,
        **opts,
    )
    return RowScales(scale, inv, bad)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


class HeadAbsMax:
    """``max |W|`` of one GPU's head for :func:`row_scales`, read on a side stream.

    The read of the whole head (memory-bound: about 0.3 ms for 1.2 GB on an H200) then
    runs beside the backward's first launches (GEMM-bound) instead of before them;
    :meth:`get` makes the current stream wait for it. On CPU, or with no rows, it is read
    at once. Only for a single rank: under tensor parallelism the MAX all-reduce stays
    where every rank issues it in the same order (``global_abs_max``)."""

    def __init__(self, w_real: torch.Tensor):
        self._done = None
        if w_real.device.type != "cuda" or w_real.numel() == 0:
            self._value = local_abs_max(w_real)
            return
        current = torch.cuda.current_stream(w_real.device)
        side = _SIDE_STREAMS.get(current.device_index)
        if side is None:
            side = _SIDE_STREAMS[current.device_index] = torch.cuda.Stream(w_real.device)
        side.wait_stream(current)  # W and every write to it so far
        with torch.cuda.stream(side):
            self._value = local_abs_max(w_real)
            self._done = torch.cuda.Event()
            self._done.record(side)
        w_real.record_stream(side)  # its memory stays W's until the side stream is done

    def get(self) -> torch.Tensor:
        """The value (float64 ``[1]``), ordered before the current stream's next work."""
        if self._done is not None:
            current = torch.cuda.current_stream(self._value.device)
            current.wait_event(self._done)
            self._value.record_stream(current)  # made on the side stream, read here
            self._done = None
        return self._value


def full_stages(a: torch.Tensor) -> bool:
    """Whether the fixed-point GEMM keeps the config's pipeline depth: 2-byte inputs on a
    GPU with Hopper-class shared memory (elsewhere two stages, see fixed_blocks_for)."""
    return a.device.type == "cuda" and a.element_size() <= 2 and gpu_tier(a.device) == "large"


def matmul_fixed(
    c,
    a,
    b,
    scale,
    k_a: int,
    fixed: tuple[int, int, int],
    cfg: KernelConfig,
    *,
    leaf: int = TILE,
    accumulate: bool = True,
):
    """``c (int64) += fixed-point(a @ b)`` per ``leaf``-column tile; ``a`` has zeros up to
    k_a. ``accumulate=False``: ``c = ...`` (``c`` is not read)."""
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, block_k = fixed
    stages = min(cfg.gemm.num_stages, 2)
    if full_stages(a):
        stages = FIXED_WIDE_STAGES if leaf > TILE else cfg.gemm.num_stages
    mm_cfg = cfg.replace(gemm={"block_m": block_m, "block_k": block_k, "num_stages": stages})
    a_src, b_src, tma = gemm_sources(a, b, m, k_a, False, mm_cfg, block_n)
    blocks_m = triton.cdiv(m, block_m)
    matmul_fixed_kernel[(blocks_m * triton.cdiv(n, block_n),)](
        a_src=a_src,
        b_src=b_src,
        c_ptr=c,
        s_ptr=scale,
        M=m,
        N=n,
        K=k_a,
        K_A=k_a,
        K_B=k,
        rows=swizzle_rows(cfg, blocks_m),
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        LEAF=leaf,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TMA=tma,
        ACC=accumulate,
        **launch_opts(mm_cfg.gemm, a.device),
    )
