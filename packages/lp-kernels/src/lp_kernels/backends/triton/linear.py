"""The ``triton`` backend of ``linear_logprob``: fused logits and softmax statistics.

The logits never reach memory in the forward; the backward's scratch is one chunk.

Data flow for one rank (V_r = real columns of this shard, S = cdiv(V_r, split_width)
splits, the width set by the group's widest shard)::

    forward   fwd_stats_kernel, one program per (row block, split):
                for each BLOCK_V block of the split:  z = transform(h W^T + b) on chip
                online (m, s, a, t) per row  ->  stats [S, N, 4]   (logits never stored)
              P > 1: the S partials merged in order -> one  [1, N, 4]
                  all-gather over tp_group -> [P, N, 4]
              merge_kernel: merge the partials of each row in order -> lse, E, and the
                  outputs (logprob, entropy, lse; ignored rows 0, non-finite rows NaN)
    backward  for each vocabulary chunk, for each token chunk (both fixed sizes):
                dlogits_kernel: recompute z block by block, d l = d z dz/dl, stored in the
                    input dtype -> scratch [token_chunk, vocab_chunk]   (bounded, any N)
                grad_W[chunk] = d l^T @ h          cuBLAS: one GEMM when N fits one token
                    chunk, else fp32 accumulation over token chunks ([vocab_chunk, H])
                grad_h (fp32) += d l @ W[chunk]    gemm.matmul_acc, each program owns its block
              (small N: several chunks per launch, each chunk still summed apart and
              added in order: plan.chunks_per_launch)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

Launch and loads (``KernelConfig.swizzle`` / ``.tma``; neither changes a result). Every
kernel runs on a 1-D grid whose programs take their blocks a few row blocks at a time, rows
fastest (``tl_utils.swizzle``), so the programs resident together share hidden rows and
weight blocks in L2. GEMM operands are read through tensor descriptors (TMA on Hopper;
zeros out of bounds) where ``config.tma_ok`` allows, else through masked pointer loads;
both feed the same ``tl.dot`` sequence, and tests check the bits are equal.

Determinism. No atomics: every output element is written by exactly one program. Triton
compiles a separate variant of a kernel for integer arguments that are multiples of 16,
and another variant may contract or reorder the floating-point arithmetic differently
(observed: TP=1 and TP=2 entropies differing in the last bit). So sizes that vary with N
or with the shard are excluded from that specialization (``do_not_specialize``) where they
only bound rows (per-row masks cost nothing), and where a size bounds a contiguous
dimension, whose loads and stores vectorize only when it is a multiple of 16, the kernels
take it padded to a multiple of 128 (``K_PAD``, ``v_store``: the d_logits buffer holds exact
zeros there) and the true bound separately. Block sizes, splits and chunks are pinned
(never chosen from N), and each row's arithmetic involves only that row, so a row's
outputs and its grad_hidden row do not depend on N, on the other rows or on
``chunk_size``. Two launch choices do follow N, because neither changes that arithmetic:
the GEMM's output block width (``plan.mm_block_n``) and the vocabulary chunks per
backward launch (``plan.chunks_per_launch``).
"""

from __future__ import annotations

import torch

from lp_kernels.backends.triton.backward import (
    Chunk,
    DlogitsChunks,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
    run_chunks,
    upstream,
)
from lp_kernels.backends.triton.config import KernelConfig, config_for
from lp_kernels.backends.triton.forward import (
    forward_stats,
    gather_partials,
    merge_outputs,
    merged_extras,
)
from lp_kernels.backends.triton.gemm import matmul_acc
from lp_kernels.backends.triton.plan import chunks_per_launch, vocab_chunks
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.extras import NO_EXTRAS, mark_extras
from lp_kernels.core.matmul import addmm_f32_, scratch
from lp_kernels.core.stats import bias_grad
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def forward(hidden, weight, bias, targets, p: LogprobParams, cfg: KernelConfig):
    """``((logprob, entropy, lse), saved)``: the op's outputs and what the backward reads,
    ``(hidden, weight, bias, targets, lse, E)`` (hidden and targets as the kernels take
    them; E only with entropy)."""
    hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
    b_real = None if bias is None else bias[: w_real.shape[0]].float()
    extra = NO_EXTRAS
    if p.extras:  # the fused kernel, with the extras partials beside the softmax's
        stats, *parts = forward_stats(
            hidden, w_real, targets, p.vocab_start, p, cfg, b_real, extras=True
        )
    else:
        stats = forward_stats(hidden, w_real, targets, p.vocab_start, p, cfg, b_real)
    gathered = gather_partials(stats, p)  # TP: one partial per rank, then gathered
    lse, mean_z, outputs = merge_outputs(
        gathered, targets, p.ignore_index, entropy=p.return_entropy, return_lse=p.return_lse
    )
    if p.extras:
        extra = merged_extras(parts, lse, targets, p)
    return (*outputs, *extra), (hidden, weight, bias, targets, lse, mean_z)


