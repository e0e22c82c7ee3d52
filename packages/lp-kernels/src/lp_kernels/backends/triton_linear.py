"""The ``triton`` backend of ``linear_logprob``: fused logits and softmax statistics.

The logits never reach memory in the forward; the backward's scratch is one chunk.

Data flow for one rank (V_r = real columns of this shard, S = V_r / V_SPLIT splits)::

    forward   _fwd_stats_kernel, one program per (row block, split):
                for each BLOCK_V tile of the split:  z = (h W^T) / T  on chip (fp32 acc)
                online (m, s, a, t) per row  ->  stats [S, N, 4]   (logits never stored)
              all-gather over tp_group -> [P * S, N, 4]
              _merge_kernel: merge the P * S partials of each row in order -> lse, E, t, entropy
    backward  for each vocabulary chunk of VOCAB_CHUNK columns, for each token chunk of
              TOKEN_CHUNK rows (both fixed):
                _dlogits_kernel: recompute z tile by tile, d l = d z / T, stored in the
                    input dtype -> scratch [TOKEN_CHUNK, VOCAB_CHUNK]   (bounded, any N)
                grad_W[chunk] = d l^T @ h          cuBLAS: one GEMM when N fits one token
                    chunk, else fp32 accumulation over token chunks ([VOCAB_CHUNK, H])
                grad_h (fp32) += d l @ W[chunk]    _matmul_acc_kernel, each program owns its tile
              (small N: a group of chunks per launch, each chunk still summed apart and
              added in order: chunk_group, MULTI)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

Launch and loads (``TileConfig.group`` / ``.tma``; neither changes a result). Every kernel
runs on a 1-D grid whose programs take their tiles ``group`` row blocks at a time, rows
fastest (``_grouped``), so the programs resident together share hidden rows and weight
tiles in L2. GEMM operands are read through tensor descriptors (TMA on Hopper; zeros out
of bounds) when :func:`tma_ok` allows, else through masked pointer loads; both feed the
same ``tl.dot`` sequence, and tests check the bits are equal.

Numerics. Every dot accumulates in fp32 (``input_precision="ieee"`` for fp32 inputs,
never TF32). The partial statistics follow ``lp_kernels._stats``: exponents relative
to a running maximum seeded with -inf, entropy assembled from ``z - m``. The merge
visits partials in (rank, split) order in one program per row block.

Determinism. No atomics: every output element is written by exactly one program.
Triton compiles a separate variant of a kernel for integer arguments that are multiples
of 16, and another variant may contract or reorder the floating-point arithmetic
differently (observed on H200: TP=1 and TP=2 entropies differing in the last bit). So
sizes that vary with N or with the shard are excluded from that specialization
(``do_not_specialize``) where they only bound rows (per-row masks cost nothing), and where
a size bounds a contiguous dimension, whose loads and stores vectorize only when it is a
multiple of 16, the kernels take it padded to a multiple of 128 (``K_PAD``, ``v_store``:
the d_logits buffer holds exact zeros there) and the true bound separately.
Tile sizes, ``V_SPLIT`` and ``VOCAB_CHUNK`` are pinned constants (never chosen from
N), and each row's arithmetic involves only that row, so a row's outputs and its
grad_hidden row do not depend on N, on the other rows or on ``chunk_size``. Two launch
choices do follow N, because neither changes that arithmetic: the GEMM's output tile width
(:func:`mm_block_n`) and the vocabulary chunks per backward launch (:func:`chunk_group`).

On CPU the kernels run under ``TRITON_INTERPRET=1`` (tests). There the ``INTERPRET``
flag swaps ``tl.dot`` for an fp32 broadcast-multiply-and-sum: the interpreter computes
bf16/fp16 dots wrongly, and its fp32 dot is a BLAS call whose result for a row depends
on the row's position in the block. Widening is exact (the products fit in fp32).
The GPU path keeps half-precision tensor-core dots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lp_kernels._compile import backend_backward
from lp_kernels._dist import RowSums, gather_stats
from lp_kernels._matmul import addmm_f32_, mm_f32, scratch
from lp_kernels._stats import (
    N_STATS,
    lse_coefficient,
    masked_outputs,
    masked_upstream,
    target_columns,
)
from lp_kernels._types import LogprobParams


@dataclass(frozen=True)
class TileConfig:
    """Pinned launch configuration (part of the numerics: another tile is another order)."""

    block_n: int
    block_v: int
    block_h: int
    v_split: int
    vocab_chunk: int
    token_chunk: int
    mm_block_m: int
    mm_block_n: int
    mm_block_k: int
    num_warps: int
    num_stages: int
    group: int = 8
    """Row blocks per group of the launch order (L2 reuse; <= 0: all rows of the grid).
    Only the order in which tiles run: it never changes a result."""
    tma: bool = True
    """Load the GEMM operands with tensor descriptors (Hopper's bulk tensor copy) where
    :func:`tma_ok` allows; the same products and summation order as pointer loads."""
    warp_specialize: bool = False
    """Ask Triton to warp-specialize the forward's loop over vocabulary tiles
    (experimental; the same arithmetic)."""
    logit_warps: int | None = None
    """Warps of the two logit-tile kernels (forward statistics, d_logits); None: num_warps.
    Experimental (sweep variant ``bv128-w4``): 4 warps on 128 x 128 tiles fit two programs
    per SM, so that one's softmax epilogue can overlap the other's MMAs."""


# Chosen by benchmarks/sweep_tiles.py on H200 (docs/benchmarks.md, session 3).
GPU_CONFIG = TileConfig(
    block_n=128, block_v=256, block_h=64, v_split=8192, vocab_chunk=8192, token_chunk=8192,
    mm_block_m=128, mm_block_n=256, mm_block_k=64, num_warps=8, num_stages=3,
    group=8, tma=True,
)  # fmt: skip
# Large blocks under the interpreter: its cost scales with the number of block operations.
INTERPRET_CONFIG = TileConfig(
    block_n=64, block_v=256, block_h=64, v_split=1024, vocab_chunk=2048, token_chunk=128,
    mm_block_m=64, mm_block_n=64, mm_block_k=256, num_warps=4, num_stages=1,
    group=2, tma=True,
)  # fmt: skip


IGNORED = -2  # target code of an ignored row in the kernels (see target_codes)


# GPUs with less shared memory per block than Hopper's 227 KiB (A100: 163 KiB; Ada and
# consumer Ampere: 99 KiB) take the 128 x 128 tiles of earlier sessions, without tensor
# descriptors; below 160 KiB with two pipeline stages. Untested there: lp's GPU runs are
# on H200 (docs/benchmarks.md).
LARGE_SMEM = 200 << 10
MID_SMEM = 160 << 10
_SMEM: dict[int, int] = {}
_SMS: dict[int, int] = {}


def smem_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (cached per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        if not smem:  # by compute capability (H100/H200: 227 KiB, A100: 163 KiB)
            smem = (227 << 10) if props.major >= 9 else (163 << 10)
        _SMEM[index] = int(smem)
    return _SMEM[index]


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached per device); None elsewhere (the
    interpreter has no waves of programs)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def gpu_tier(device: torch.device) -> str:
    """ "large" (Hopper-class shared memory: the pinned GPU_CONFIG), "mid" or "small"."""
    smem = smem_per_block(device)
    return "large" if smem >= LARGE_SMEM else "mid" if smem >= MID_SMEM else "small"


def config_for(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """The pinned config for a device and input dtype: chosen by the device's shared
    memory and the dtype, never by a size. 4-byte inputs (exact fp32 dots: FMAs, not
    tensor cores) take :data:`FP32_TILES`."""
    if device.type == "cpu":
        return INTERPRET_CONFIG
    cfg = GPU_CONFIG
    tier = gpu_tier(device)
    if tier != "large":
        cfg = dataclasses.replace(
            cfg, block_v=128, mm_block_n=128, tma=False, num_stages=3 if tier == "mid" else 2
        )
    if dtype.itemsize > 2:
        cfg = dataclasses.replace(cfg, **FP32_TILES)
    return cfg


# 4-byte inputs. ``input_precision="ieee"`` makes Triton compile their dots to FMAs, where a
# 128 x 256 fp32 tile with K steps of 32 needs far more than 255 registers: ptxas then
# settles on 32 registers and a 12 KB stack frame per thread (session 8, `lp_testing.aot`,
# Triton 3.6 and 3.9). 64 x 128 tiles with K steps of 16 compile to 195-248 registers and
# no stack frame.
FP32_TILES = {
    "block_n": 64, "block_v": 128, "block_h": 16,
    "mm_block_m": 64, "mm_block_n": 128, "mm_block_k": 16,
}  # fmt: skip


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D tensor can back a tensor descriptor: unit last stride, 16-byte
    aligned base and row stride, no empty dimension."""
    for t in tensors:
        size = t.element_size()
        if t.dim() != 2 or t.stride(1) != 1 or 0 in t.shape:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * size) % 16:
            return False
    return True


