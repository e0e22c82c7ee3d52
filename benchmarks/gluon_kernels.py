"""Session 8 experiment (not used by lp): lp's backward kernels rewritten in Gluon.

Triton 3.6's Gluon dialect (``triton.experimental.gluon``) schedules a Hopper kernel by
hand: TMA loads into a ring of shared-memory stages with mbarriers, async wgmma, and
optionally warp-specialized partitions. These kernels ask whether that schedule closes
the gap that session 6 measured between lp's Triton kernels and cuBLAS on one backward
chunk (1.1-1.4 x). ``gluon_anatomy.py`` times them; docs/benchmarks.md ("session 8") has
the numbers. In short: no. They give the Triton kernels' bits exactly and run no faster.

- ``_dlogits_kernel``: ``triton_linear._dlogits_kernel`` (same tiles, K order and
  epilogue), persistent: each program walks its tiles with the next tile's loads in flight
  during this tile's epilogue, and stores d_logits through shared memory and TMA.
- ``_matmul_acc_kernel``: the grad_hidden GEMM ``C (fp32) [+]= A @ B``, persistent and
  pipelined the same way (C added once after the K loop, as the Triton kernel does since
  session 8).
- ``_matmul_ws_kernel``: the same GEMM warp-specialized: a one-warp TMA producer partition
  and the MMA + epilogue partition, through ready/empty barriers per stage (the schedule
  of cuBLAS's Hopper kernels, without their 2-CTA clusters).

Gluon's API is experimental and moves between Triton releases (these are written for the
GPU image's 3.6; ``uv.lock`` has 3.9), and it has no interpreter, so none of this can run
in the CPU suite. Compile without a GPU with ``triton.compile(GluonASTSource(...),
target=GPUTarget("cuda", 90, 32))`` under Triton 3.6.
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5; its API is experimental and moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _tile_of(t, pid, nprog, blocks_m, blocks_n, group):
        """Output tile (i_m, i_n) of this program's ``t``-th tile: tiles ``pid + t * nprog``
        in the grouped order of ``triton_linear._grouped`` (order only)."""
        tile = pid + t * nprog
        width = group * blocks_n
        first_m = (tile // width) * group
        size_m = gl.minimum(blocks_m - first_m, group)
        return first_m + (tile % width) % size_m, (tile % width) // size_m

    @gluon.jit
    def _issue_load(
        step, total, k_steps, pid, nprog, blocks_m, blocks_n, group,
        a_desc, b_desc, a_bufs, b_bufs, ready, STAGES: gl.constexpr,
    ):  # fmt: skip
        """TMA loads of this program's ``step``-th K block (tile ``step // k_steps``) into
        stage ``step % STAGES``; nothing when ``step`` is past the last one."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        pred = step < total
        i_m, i_n = _tile_of(step // k_steps, pid, nprog, blocks_m, blocks_n, group)
        k0 = (step % k_steps) * BLOCK_K
        stage = step % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [i_m * BLOCK_M, k0], bar, a_bufs.index(stage), pred)
        tma.async_copy_global_to_shared(b_desc, [k0, i_n * BLOCK_N], bar, b_bufs.index(stage), pred)

    @gluon.jit
    def _matmul_acc_kernel(
        a_desc, b_desc, c_ptr, M, N, K, stride_cm, group,
        ACC: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """C[:M, :N] (fp32) = [C +] A @ B over K; A, B through tensor descriptors (zeros
        out of bounds). Grid: at most one program per SM, each walking its tiles."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        blocks_m = gl.cdiv(M, BLOCK_M)
        blocks_n = gl.cdiv(N, BLOCK_N)
        my_tiles = gl.cdiv(blocks_m * blocks_n - pid, nprog)
        k_steps = gl.cdiv(K, BLOCK_K)
        total = my_tiles * k_steps
        # Prologue: the first STAGES - 1 K blocks in flight.
        for s in gl.static_range(STAGES - 1):
            _issue_load(
                s, total, k_steps, pid, nprog, blocks_m, blocks_n, group,
                a_desc, b_desc, a_bufs, b_bufs, ready, STAGES,
            )  # fmt: skip

        step = 0
        for t in range(my_tiles):
            # a fresh accumulator per tile (not carried across tiles: the epilogue's
            # registers would then hold two tiles)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                acc = warpgroup_mma(
                    a_bufs.index(stage), b_bufs.index(stage), acc, use_acc=kk > 0, is_async=True
                )
                # One MMA in flight: the previous one is done, so its stage can be refilled
                # (with the K block STAGES - 1 ahead, possibly of this program's next tile).
                acc = warpgroup_mma_wait(1, deps=[acc])
                _issue_load(
                    step + STAGES - 1, total, k_steps, pid, nprog, blocks_m, blocks_n, group,
                    a_desc, b_desc, a_bufs, b_bufs, ready, STAGES,
                )  # fmt: skip
                step += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            i_m, i_n = _tile_of(t, pid, nprog, blocks_m, blocks_n, group)
            o_m = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            o_n = i_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            mask = (o_m < M)[:, None] & (o_n < N)[None, :]
            p_c = c_ptr + o_m[:, None].to(gl.int64) * stride_cm + o_n[None, :]
            out = acc
            if ACC:
                out = acc + gl.load(p_c, mask=mask, other=0.0)
            gl.store(p_c, out, mask=mask)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

    @gluon.jit
    def _issue_logit_load(
        step, total, k_steps, pid, nprog, blocks_n, blocks_v, group, v_begin,
        h_desc, w_desc, h_bufs, w_bufs, ready, STAGES: gl.constexpr,
    ):  # fmt: skip
        """TMA loads of K block ``step % k_steps`` of this program's logit tile ``step //
        k_steps``: hidden rows and weight rows (columns of the logits) into one stage."""
        BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
        BLOCK_H: gl.constexpr = h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
        pred = step < total
        i_n, i_v = _tile_of(step // k_steps, pid, nprog, blocks_n, blocks_v, group)
        k0 = (step % k_steps) * BLOCK_H
        stage = step % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(h_desc, [i_n * BLOCK_N, k0], bar, h_bufs.index(stage), pred)
        tma.async_copy_global_to_shared(
            w_desc, [v_begin + i_v * BLOCK_V, k0], bar, w_bufs.index(stage), pred
        )

    @gluon.jit
    def _dlogits_kernel(
        h_desc, w_desc, dl_desc, t_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, c0_ptr,
        N, H, v_begin, v_count, v_store, inv_t, group,
        ENTROPY: gl.constexpr, HAS_LP: gl.constexpr, IGNORED: gl.constexpr,
        STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """``triton_linear._dlogits_kernel`` as a persistent, pipelined Gluon kernel: the
        same tiles, K order and epilogue arithmetic; the d_logits tile leaves through shared
        memory and an asynchronous TMA store (clipped to ``N x v_store`` by ``dl_desc``),
        while the next tile's loads are already in flight."""
        BLOCK_N: gl.constexpr = h_desc.block_type.shape[0]
        BLOCK_H: gl.constexpr = h_desc.block_type.shape[1]
        BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = h_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_V, 16]
        )
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        h_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_H], h_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_V, BLOCK_H], w_desc.layout)
        out_buf = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_V], dl_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        blocks_n = gl.cdiv(N, BLOCK_N)
        blocks_v = gl.cdiv(v_store, BLOCK_V)
        my_tiles = gl.cdiv(blocks_n * blocks_v - pid, nprog)
        k_steps = gl.cdiv(H, BLOCK_H)
        total = my_tiles * k_steps
        for s in gl.static_range(STAGES - 1):
            _issue_logit_load(
                s, total, k_steps, pid, nprog, blocks_n, blocks_v, group, v_begin,
                h_desc, w_desc, h_bufs, w_bufs, ready, STAGES,
            )  # fmt: skip

        step = 0
        for t in range(my_tiles):
            acc = gl.zeros([BLOCK_N, BLOCK_V], gl.float32, acc_layout)
            for kk in range(k_steps):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                acc = warpgroup_mma(
                    h_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc,
                    use_acc=kk > 0, is_async=True,
                )  # fmt: skip
                acc = warpgroup_mma_wait(1, deps=[acc])
                _issue_logit_load(
                    step + STAGES - 1, total, k_steps, pid, nprog, blocks_n, blocks_v, group,
                    v_begin, h_desc, w_desc, h_bufs, w_bufs, ready, STAGES,
                )  # fmt: skip
                step += 1
            b_z = warpgroup_mma_wait(0, deps=[acc])

            i_n, i_v = _tile_of(t, pid, nprog, blocks_n, blocks_v, group)
            o_n = i_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)
            o_c = i_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=cols_layout)
            m_n = o_n < N
            m_v = o_c < v_count
            b_lse = gl.load(lse_ptr + o_n, mask=m_n, other=0.0)
            b_c0 = gl.load(c0_ptr + o_n, mask=m_n, other=0.0) * inv_t
            b_zs = b_z * inv_t
            b_p = gl.exp(b_zs - b_lse[:, None])
            if ENTROPY:
                b_mean = gl.load(mean_ptr + o_n, mask=m_n, other=0.0)
                b_gent = gl.load(gent_ptr + o_n, mask=m_n, other=0.0) * inv_t
                b_dz = b_p * (b_c0[:, None] - b_gent[:, None] * (b_zs - b_mean[:, None]))
            else:
                b_dz = b_p * b_c0[:, None]
            b_t = gl.load(t_ptr + o_n, mask=m_n, other=-1)
            if HAS_LP:
                b_trel = b_t - (v_begin + i_v * BLOCK_V)
                if gl.max(((b_trel >= 0) & (b_trel < BLOCK_V)).to(gl.int32), axis=0) > 0:
                    b_glp = gl.load(glp_ptr + o_n, mask=m_n, other=0.0) * inv_t
                    o_rel = gl.arange(0, BLOCK_V, layout=cols_layout)
                    m_hit = o_rel[None, :] == b_trel[:, None]
                    b_dz = gl.where(m_hit, b_dz + b_glp[:, None], b_dz)
            m_live = m_n & (b_t != IGNORED)
            if (gl.min(m_live.to(gl.int32), axis=0) == 0) | ((i_v + 1) * BLOCK_V > v_count):
                b_dz = gl.where(m_live[:, None] & m_v[None, :], b_dz, 0.0)
            # the previous tile's store has left shared memory before this one overwrites it
            tma.store_wait(0)
            out_buf.store(b_dz.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dl_desc, [i_n * BLOCK_N, i_v * BLOCK_V], out_buf)

        tma.store_wait(0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

    @gluon.jit
    def _ws_loader(
        a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, group, STAGES: gl.constexpr
    ):
        """Producer partition (one warp): every K block of every tile of this program, as
        soon as its stage is released by the MMA that read it."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        blocks_m = gl.cdiv(M, BLOCK_M)
        blocks_n = gl.cdiv(N, BLOCK_N)
        my_tiles = gl.cdiv(blocks_m * blocks_n - pid, nprog)
        k_steps = gl.cdiv(K, BLOCK_K)
        step = 0
        for t in range(my_tiles):
            i_m, i_n = _tile_of(t, pid, nprog, blocks_m, blocks_n, group)
            for kk in range(k_steps):
                stage = step % STAGES
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    a_desc, [i_m * BLOCK_M, kk * BLOCK_K], bar, a_bufs.index(stage)
                )
                tma.async_copy_global_to_shared(
                    b_desc, [kk * BLOCK_K, i_n * BLOCK_N], bar, b_bufs.index(stage)
                )
                step += 1

    @gluon.jit
    def _ws_mma(
        a_bufs, b_bufs, ready, empty, c_ptr, M, N, K, stride_cm, group,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        ACC: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Default partition: the MMAs (one in flight) and each tile's epilogue."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        blocks_m = gl.cdiv(M, BLOCK_M)
        blocks_n = gl.cdiv(N, BLOCK_N)
        my_tiles = gl.cdiv(blocks_m * blocks_n - pid, nprog)
        k_steps = gl.cdiv(K, BLOCK_K)
        step = 0
        for t in range(my_tiles):
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kk in range(k_steps):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                acc = warpgroup_mma(
                    a_bufs.index(stage), b_bufs.index(stage), acc, use_acc=kk > 0, is_async=True
                )
                acc = warpgroup_mma_wait(1, deps=[acc])
                # the previous MMA of this tile is done: release its stage
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1, pred=kk > 0)
                step += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), count=1)
            i_m, i_n = _tile_of(t, pid, nprog, blocks_m, blocks_n, group)
            o_m = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            o_n = i_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            mask = (o_m < M)[:, None] & (o_n < N)[None, :]
            p_c = c_ptr + o_m[:, None].to(gl.int64) * stride_cm + o_n[None, :]
            out = acc
            if ACC:
                out = acc + gl.load(p_c, mask=mask, other=0.0)
            gl.store(p_c, out, mask=mask)

    @gluon.jit
    def _matmul_ws_kernel(
        a_desc, b_desc, c_ptr, M, N, K, stride_cm, group,
        ACC: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """``_matmul_acc_kernel`` warp-specialized: a one-warp TMA producer partition and
        the MMA + epilogue partition, through ready/empty barriers per stage."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize(
            [
                (
                    _ws_mma,
                    (a_bufs, b_bufs, ready, empty, c_ptr, M, N, K, stride_cm, group,
                     BLOCK_M, BLOCK_N, BLOCK_K, ACC, STAGES, num_warps),
                ),
                (
                    _ws_loader,
                    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, group, STAGES),
                ),
            ],
            [1],
            [24],
        )  # fmt: skip