class HiddenRows:
    """grad_hidden's fp32 rows: each chunk's ``d l @ W[chunk]`` added by lp's GEMM (the
    first chunk writes every element), each launch's K chunks summed apart and added in
    order (``chunk_k``)."""

    def __init__(self, hidden: torch.Tensor, v_real: int, cfg: KernelConfig):
        n, h_dim = hidden.shape
        alloc = scratch.empty if v_real > 0 else torch.zeros
        self.acc = alloc((n, h_dim), dtype=torch.float32, device=hidden.device)
        self.cfg = cfg

    def begin(self, chunk: Chunk) -> None:
        pass

    def add(self, chunk: Chunk, r0: int, r1: int, dl: torch.Tensor, cols: int) -> None:
        """``dl``'s zero columns up to ``cols`` keep the GEMM's K loads vectorized."""
        matmul_acc(
            self.acc[r0:r1],
            dl,
            chunk.weight,
            self.cfg,
            k_a=cols,
            accumulate=chunk.v_begin > 0,
            chunk_k=self.cfg.backward.vocab_chunk,
        )

    def end(self, chunk: Chunk) -> None:
        pass


class WeightRows:
    """grad_weight's rows of each chunk: one cuBLAS GEMM over all rows when N fits one token
    chunk (in place, input dtype), else an fp32 accumulation over token chunks, the first
    overwriting it (in place for fp32 weights, else in a ``[vocab_chunk, H]`` buffer copied
    out at the chunk's end)."""

    def __init__(self, weight, hidden, v_real: int, cfg: KernelConfig):
        n, h_dim = hidden.shape
        self.hidden = hidden
        self.grad = grad_weight_buffer(weight, v_real, n)
        self.one_chunk = min(cfg.backward.token_chunk, n) == n
        self.acc_w = None
        if not self.one_chunk and weight.dtype != torch.float32:
            rows = min(cfg.backward.vocab_chunk, v_real)
            self.acc_w = torch.empty((rows, h_dim), dtype=torch.float32, device=hidden.device)
        self.acc = None

    def begin(self, chunk: Chunk) -> None:
        self.slice = self.grad[chunk.v_begin : chunk.v_begin + chunk.v_count]
        if not self.one_chunk:
            self.acc = self.slice if self.acc_w is None else self.acc_w[: chunk.v_count]

    def add(self, chunk: Chunk, r0: int, r1: int, dl: torch.Tensor, cols: int) -> None:
        if self.one_chunk:
            grad_weight_slice(dl, self.hidden, self.slice)
        else:  # the first token chunk overwrites acc
            addmm_f32_(self.acc, dl.T, self.hidden[r0:r1], accumulate=r0 > 0)

    def end(self, chunk: Chunk) -> None:
        if self.acc_w is not None:
            self.slice.copy_(self.acc)


def backward(saved, grads: Grads, needs, p: LogprobParams, cfg: KernelConfig) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no) from the
    forward's ``saved`` tensors and the upstream gradients ``(g_lp, g_ent, g_lse)``."""
    hidden, weight, bias, targets, lse, mean_z = saved
    need_h, need_w, need_b = needs
    n, h_dim = hidden.shape
    v_real = p.local_real_columns(weight.shape[0])
    w_real = weight[:v_real]
    b_real = None if bias is None else bias[:v_real].float()
    acc_b = torch.zeros(v_real, dtype=torch.float32, device=hidden.device) if need_b else None
    rows_sink = HiddenRows(hidden, v_real, cfg) if need_h else None
    weight_sink = WeightRows(weight, hidden, v_real, cfg) if need_w else None
    rows = min(cfg.backward.token_chunk, n)
    sums = RowSums(
        rows_sink and rows_sink.acc, p.tp_group, p.tp_size, rows, need_h and p.reduce_grad_hidden
    )
    # one vocabulary chunk per launch, or (small N) several
    per_launch = chunks_per_launch(n, h_dim, v_real, cfg, hidden.device)
    chunks, width = vocab_chunks(v_real, cfg, per_launch)
    dl = DlogitsChunks(
        hidden,
        w_real,
        targets,
        p.vocab_start,
        (lse, mean_z),
        upstream(*grads),
        p,
        cfg,
        chunks,
        width,
        b_real,
        acc_b,
    )
    loop = (Chunk(b, c, w_real[b : b + c], blocks, final=b + c == v_real) for b, c, blocks in dl)
    run_chunks(loop, rows_sink, weight_sink, sums)
    grad_h = None
    if need_h:
        sums.finish()
        grad_h = rows_sink.acc.to(hidden.dtype)
    grad_w = None if weight_sink is None else weight_sink.grad
    return grad_h, grad_w, bias_grad(acc_b, bias)


class LinearLogprobTriton(torch.autograd.Function):
    """Fused Triton implementation: takes the launch config current at its forward
    (``config.config_for``), calls :func:`forward` and :func:`backward`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        ctx.cfg = config_for(hidden.device, hidden.dtype)
        outputs, saved = forward(hidden, weight, bias, targets, p, ctx.cfg)
        ctx.save_for_backward(*saved)
        ctx.params = p
        mark_extras(ctx, outputs)
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse, *_):
        needs = tuple(ctx.needs_input_grad[:3])
        grads = backward(ctx.saved_tensors, (g_lp, g_ent, g_lse), needs, ctx.params, ctx.cfg)
        return (*grads, None, None)