def _desc(t: torch.Tensor, rows: int, cols: int, block: tuple[int, int]):
    """A tensor descriptor over ``rows x cols`` elements from ``t``'s base with its row
    stride (it may reach past ``t``'s view into the same buffer: padded columns)."""
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], list(block))


def _group(cfg: TileConfig, blocks_m: int) -> int:
    return blocks_m if cfg.group <= 0 else min(cfg.group, max(blocks_m, 1))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _grouped(pid, blocks_m, blocks_n, group):
    """Tile (i_m, i_n) of program ``pid``: ``group`` row blocks at a time, rows fastest, so
    that the programs running together share their operands in L2 (order only)."""
    width = group * blocks_n
    first_m = (pid // width) * group
    size_m = tl.minimum(blocks_m - first_m, group)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _logits_tile(
    h_src, w_src, row0, col0, m_n, m_v, H, stride_hn, stride_hh, stride_wv, stride_wh,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N, BLOCK_V]`` tile of ``h W^T`` for rows ``row0 +`` and columns ``col0 +``.

    ``h_src`` / ``w_src`` are tensor descriptors (TMA: out-of-bounds reads are zeros) or
    base pointers (masked loads, zeros likewise): the same products in the same order.
    """
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
    return b_acc


@triton.jit(do_not_specialize=["N", "V_real", "splits", "group"])
def _fwd_stats_kernel(
    h_src, w_src, t_ptr, stats_ptr,
    N, H, V_real, inv_t, splits, group,
    stride_hn, stride_hh, stride_wv, stride_wh,
    V_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr, EVEN_H: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """Per (row, split): m = max z, s = sum e^(z-m), a = sum e^(z-m)(z-m), t = z[target]."""
    i_n, i_s = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, group)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_t = tl.load(t_ptr + o_n, mask=m_n, other=-1)  # target column in this shard, or -1
    b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
    v_begin = i_s * V_SPLIT
    v_end = tl.minimum(v_begin + V_SPLIT, V_real)
    for v0 in tl.range(v_begin, v_end, BLOCK_V, warp_specialize=WS):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < v_end
        b_z = _logits_tile(
            h_src, w_src, i_n * BLOCK_N, v0, m_n, m_v, H, stride_hn, stride_hh, stride_wv,
            stride_wh, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, INTERPRET, PRECISION, TMA,
        )  # fmt: skip
        b_z = tl.where(m_v[None, :], b_z * inv_t, float("-inf"))
        # masked: a split that is not a multiple of BLOCK_V (deterministic_tile) ends
        # inside a tile whose masked columns belong to the next split
        m_t = (o_v[None, :] == b_t[:, None]) & m_v[None, :]
        b_zt += tl.sum(tl.where(m_t, b_z, 0.0), axis=1)
        # online update; the first tile turns m from -inf into a finite maximum
        b_mn = tl.maximum(b_m, tl.max(b_z, axis=1))
        b_alpha = tl.exp(b_m - b_mn)
        b_d = b_z - b_mn[:, None]
        b_e = tl.exp(b_d)
        if ENTROPY:
            b_shift = tl.where(b_s > 0, b_m - b_mn, 0.0)
            b_ed = tl.where(m_v[None, :], b_e * b_d, 0.0)
            b_a = b_alpha * (b_a + b_shift * b_s) + tl.sum(b_ed, axis=1)
        b_s = b_s * b_alpha + tl.sum(b_e, axis=1)
        b_m = b_mn
    p_out = stats_ptr + (i_s.to(tl.int64) * N + o_n) * 4
    tl.store(p_out + 0, b_m, mask=m_n)
    tl.store(p_out + 1, b_s, mask=m_n)
    tl.store(p_out + 2, b_a, mask=m_n)
    tl.store(p_out + 3, b_zt, mask=m_n)


@triton.jit(do_not_specialize=["K", "N"])
def _merge_kernel(
    stats_ptr, lse_ptr, mean_ptr, zt_ptr, ent_ptr, K, N,
    BLOCK_N: tl.constexpr, ENTROPY: tl.constexpr,
):  # fmt: skip
    """Merge K partials per row in order (see lp_kernels._stats for the algebra)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_big_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for k in range(0, K):
        b_mk = tl.load(stats_ptr + (k * N + o_n).to(tl.int64) * 4, mask=m_n, other=0.0)
        b_big_m = tl.maximum(b_big_m, b_mk)
    b_big_s = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_big_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, K):
        p = stats_ptr + (k * N + o_n).to(tl.int64) * 4
        b_mk = tl.load(p + 0, mask=m_n, other=0.0)
        b_sk = tl.load(p + 1, mask=m_n, other=1.0)
        b_w = tl.exp(b_mk - b_big_m)
        b_big_s += b_w * b_sk
        if ENTROPY:
            b_ak = tl.load(p + 2, mask=m_n, other=0.0)
            b_shift = tl.where(b_w > 0, b_mk - b_big_m, 0.0)
            b_big_b += b_w * (b_ak + b_shift * b_sk)
        b_zt += tl.load(p + 3, mask=m_n, other=0.0)
    b_log_s = tl.log(b_big_s)
    tl.store(lse_ptr + o_n, b_big_m + b_log_s, mask=m_n)
    tl.store(zt_ptr + o_n, b_zt, mask=m_n)
    if ENTROPY:
        b_ms = b_big_b / b_big_s
        tl.store(mean_ptr + o_n, b_big_m + b_ms, mask=m_n)
        tl.store(ent_ptr + o_n, b_log_s - b_ms, mask=m_n)


