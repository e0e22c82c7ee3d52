"""The ``triton`` backend of ``linear_logprob``: fused logits and softmax statistics.

The logits never reach memory in the forward; the backward's scratch is one chunk.

Data flow for one rank (V_r = real columns of this shard, S = cdiv(V_r, split_width)
splits, the width set by the group's widest shard)::

    forward   fwd_stats_kernel, one program per (row block, split):
                for each BLOCK_V tile of the split:  z = (h W^T) / T  on chip (fp32 acc)
                online (m, s, a, t) per row  ->  stats [S, N, 4]   (logits never stored)
              P > 1: group_merge_kernel: the S partials in order -> one  [1, N, 4]
                  all-gather over tp_group -> [P, N, 4]
              merge_kernel: merge the partials of each row in order -> lse, E, and the
                  outputs (logprob, entropy, lse; ignored rows 0, non-finite rows NaN)
    backward  for each vocabulary chunk of VOCAB_CHUNK columns, for each token chunk of
              TOKEN_CHUNK rows (both fixed):
                dlogits_kernel: recompute z tile by tile, d l = d z / T, stored in the
                    input dtype -> scratch [TOKEN_CHUNK, VOCAB_CHUNK]   (bounded, any N)
                grad_W[chunk] = d l^T @ h          cuBLAS: one GEMM when N fits one token
                    chunk, else fp32 accumulation over token chunks ([VOCAB_CHUNK, H])
                grad_h (fp32) += d l @ W[chunk]    matmul_acc_kernel, each program owns its tile
              (small N: a group of chunks per launch, each chunk still summed apart and
              added in order: chunk_group; the chunks side by side, SPLIT, or in one
              program per output tile, MULTI)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

Launch and loads (``TileConfig.group`` / ``.tma``; neither changes a result). Every kernel
runs on a 1-D grid whose programs take their tiles ``group`` row blocks at a time, rows
fastest (``grouped``), so the programs resident together share hidden rows and weight
tiles in L2. GEMM operands are read through tensor descriptors (TMA on Hopper; zeros out
of bounds) when :func:`tma_ok` allows, else through masked pointer loads; both feed the
same ``tl.dot`` sequence, and tests check the bits are equal.

Numerics. Every dot accumulates in fp32 (``input_precision="ieee"`` for fp32 inputs,
never TF32). The partial statistics follow ``lp_kernels.core.stats``: exponents relative
to a running maximum seeded with -inf, entropy assembled from ``z - m``. The merge
visits partials in (rank, partial) order in one program per row block.

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

import torch

from lp_kernels.backends.triton.backward import (
    chunk_group,
    dlogits_blocks,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
    upstream,
)
from lp_kernels.backends.triton.config import config_for, pad128
from lp_kernels.backends.triton.forward import forward_stats, gather_partials, merge_outputs
from lp_kernels.backends.triton.gemm import matmul_acc
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.matmul import addmm_f32_, scratch
from lp_kernels.core.stats import bias_grad
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums

# ----------------------------------------------------------------------------- autograd


class LinearLogprobTriton(torch.autograd.Function):
    """Fused Triton implementation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        cfg = p.tile_config or config_for(hidden.device, hidden.dtype)
        hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
        b_real = None if bias is None else bias[: w_real.shape[0]].float()
        stats = forward_stats(hidden, w_real, targets, p.vocab_start, p, cfg, b_real)
        gathered = gather_partials(stats, p)  # TP: one partial per rank, then gathered
        lse, mean_z, outputs = merge_outputs(
            gathered, targets, p.ignore_index, entropy=p.return_entropy,
            return_lse=p.return_lse,
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z)
        ctx.params = p
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
        p: LogprobParams = ctx.params
        cfg = p.tile_config or config_for(hidden.device, hidden.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        b_real = None if bias is None else bias[:v_real].float()
        acc_b = torch.zeros(v_real, dtype=torch.float32, device=hidden.device) if need_b else None
        grads = upstream(g_lp, g_ent, g_lse)
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
            hidden, w_real, targets, p.vocab_start, lse, mean_z, grads, p, cfg, pieces, b_real,
            acc_b,
        ):  # fmt: skip
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
                    matmul_acc(*gh, **kw)
                    sums.ready(r1)
                if need_w and rows == n:  # one token chunk: the slice in one GEMM
                    grad_weight_slice(dl, hidden, gw_slice)
                elif need_w:  # the first token chunk overwrites acc
                    addmm_f32_(acc, dl.T, hidden[r0:r1], accumulate=r0 > 0)
                if need_h and not early:
                    matmul_acc(*gh, **kw)
            if need_w and acc_w is not None:
                gw_slice.copy_(acc)
        grad_h = None
        if need_h:
            sums.finish()
            grad_h = grad_h32.to(hidden.dtype)
        return grad_h, grad_w, bias_grad(acc_b, bias), None, None
