"""The forward statistics on Hopper with the softmax epilogue off the tensor cores' path:
two consumer warpgroups in ping-pong (Gluon).

``forward.fwd_stats_kernel`` computes each 128 x 256 logits block with 8 warps, two
warpgroups that issue their MMAs and then run the online-softmax epilogue together, while
the tensor cores wait. :func:`pingpong_stats_kernel` is persistent (one program per SM) and
splits that work by warpgroup: each owns the 64 rows of a block that the same warpgroup
owns in the Triton kernel, with its own operand stream. A one-warp TMA producer fills one
ring of stages in the order (block j of warpgroup 0, block j of warpgroup 1, block j + 1 of
warpgroup 0, ...); the warpgroups take their mainloops in turn (an mbarrier each), so that
one's MMAs run while the other is in its epilogue.

Every product, its K order and the epilogue are the Triton kernel's: the row reductions
run on the same accumulator layout (``instr_shape [16, 256, 16]``, each warp 16 rows), a
bias is added to the finished sums, and the online softmax is the same ``@triton.jit``
helper (``softmax.softmax_update`` / ``softmax_finish``), called on this kernel's layouts,
as are the launch order and the target codes (``tl_utils``). The partials are bitwise those
of ``fwd_stats_kernel`` (GPU tests check it with ``torch.equal``), so the choice between the
two kernels (:func:`pingpong_ok`) is a launch choice only, like a block order.

Where it runs: the Triton kernel's epilogue costs most at H <= 2048, where each block's
mainloop is short; there this kernel is faster. At H >= 3072 the per-warpgroup operand
streams (each 64-row MMA step loads a whole weight block) cost more than the epilogue it
hides, and with entropy the epilogue does not fit the consumers' registers: those stay on
the Triton kernel (``ForwardConfig.pingpong_max_h``; docs/history.md has the measurements).

Gluon is Triton's explicit-layout dialect for Hopper and newer; it has no interpreter,
so the CPU suite compiles this kernel for sm_90 instead of running it.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; these names are those of 3.6 to 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    HAVE_GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    sm_count,
    swizzle_rows,
    tma_ok,
)
from lp_kernels.backends.triton.softmax import (
    cap_constants,
    softmax_finish,
    softmax_update,
    transform_args,
)
from lp_kernels.backends.triton.tl_utils import IGNORED, swizzle, target_codes
from lp_kernels.core.types import LogprobParams

HALF = 64
"""Rows of a warpgroup's tile (half of the Triton kernel's ``block_n``)."""
STAGES = 4
"""Operand stages in the ring (64 x 64 hidden + 256 x 64 weight, 40 KiB each; five were
slower on H200)."""
CONSUMER_REGS = 240
"""Registers per thread of the second consumer warpgroup (the first gets as many; the
producer warp 24): 128 accumulator registers and the epilogue's, without spilling."""