@triton.jit(do_not_specialize=["N", "v_begin", "v_count", "group"])
def _dlogits_kernel(
    h_src, w_src, t_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, c0_ptr, dl_ptr,
    N, H, v_begin, v_count, v_store, inv_t, group,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_dn,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ENTROPY: tl.constexpr, HAS_LP: tl.constexpr, EVEN_H: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, IGNORED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """d l = (p (c0 - g_ent (z - E)) + g_lp [col == target]) / T for columns [v_begin, +v_count).

    Columns [v_count, v_store) of the output get exact zeros (v_store: v_count padded to 128).
    """
    i_n, i_v = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_store, BLOCK_V), group)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column within the chunk
    m_n = o_n < N
    m_v = o_c < v_count
    b_z = _logits_tile(
        h_src, w_src, i_n * BLOCK_N, v_begin + i_v * BLOCK_V, m_n, m_v, H, stride_hn,
        stride_hh, stride_wv, stride_wh, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, INTERPRET,
        PRECISION, TMA,
    )  # fmt: skip
    # d z / T = p (c0 - g_ent (z / T - E)) / T with the 1/T folded into per-row factors
    b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0)
    b_c0 = tl.load(c0_ptr + o_n, mask=m_n, other=0.0) * inv_t
    b_zs = b_z * inv_t
    b_p = tl.exp(b_zs - b_lse[:, None])
    if ENTROPY:
        b_mean = tl.load(mean_ptr + o_n, mask=m_n, other=0.0)
        b_gent = tl.load(gent_ptr + o_n, mask=m_n, other=0.0) * inv_t
        b_dz = b_p * (b_c0[:, None] - b_gent[:, None] * (b_zs - b_mean[:, None]))
    else:
        b_dz = b_p * b_c0[:, None]
    b_t = tl.load(t_ptr + o_n, mask=m_n, other=-1)
    if HAS_LP:  # + g_lp / T in the target's column, in tiles that hold some row's target
        b_trel = b_t - (v_begin + i_v * BLOCK_V)
        if tl.max(((b_trel >= 0) & (b_trel < BLOCK_V)).to(tl.int32), axis=0) > 0:
            b_glp = tl.load(glp_ptr + o_n, mask=m_n, other=0.0) * inv_t
            m_hit = tl.arange(0, BLOCK_V)[None, :] == b_trel[:, None]
            b_dz = tl.where(m_hit, b_dz + b_glp[:, None], b_dz)
    # ignored rows (code IGNORED) and rows past N get exact zeros, even where their hidden
    # is not finite, as do columns past v_count: a select only in tiles that have them
    m_live = m_n & (b_t != IGNORED)
    if (tl.min(m_live.to(tl.int32), axis=0) == 0) | ((i_v + 1) * BLOCK_V > v_count):
        b_dz = tl.where(m_live[:, None] & m_v[None, :], b_dz, 0.0)
    p_d = dl_ptr + o_n[:, None].to(tl.int64) * stride_dn + o_c[None, :]
    tl.store(p_d, b_dz.to(dl_ptr.dtype.element_ty), mask=m_n[:, None] & (o_c < v_store)[None, :])


@triton.jit
def _gemm_step(
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
def _operand_ptrs(
    a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA: tl.constexpr
):
    """``(p_a, p_b)`` for :func:`_gemm_step`: the pointer blocks of A's rows ``o_m`` and
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


def _matmul_acc_body(
    a_src, b_src, c_ptr, M, M_A, N, K, K_A, K_B, group, chunk_k,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr,
    ACC: tl.constexpr, C_TMA: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    """C[:M] (fp32) = C + A @ B (``ACC``; else C = A @ B, without reading C). One program
    per C tile: A @ B summed over K in a fixed order from +0.0, then C added once. No
    atomics. (Before session 8 the sum started from C; the bits of a multi-chunk
    grad_hidden differ from then in the last place.)

    ``MULTI``: K is several chunks of ``chunk_k`` columns, each summed from +0.0 and added
    to C in order: exactly the arithmetic of one call per chunk, in one launch (the
    backward's vocabulary chunks at small N; see ``chunk_group``). The running C tile then
    sits in registers beside the chunk's sum, which the narrow tile affords.

    A's rows are bounded by M_A and its columns by K_A, B's rows by K_B; the loop runs to
    K, which may pass K_B over columns where A holds exact zeros. The bound of A's
    contiguous dimension comes padded to a multiple of 128 so that every call vectorizes
    alike; see the module docstring. With TMA, ``a_src`` / ``b_src`` are tensor
    descriptors with those bounds (``A_T``: ``a_src`` describes A^T, contiguous along M);
    with C_TMA (only with ACC), ``c_ptr`` is one over C's ``M x N`` elements.
    """
    i_m, i_n = _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), group)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_am = o_m < M_A
    m_n = o_n < N
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    p_a, p_b = _operand_ptrs(
        a_src, b_src, o_m, o_n, o_k, stride_am, stride_ak, stride_bk, stride_bn, TMA
    )
    k_end = K
    if MULTI:
        k_end = tl.minimum(chunk_k, K)  # the first chunk
    for k0 in range(0, k_end, BLOCK_K):
        b_acc = _gemm_step(
            b_acc, a_src, b_src, p_a, p_b, k0, i_m, i_n, m_am, m_n, o_k, K_A, K_B,
            stride_ak, stride_bk, BLOCK_M, BLOCK_N, INTERPRET, PRECISION, TMA, A_T,
        )  # fmt: skip
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
                b_part = _gemm_step(
                    b_part, a_src, b_src, p_a, p_b, k0, i_m, i_n, m_am, m_n, o_k, K_A, K_B,
                    stride_ak, stride_bk, BLOCK_M, BLOCK_N, INTERPRET, PRECISION, TMA, A_T,
                )  # fmt: skip
            b_acc += b_part
    if C_TMA:
        c_ptr.store([i_m * BLOCK_M, i_n * BLOCK_N], b_acc)
    else:
        p_c = c_ptr + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :] * stride_cn
        tl.store(p_c, b_acc, mask=m_m[:, None] & m_n[None, :])


# One body, two specializations. Sizes that vary with N or with the shard are not
# specialized; the padded bound of A's contiguous dimension is (it is always a multiple
# of 128, so every call vectorizes alike).
# A = d_logits [rows, cols] (grad_hidden): contiguous along K, bounded by K_A (padded).
_matmul_acc_kernel = triton.jit(do_not_specialize=["M", "M_A", "K", "K_B", "group", "chunk_k"])(
    _matmul_acc_body
)
# A = d_logits^T [cols, rows] (grad_weight): contiguous along M, bounded by M_A (padded).
_matmul_acc_t_kernel = triton.jit(do_not_specialize=["M", "K", "K_A", "K_B", "group", "chunk_k"])(
    _matmul_acc_body
)


# ----------------------------------------------------------------------------- launchers


def _flags(hidden: torch.Tensor, cfg: TileConfig) -> dict:
    return {
        "EVEN_H": hidden.shape[1] % cfg.block_h == 0,
        "INTERPRET": hidden.device.type == "cpu",
        "PRECISION": "ieee",
    }


# Multiply-adds contract to FMAs in every kernel, as Triton has always compiled them by
# default; pinned because Triton 3.9 warns that 3.10 turns that default off, which would
# change the bits (and the speed) of every kernel with a Triton upgrade.
FP_FUSION = True

# The GEMMs' C tile through a tensor descriptor where it allows one (see _matmul_acc_body);
# False: pointer loads and stores (the same arithmetic). A switch for benchmarks.
C_TMA = True


def _compile_opts(device: torch.device) -> dict:
    """Compile options every GPU launch pins (none under the interpreter)."""
    return {} if device.type == "cpu" else {"enable_fp_fusion": FP_FUSION}


def _launch_opts(cfg: TileConfig, device: torch.device, *, logits: bool = False) -> dict:
    if device.type == "cpu":
        return {}
    warps = cfg.logit_warps if logits and cfg.logit_warps else cfg.num_warps
    return {"num_warps": warps, "num_stages": cfg.num_stages, **_compile_opts(device)}


def forward_stats(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    t_col: torch.Tensor,
    p: LogprobParams,
    cfg: TileConfig,
) -> torch.Tensor:
    """``[S, N, 4]`` fp32 partial statistics of this shard's splits.

    S is set by the largest shard of the group, so that every rank exchanges the same
    number of bytes; splits past this shard's end report ``m = -inf, s = a = t = 0``.
    """
    n, h_dim = hidden.shape
    v_real = w_real.shape[0]
    splits = triton.cdiv(max(p.max_v_local, v_real), cfg.v_split)
    stats = scratch.empty((splits, n, N_STATS), dtype=torch.float32, device=hidden.device)
    if n == 0 or splits == 0:
        return stats
    blocks_n = triton.cdiv(n, cfg.block_n)
    h_src, w_src, tma = _logits_sources(hidden, w_real, cfg)
    _fwd_stats_kernel[(blocks_n * splits,)](
        h_src, w_src, t_col, stats,
        n, h_dim, v_real, p.inv_temperature, splits, _group(cfg, blocks_n),
        hidden.stride(0), hidden.stride(1), w_real.stride(0), w_real.stride(1),
        V_SPLIT=cfg.v_split, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        ENTROPY=p.return_entropy, TMA=tma, WS=cfg.warp_specialize and tma,
        **_flags(hidden, cfg),
        **_launch_opts(cfg, hidden.device, logits=True),
    )  # fmt: skip
    return stats


def _logits_sources(hidden: torch.Tensor, w_real: torch.Tensor, cfg: TileConfig):
    """``(h_src, w_src, tma)``: tensor descriptors over hidden and the shard's real rows when
    the config asks for them and both tensors allow them, else the tensors themselves.

    Which one runs depends on H, the dtype and the tensors' alignment, never on N or on
    the shard's width; both compute the same products in the same order.
    """
    if cfg.tma and w_real.shape[0] > 0 and tma_ok(hidden, w_real):
        n, h_dim = hidden.shape
        return (
            _desc(hidden, n, h_dim, (cfg.block_n, cfg.block_h)),
            _desc(w_real, w_real.shape[0], h_dim, (cfg.block_v, cfg.block_h)),
            True,
        )
    return hidden, w_real, False


def merge(stats: torch.Tensor, *, entropy: bool):
    """Merge ``[K, N, 4]`` partials per row in order -> (lse, E or None, t, entropy or None)."""
    k, n, _ = stats.shape
    dev = stats.device
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    zt = torch.empty(n, dtype=torch.float32, device=dev)
    mean = torch.empty(n, dtype=torch.float32, device=dev) if entropy else None
    ent = torch.empty(n, dtype=torch.float32, device=dev) if entropy else None
    if n == 0:
        return lse, mean, zt, ent
    block = 128 if dev.type != "cpu" else 256
    _merge_kernel[(triton.cdiv(n, block),)](
        stats.contiguous(), lse, mean if entropy else lse, zt, ent if entropy else lse, k, n,
        BLOCK_N=block, ENTROPY=entropy, **_compile_opts(dev),
    )  # fmt: skip
    return lse, mean, zt, ent


def pad128(x: int) -> int:
    """``x`` rounded up to a multiple of 128 (a bound that specializes alike everywhere)."""
    return triton.cdiv(x, 128) * 128


def _dlogits(hidden, w_real, t_col, lse, mean, g_lp, g_ent, c0, out, v_begin, v_count, p, cfg):
    """d_logits of columns [v_begin, +v_count) into ``out``; its columns past v_count get
    exact zeros (callers pass ``pad_cols(v_count, buffer)`` columns)."""
    n, h_dim = hidden.shape
    v_store = out.shape[1]
    blocks_n = triton.cdiv(n, cfg.block_n)
    h_src, w_src, tma = _logits_sources(hidden, w_real, cfg)
    _dlogits_kernel[(blocks_n * triton.cdiv(v_store, cfg.block_v),)](
        h_src, w_src, t_col, lse, mean if mean is not None else lse,
        g_lp if g_lp is not None else c0, g_ent if g_ent is not None else c0, c0, out,
        n, h_dim, v_begin, v_count, v_store, p.inv_temperature, _group(cfg, blocks_n),
        hidden.stride(0), hidden.stride(1), w_real.stride(0), w_real.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        ENTROPY=g_ent is not None, HAS_LP=g_lp is not None, IGNORED=IGNORED, TMA=tma,
        **_flags(hidden, cfg), **_launch_opts(cfg, hidden.device, logits=True),
    )  # fmt: skip


# A 128 x 128 program of the GEMM costs about this fraction of a 128 x 256 one's time
# (H200, session 14: 2-4 % slower steps with it at S2 and S4, where both grids fill the GPU
# many times over, i.e. 10-20 % slower per GEMM).
NARROW_TILE_COST = 0.575


def narrow_block_n(cfg: TileConfig) -> int:
    """The GEMM's narrow output tile width: half the pinned 256, else the pinned width (the
    configs of smaller GPUs, 4-byte inputs and the interpreter are narrow already)."""
    return cfg.mm_block_n // 2 if cfg.mm_block_n >= 256 else cfg.mm_block_n


def mm_block_n(cfg: TileConfig, m: int, n: int, device: torch.device) -> int:
    """Output tile width of lp's GEMM ``C [m, n] (+)= A @ B``: the config's ``mm_block_n``, or
    half of it where the pinned grid would leave much of the GPU idle in its last wave
    (grad_hidden at about a thousand tokens and H = 2048 has 64 tiles of 128 x 256 for 132
    SMs: half the GPU idles; the step's GPU time, measured in a CUDA graph, drops by 4-7 %
    at N 512-1024 and 2 % at N 1152, H 4096; docs/benchmarks.md, session 14).

    Unlike every other tile of this backend, this one follows the sizes, because it does not
    change the bits: each element of C gets the same MMAs in the same K order in a 128- or
    a 256-wide tile (checked bitwise on H200, both modes, and tested: test_gpu.py). So a
    row's grad_hidden stays the same whatever N, and batch invariance holds.
    """
    wide, narrow = cfg.mm_block_n, narrow_block_n(cfg)
    sms = sm_count(device)
    if sms is None or narrow == wide:
        return wide
    rows = triton.cdiv(m, cfg.mm_block_m)
    waves_wide = triton.cdiv(rows * triton.cdiv(n, wide), sms)
    waves_narrow = triton.cdiv(rows * triton.cdiv(n, narrow), sms)
    return narrow if waves_narrow * NARROW_TILE_COST < waves_wide else wide


def _matmul_acc_(
    c: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cfg: TileConfig,
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
    that of one call per chunk in order (``c += a_0 @ b_0``, then ``c += a_1 @ b_1``, ..),
    in one launch, on the narrow output tile (the same bits: :func:`mm_block_n`). Where
    tensor descriptors do not apply it makes those calls one by one instead: the pointer
    path with two fp32 tiles live spills (1.2 KB per thread on sm_90, ``lp_testing.aot``)."""
    m, k = a.shape
    n = b.shape[1]
    a_t = m_a is not None
    kernel = _matmul_acc_t_kernel if a_t else _matmul_acc_kernel
    m_a = m if m_a is None else m_a
    k_a = k if k_a is None else k_a
    blocks_m = triton.cdiv(m, cfg.mm_block_m)
    multi = chunk_k is not None and max(k, k_a) > chunk_k
    # MULTI holds two fp32 tiles (C's and the chunk's): the narrow one
    block_n = narrow_block_n(cfg) if multi else mm_block_n(cfg, m, n, a.device)
    a_src, b_src, tma = gemm_sources(a, b, m_a, k_a, a_t, cfg, cfg.mm_block_m, block_n)
    if multi and not tma:
        for k0 in range(0, max(k, k_a), chunk_k):
            _matmul_acc_(
                c, a[:, k0 : k0 + chunk_k], b[k0 : k0 + chunk_k], cfg,
                k_a=min(k_a - k0, chunk_k), accumulate=accumulate or k0 > 0,
            )  # fmt: skip
        return
    c_tma = tma and C_TMA and accumulate and tma_ok(c)
    c_arg = _desc(c, m, n, (cfg.mm_block_m, block_n)) if c_tma else c
    kernel[(blocks_m * triton.cdiv(n, block_n),)](
        a_src, b_src, c_arg, m, m_a, n, max(k, k_a), k_a, k, _group(cfg, blocks_m),
        chunk_k if multi else max(k, k_a),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=cfg.mm_block_m, BLOCK_N=block_n, BLOCK_K=cfg.mm_block_k,
        INTERPRET=a.device.type == "cpu", PRECISION="ieee", TMA=tma, A_T=a_t, ACC=accumulate,
        C_TMA=c_tma, MULTI=multi,
        **_launch_opts(cfg, a.device),
    )  # fmt: skip


def gemm_sources(a, b, m_a: int, k_a: int, a_t: bool, cfg: TileConfig, block_m, block_n):
    """``(a_src, b_src, tma)`` for ``a @ b`` with ``a`` bounded by ``m_a x k_a`` (padded, see
    :func:`_matmul_acc_`): tensor descriptors when the config asks for them and both
    allow them, else the tensors. ``a_t``: ``a`` is the transpose of a row-major buffer."""
    a_rm = a.T if a_t else a  # the row-major buffer behind a
    if not (cfg.tma and tma_ok(a_rm, b)):
        return a, b, False
    k_b, n = b.shape
    if a_t:
        a_src = _desc(a_rm, a.shape[1], m_a, (cfg.mm_block_k, block_m))
    else:
        a_src = _desc(a_rm, m_a, k_a, (block_m, cfg.mm_block_k))
    return a_src, _desc(b, k_b, n, (cfg.mm_block_k, block_n)), True


def kernel_inputs(hidden, weight, targets, p: LogprobParams, extra: int = 0):
    """``(hidden, w_real, t_col, ignored)`` as the kernels take them: ``hidden`` with a unit
    last stride, this shard's real weight rows, the per-row target codes (see
    :func:`target_codes`; over ``extra`` more columns past the real rows: a halo) and the
    ignored-row mask."""
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    v_real = p.local_real_columns(weight.shape[0])
    t_local, in_shard, ignored = target_columns(
        targets, p.ignore_index, p.vocab_start, v_real + extra
    )
    return hidden, weight[:v_real], target_codes(t_local, in_shard, ignored), ignored


def buffer_width(v_real: int, cfg: TileConfig) -> int:
    """Columns of the d_logits buffer: a multiple of 128, so its row stride specializes alike
    on every shard (the kernels' code must not depend on the shard width)."""
    return min(cfg.vocab_chunk, pad128(v_real))


def pad_cols(v_count: int, dl_buf: torch.Tensor) -> int:
    """The padded column bound of a d_logits chunk (what _dlogits zero-fills)."""
    return min(pad128(v_count), dl_buf.shape[1])


def target_codes(t_local: torch.Tensor, in_shard: torch.Tensor, ignored: torch.Tensor):
    """Per row: the target's column in this shard, -1 if elsewhere, IGNORED (-2) if ignored."""
    return torch.where(in_shard, t_local, torch.where(ignored, IGNORED, -1))


def dlogits_blocks(
    hidden, w_real, t_col, lse, mean_z, grads, p: LogprobParams, cfg: TileConfig, pieces=None
):
    """The backward's d_logits, one bounded block at a time (shared by both triton modes).

    Yields ``(v_begin, v_count, blocks)`` per vocabulary chunk of ``cfg.vocab_chunk``
    columns (or per piece of ``pieces = (spans, width)``: ``(v_begin, v_count)`` spans in
    order, each at most ``width`` columns, a multiple of 128 that is then the buffer's
    width). ``blocks`` yields ``(r0, r1, dl, cols)`` per token chunk of
    ``cfg.token_chunk`` rows: ``dl [r1 - r0, v_count]`` (input dtype) is ``d loss / d
    logits`` of those rows and columns, in one reused buffer that holds exact zeros in
    columns ``[v_count, cols)``. ``grads`` are the masked upstream gradients
    ``(g_lp, g_ent, g_lse)``.
    """
    n = hidden.shape[0]
    v_real = w_real.shape[0]
    if n == 0 or v_real == 0:
        return
    g_lp, g_ent, g_lse = grads
    c0 = lse_coefficient(g_lp, g_lse, n, hidden.device)
    rows = min(cfg.token_chunk, n)
    if pieces is None:
        spans = [
            (v_begin, min(cfg.vocab_chunk, v_real - v_begin))
            for v_begin in range(0, v_real, cfg.vocab_chunk)
        ]
        width = buffer_width(v_real, cfg)
    else:
        spans, width = pieces
    dl_buf = scratch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)

    def blocks(v_begin: int, v_count: int):
        cols = pad_cols(v_count, dl_buf)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)

            def cut(x, r0=r0, r1=r1):
                return None if x is None else x[r0:r1]

            _dlogits(
                hidden[r0:r1], w_real, t_col[r0:r1], lse[r0:r1], cut(mean_z),
                cut(g_lp), cut(g_ent), c0[r0:r1], dl_buf[: r1 - r0, :cols],
                v_begin, v_count, p, cfg,
            )  # fmt: skip
            yield r0, r1, dl_buf[: r1 - r0, :v_count], cols

    for v_begin, v_count in spans:
        yield v_begin, v_count, blocks(v_begin, v_count)