if HAVE_GLUON:
    # Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _producer(
        h_desc,
        w_desc,
        h_bufs,
        w_bufs,
        ready,
        empty,
        N,
        H,
        V_real,
        splits,
        rows,
        V_SPLIT: gl.constexpr,
    ):
        """One warp: for each (row block, split) item of this program, each tile of the
        split, each warpgroup, each K block: that warpgroup's hidden rows and the tile's
        weight rows into the next stage, once its previous reader released it."""
        HALF: gl.constexpr = h_desc.block_type.shape[0]
        BLOCK_H: gl.constexpr = h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
        NSTAGES: gl.constexpr = h_bufs.type.shape[0]
        nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
        blocks_n = gl.cdiv(N, 2 * HALF)
        k_steps = gl.cdiv(H, BLOCK_H)
        pos = 0
        for item in range(gl.program_id(0), blocks_n * splits, gl.num_programs(0)):
            i_n, i_s = swizzle(item, blocks_n, splits, rows)
            v_begin = i_s * V_SPLIT
            v_end = gl.minimum(v_begin + V_SPLIT, V_real)
            for v0 in range(v_begin, v_end, BLOCK_V):
                for wg in gl.static_range(2):
                    for kk in range(k_steps):
                        stage = pos % NSTAGES
                        mbarrier.wait(empty.index(stage), ((pos // NSTAGES) & 1) ^ 1)
                        bar = ready.index(stage)
                        mbarrier.expect(bar, nbytes)
                        row0 = i_n * (2 * HALF) + wg * HALF
                        _tma_load(h_desc, [row0, kk * BLOCK_H], bar, h_bufs.index(stage))
                        _tma_load(w_desc, [v0, kk * BLOCK_H], bar, w_bufs.index(stage))
                        pos += 1

    @gluon.jit
    def _consumer(
        h_bufs,
        w_bufs,
        ready,
        empty,
        order,
        t_ptr,
        stats_ptr,
        b_ptr,
        N,
        H,
        V_real,
        ignore_index,
        col0,
        inv_t,
        cap,
        inv_cap,
        splits,
        rows,
        scale,
        WG: gl.constexpr,
        BLOCK_V: gl.constexpr,
        BLOCK_H: gl.constexpr,
        V_SPLIT: gl.constexpr,
        IGNORED: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        CAP: gl.constexpr,
        SCALE: gl.constexpr,
    ):
        """Warpgroup ``WG``: rows ``[WG * HALF, +HALF)`` of each row block, the Triton
        kernel's MMAs (``HAS_BIAS``: and the bias) and online ``(m, s, a = 0, t)`` per row
        (``softmax.softmax_update``), then its partials."""
        NSTAGES: gl.constexpr = h_bufs.type.shape[0]
        HALF: gl.constexpr = h_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_V, 16]
        )
        rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
        # the bias' columns, BLOCK_V / 128 per thread: one coalesced load per tile, issued
        # before the tile's MMAs and moved into cols_l after them (loaded in cols_l, each
        # thread's 64 columns come one by one, in batches that ptxas places between their
        # uses, and the epilogue waits on each)
        bias_l: gl.constexpr = gl.BlockedLayout([BLOCK_V // 128], [32], [4], [0])
        blocks_n = gl.cdiv(N, 2 * HALF)
        k_steps = gl.cdiv(H, BLOCK_H)
        k_e, k_z, k_a, k_t = cap_constants(cap, inv_cap, inv_t)
        pos = 0
        n_tile = 0  # this warpgroup's tiles so far
        for item in range(gl.program_id(0), blocks_n * splits, gl.num_programs(0)):
            i_n, i_s = swizzle(item, blocks_n, splits, rows)
            o_n = i_n * (2 * HALF) + WG * HALF + gl.arange(0, HALF, layout=rows_l)
            m_n = o_n < N
            b_t = target_codes(t_ptr, o_n, m_n, ignore_index, col0, V_real, IGNORED)
            b_m = gl.full([HALF], float("-inf"), gl.float32, layout=rows_l)
            b_s = gl.zeros([HALF], gl.float32, layout=rows_l)
            b_zt = gl.zeros([HALF], gl.float32, layout=rows_l)
            v_begin = i_s * V_SPLIT
            v_end = gl.minimum(v_begin + V_SPLIT, V_real)
            for v0 in range(v_begin, v_end, BLOCK_V):
                first = pos + WG * k_steps
                if HAS_BIAS:
                    o_b = v0 + gl.arange(0, BLOCK_V, layout=bias_l)
                    b_b = gl.load(b_ptr + o_b, mask=o_b < v_end, other=0.0)
                # Mainloops in turn: warpgroup 0's n-th after warpgroup 1 issued its
                # (n-1)-th, warpgroup 1's n-th after warpgroup 0 issued its n-th. So no
                # ready barrier is waited on a phase ahead of the one that fills it, and one
                # warpgroup's MMAs run while the other is in its epilogue.
                if WG == 0:
                    mbarrier.wait(order.index(0), (n_tile + 1) & 1, pred=n_tile > 0)
                else:
                    mbarrier.wait(order.index(1), n_tile & 1)
                acc = gl.zeros([HALF, BLOCK_V], gl.float32, acc_layout)
                for kk in range(k_steps):
                    p = first + kk
                    stage = p % NSTAGES
                    mbarrier.wait(ready.index(stage), (p // NSTAGES) & 1)
                    acc = warpgroup_mma(
                        h_bufs.index(stage),
                        w_bufs.index(stage).permute((1, 0)),
                        acc,
                        is_async=True,
                    )
                    # one MMA in flight: the previous K block's stage is free
                    acc = warpgroup_mma_wait(1, deps=[acc])
                    prev = (p + NSTAGES - 1) % NSTAGES
                    mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
                mbarrier.arrive(order.index(1 - WG), count=1)
                n_tile += 1
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(empty.index((first + k_steps - 1) % NSTAGES), count=1)
                pos += 2 * k_steps

                if HAS_BIAS:  # tl_utils.logits_block: the bias added to the finished sums
                    acc = acc + gl.convert_layout(b_b, cols_l)[None, :]
                # the target's raw logit, then fwd_stats_kernel's online softmax
                b_trel = gl.where(b_t < v_end, b_t - v0, -1).to(gl.int32)
                b_cols = gl.arange(0, BLOCK_V, layout=cols_l)
                b_zt += gl.sum(gl.where(b_cols[None, :] == b_trel[:, None], acc, 0.0), axis=1)
                b_m, b_s, _ = softmax_update(
                    b_m,
                    b_s,
                    b_s,
                    acc,
                    None,
                    b_cols,
                    v0,
                    v_end,
                    scale,
                    inv_t,
                    k_e,
                    k_z,
                    k_a,
                    k_t,
                    False,
                    CAP,
                    SCALE,
                )
            b_m, b_zt = softmax_finish(
                b_m, b_zt, scale, cap, inv_cap, inv_t, k_z, False, CAP, SCALE
            )
            p_out = stats_ptr + (i_s.to(gl.int64) * N + o_n) * 4
            gl.store(p_out + 0, b_m, mask=m_n)
            gl.store(p_out + 1, b_s, mask=m_n)
            gl.store(p_out + 2, gl.zeros([HALF], gl.float32, layout=rows_l), mask=m_n)
            gl.store(p_out + 3, b_zt, mask=m_n)

    @gluon.jit
    def pingpong_stats_kernel(
        h_desc,
        w_desc,
        t_ptr,
        stats_ptr,
        b_ptr,
        N,
        H,
        V_real,
        ignore_index,
        col0,
        inv_t,
        cap,
        inv_cap,
        splits,
        rows,
        scale,
        V_SPLIT: gl.constexpr,
        NSTAGES: gl.constexpr,
        IGNORED: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        CAP: gl.constexpr,
        SCALE: gl.constexpr,
        REGS: gl.constexpr,
    ):
        """``fwd_stats_kernel``'s ``[S, N, 4]`` partials (``ENTROPY`` and ``STORE_L`` off,
        ``TILE_W = 0``), persistent: the default partition is warpgroup 0, a 4-warp worker
        warpgroup 1, a 1-warp worker the producer."""
        HALF: gl.constexpr = h_desc.block_type.shape[0]
        BLOCK_H: gl.constexpr = h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = h_desc.dtype
        h_bufs = gl.allocate_shared_memory(dtype, [NSTAGES, HALF, BLOCK_H], h_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [NSTAGES, BLOCK_V, BLOCK_H], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NSTAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(order.index(s), count=1)
        fence_async_shared()
        # fmt: off
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (h_bufs, w_bufs, ready, empty, order, t_ptr, stats_ptr, b_ptr, N, H,
                     V_real, ignore_index, col0, inv_t, cap, inv_cap, splits, rows, scale, 0,
                     BLOCK_V, BLOCK_H, V_SPLIT, IGNORED, HAS_BIAS, CAP, SCALE),
                ),
                (
                    _consumer,
                    (h_bufs, w_bufs, ready, empty, order, t_ptr, stats_ptr, b_ptr, N, H,
                     V_real, ignore_index, col0, inv_t, cap, inv_cap, splits, rows, scale, 1,
                     BLOCK_V, BLOCK_H, V_SPLIT, IGNORED, HAS_BIAS, CAP, SCALE),
                ),
                (
                    _producer,
                    (h_desc, w_desc, h_bufs, w_bufs, ready, empty, N, H, V_real, splits,
                     rows, V_SPLIT),
                ),
            ],
            [4, 1],
            [REGS, 24],
        )
        # fmt: on


_MAJOR: dict[int, int] = {}


def _major(device: torch.device) -> int:
    """Compute capability major of an NVIDIA device (cached per device); 0 under ROCm,
    whose devices report their own numbering (an MI300 reads 9.4)."""
    if torch.version.hip is not None:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAJOR:
        _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return _MAJOR[index]


@functools.cache
def _layouts(block_h: int, block_v: int, dtype: torch.dtype):
    """The shared-memory layouts of the hidden and weight blocks (computed once: building
    one costs a host call tens of microseconds)."""
    dt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (
        gl.NVMMASharedLayout.get_default_for([HALF, block_h], dt),
        gl.NVMMASharedLayout.get_default_for([block_v, block_h], dt),
    )


def pingpong_ok(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    p: LogprobParams,
    cfg: KernelConfig,
) -> bool:
    """Whether a call's forward statistics take :func:`pingpong_stats`: no entropy or
    ``deterministic=True`` in ``p`` (the caller checks its stored logits and tiles), a
    Hopper GPU (compute capability 9.x), Gluon, 2-byte inputs that back tensor
    descriptors, the config's logits block (128 x 256) and ``H <=
    forward.pingpong_max_h``. Options, H, the dtype and the device decide it, never N or
    the shard's width; both kernels give the same bits. A cap and a bias do not enter
    the rule: with either the training step measured as fast as or faster than with the
    Triton forward (docs/history.md); ``logit_scale`` (one more multiply per logit) has not
    been timed apart."""
    return (
        HAVE_GLUON
        and cfg.forward.pingpong_max_h > 0
        and not p.return_entropy
        and not p.deterministic
        and hidden.device.type == "cuda"
        and hidden.shape[1] <= cfg.forward.pingpong_max_h
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and w_real.dtype == hidden.dtype
        and cfg.logits.block_n == 2 * HALF
        and cfg.logits.block_v == 256
        and _major(hidden.device) == 9
        and tma_ok(hidden, w_real)
    )


def pingpong_stats(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    targets: torch.Tensor,
    first_id: int,
    p: LogprobParams,
    cfg: KernelConfig,
    stats: torch.Tensor,
    width: int,
    b_real: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fill ``stats [S, N, 4]`` with the partials of splits of ``width`` columns, as
    ``forward.fwd_stats_kernel`` would (:func:`pingpong_ok` holds; ``b_real``: the fp32
    bias of ``w_real``'s rows, or None)."""
    n, h_dim = hidden.shape
    v_real = w_real.shape[0]
    splits = stats.shape[0]
    block_h, block_v = cfg.logits.block_h, cfg.logits.block_v
    h_layout, w_layout = _layouts(block_h, block_v, hidden.dtype)
    h_desc = GluonDescriptor(hidden, [n, h_dim], [hidden.stride(0), 1], [HALF, block_h], h_layout)
    w_desc = GluonDescriptor(
        w_real, [v_real, h_dim], [w_real.stride(0), 1], [block_v, block_h], w_layout
    )
    blocks_n = triton.cdiv(n, 2 * HALF)
    pingpong_stats_kernel[(min(sm_count(hidden.device), blocks_n * splits),)](
        h_desc=h_desc,
        w_desc=w_desc,
        t_ptr=targets,
        stats_ptr=stats,
        b_ptr=b_real,
        N=n,
        H=h_dim,
        V_real=v_real,
        ignore_index=p.ignore_index,
        col0=first_id,
        splits=splits,
        rows=swizzle_rows(cfg, blocks_n),
        V_SPLIT=width,
        NSTAGES=STAGES,
        IGNORED=IGNORED,
        HAS_BIAS=b_real is not None,
        REGS=CONSUMER_REGS,
        num_warps=4,
        **transform_args(p.transform),
        **compile_opts(hidden.device),
    )
    return stats