def chunk_group(n: int, h_dim: int, v_real: int, cfg: TileConfig, device) -> int:
    """Vocabulary chunks the default backward handles per launch: 1, or, when its N rows
    fill at most half a token chunk and grad_hidden's GEMM takes the narrow tile anyway
    (:func:`mm_block_n`), as many chunks as a full token chunk's d_logits buffer holds
    (``token_chunk // N``; the same scratch bound), at most the shard's.

    At a thousand tokens the host, issuing three to four launches per 8192-column chunk,
    set the step's pace: 15 ms per step at H 2048 and V 248k, where the GPU needs 8 ms
    (docs/benchmarks.md, session 14). A group makes one d_logits launch, one grad_W GEMM
    and one grad_hidden GEMM whose ``chunk_k`` keeps each chunk's sum and the order of
    the additions: a row's bits are those of one launch per chunk, whatever N. The grouped
    GEMM needs the narrow tile; where the pinned one fills the GPU (N 2048 at H 2048, N
    4096 at H 4096) grouping measured 3-6 % slower, the GPU being the bottleneck there.
    """
    if n == 0 or 2 * n > cfg.token_chunk:
        return 1
    if mm_block_n(cfg, n, h_dim, device) != narrow_block_n(cfg):
        return 1
    return max(1, min(cfg.token_chunk // n, triton.cdiv(v_real, cfg.vocab_chunk)))


def _grad_weight_slice(dl: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> None:
    """``out = dl^T @ hidden`` in the input dtype with fp32 accumulation (one GEMM over
    all tokens), written in place on CUDA."""
    if hidden.device.type == "cuda":
        torch.mm(dl.T, hidden, out=out)  # cuBLAS accumulates half GEMMs in fp32
    else:
        out.copy_(mm_f32(dl.T, hidden))


def grad_weight_buffer(weight: torch.Tensor, v_real: int, n: int) -> torch.Tensor:
    """grad_weight, uninitialised where the backward writes every element (the real rows,
    when there are tokens), zero elsewhere (padding rows): no memset of the whole [V, H]."""
    if n == 0 or v_real == 0:
        return torch.zeros_like(weight)
    out = scratch.empty(tuple(weight.shape), dtype=weight.dtype, device=weight.device)
    out[v_real:].zero_()
    return out


# ----------------------------------------------------------------------------- autograd


class LinearLogprobTriton(torch.autograd.Function):
    """Fused Triton implementation; see the module docstring."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, p: LogprobParams
    ):
        ctx.set_materialize_grads(False)
        cfg = config_for(hidden.device, hidden.dtype)
        hidden, w_real, t_col, ignored = kernel_inputs(hidden, weight, targets, p)
        stats = forward_stats(hidden, w_real, t_col, p, cfg)
        gathered = gather_stats(stats, p.tp_group, p.tp_size)  # [P, S, N, 4]
        lse, mean_z, zt, ent = merge(gathered.flatten(0, 1), entropy=p.return_entropy)
        ctx.save_for_backward(hidden, weight, t_col, ignored, lse, mean_z)
        ctx.params = p
        return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, t_col, ignored, lse, mean_z = ctx.saved_tensors
        p: LogprobParams = ctx.params
        cfg = config_for(hidden.device, hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        grads = masked_upstream(ignored, g_lp, g_ent, g_lse)
        grad_h32 = None
        if need_h:  # the first vocabulary chunk writes every element (accumulate=False)
            alloc = scratch.empty if v_real > 0 else torch.zeros
            grad_h32 = alloc((n, h_dim), dtype=torch.float32, device=hidden.device)
        grad_w = grad_weight_buffer(weight, v_real, n) if need_w else None
        rows = min(cfg.token_chunk, n)
        # fp32 accumulator for a grad_W slice when N spans several token chunks
        acc_w = None
        if need_w and n > rows and weight.dtype != torch.float32:
            acc_w = torch.empty(
                (min(cfg.vocab_chunk, v_real), h_dim), dtype=torch.float32, device=hidden.device
            )
        # Under TP, the last vocabulary chunk computes each token block's grad_h first and
        # starts that block's all-reduce, which then runs beside the block's grad_W GEMM.
        sums = RowSums(grad_h32, p.tp_group, p.tp_size, rows, need_h and p.reduce_grad_hidden)
        pieces = None  # one vocabulary chunk per launch, or (small N) a group of them
        span = chunk_group(n, h_dim, v_real, cfg, hidden.device) * cfg.vocab_chunk
        if span > cfg.vocab_chunk:
            spans = [(b, min(span, v_real - b)) for b in range(0, v_real, span)]
            pieces = (spans, min(span, pad128(v_real)))
        for v_begin, v_count, blocks in dlogits_blocks(
            hidden, w_real, t_col, lse, mean_z, grads, p, cfg, pieces
        ):
            w_chunk = w_real[v_begin : v_begin + v_count]
            gw_slice = grad_w[v_begin : v_begin + v_count] if need_w else None
            acc = None
            if need_w and rows < n:  # fp32 accumulation over token chunks
                acc = gw_slice if acc_w is None else acc_w[:v_count]
            early = sums.active and v_begin + v_count == v_real
            for r0, r1, dl, cols in blocks:
                # dl's zero columns up to cols keep K_A vectorized
                gh = (grad_h32[r0:r1], dl, w_chunk, cfg) if need_h else None
                kw = {"k_a": cols, "accumulate": v_begin > 0, "chunk_k": cfg.vocab_chunk}
                if early:
                    _matmul_acc_(*gh, **kw)
                    sums.ready(r1)
                if need_w and rows == n:  # one token chunk: the slice in one GEMM
                    _grad_weight_slice(dl, hidden, gw_slice)
                elif need_w:  # the first token chunk overwrites acc
                    addmm_f32_(acc, dl.T, hidden[r0:r1], accumulate=r0 > 0)
                if need_h and not early:
                    _matmul_acc_(*gh, **kw)
            if need_w and acc_w is not None:
                gw_slice.copy_(acc)
        grad_h = None
        if need_h:
            sums.finish()
            grad_h = grad_h32.to(hidden.dtype)
        return grad_h, grad_w, None, None
