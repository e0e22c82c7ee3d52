"""The ``triton`` backend of ``linear_logprob_loss``: the forward kernel's logits kept for
the gradient, so the step runs three GEMMs.

Data flow for one rank (V_r = real columns, R = logits chunk rows, G = gradient chunk rows,
a multiple of R; both from :func:`chunk_rows`, never from N)::

    for each gradient chunk of G rows:
      for each logits chunk of R rows in it:
        fwd_stats_kernel (STORE_L): the forward's statistics, and the raw logits
            l = h W^T (+ b) (fp32) -> lbuf [R, V_r]
        all-gather over tp_group; merge_kernel -> logprob, entropy, lse (final)
        loss_fn -> g_lp, g_ent, g_lse per row
        dlogits_l_kernel: d l from lbuf, the d_logits kernel's arithmetic without its
            GEMM -> dl [G, V_r] (input dtype)
      grad_h[chunk] = dl @ W_r                               cuBLAS, fp32 out
      grad_W = dl^T @ h  (one chunk: in place, input dtype; else an fp32 accumulator)
    grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

The per-token outputs are the forward kernel's (batch-invariant, as ``linear_logprob``'s).
The gradients are reproducible run to run; cuBLAS chooses the GEMMs' kernels by shape, so
unlike ``linear_logprob``'s they are not batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.backward import (
    add_column_sums,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
)
from lp_kernels.backends.triton.config import (
    KernelConfig,
    compile_opts,
    config_for,
    launch_opts,
    pad128,
    sm_count,
)
from lp_kernels.backends.triton.forward import forward_stats, gather_partials, merge_outputs
from lp_kernels.backends.triton.plan import chunk_rows, logits_chunks, shard_splits
from lp_kernels.backends.triton.softmax import dlogits_block, dlogits_rows, transform_args
from lp_kernels.backends.triton.tl_utils import IGNORED, target_codes
from lp_kernels.core.loss import FinishedGradients, LossSpec, block_loss, block_values, finish
from lp_kernels.core.matmul import addmm_f32_, mm_f32, scratch
from lp_kernels.core.stats import bias_grad, ignored_rows
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums


@triton.jit(do_not_specialize=["N", "V", "ignore_index", "first_id"])
def dlogits_l_kernel(
    l_ptr,
    t_ptr,
    lse_ptr,
    mean_ptr,
    glp_ptr,
    gent_ptr,
    glse_ptr,
    dl_ptr,
    db_ptr,
    N,
    V,
    ignore_index,
    first_id,
    inv_t,
    cap,
    inv_cap,
    stride_ln,
    stride_dn,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCKS: tl.constexpr,
    ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    IGNORED: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    CAP: tl.constexpr,
    SCALE: tl.constexpr,
):
    """``d l`` of stored raw logits l (``h W^T + b``): ``softmax.dlogits_block``, the
    arithmetic of the backward's ``dlogits_kernel`` on the same l, without the GEMM that
    recomputes it.

    Each program covers ``BLOCKS`` consecutive ``[BLOCK_N, BLOCK_V]`` blocks of one row
    block. ``t_ptr``: the rows' raw target ids, ``first_id`` the id of column 0; ignored
    rows (code ``IGNORED``) get exact zeros whatever l holds. ``BIAS_GRAD``: each program
    writes the fp32 column sums of its blocks' stored d l to row ``i_n`` of ``db_ptr``
    (``[row blocks, V]``).
    """
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_l = l_ptr + o_n[:, None].to(tl.int64) * stride_ln
    p_d = dl_ptr + o_n[:, None].to(tl.int64) * stride_dn
    b_t = target_codes(t_ptr, o_n, m_n, ignore_index, first_id, V, IGNORED)
    b_lse, b_glp, b_glse, b_mean, b_gent = dlogits_rows(
        lse_ptr, glse_ptr, glp_ptr, gent_ptr, mean_ptr, o_n, m_n, ENTROPY, HAS_LP, HAS_LSE
    )
    for j in tl.static_range(BLOCKS):
        v0 = (tl.program_id(1) * BLOCKS + j) * BLOCK_V
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_2 = m_n[:, None] & (o_v < V)[None, :]
        b_l = tl.load(p_l + o_v[None, :], mask=m_2, other=0.0)
        b_dz = dlogits_block(
            b_l,
            b_t,
            b_lse,
            b_glp,
            b_glse,
            b_mean,
            b_gent,
            v0,
            scale,
            cap,
            inv_cap,
            inv_t,
            BLOCK_V,
            ENTROPY,
            HAS_LP,
            CAP,
            SCALE,
        )
        b_dz = tl.where(m_2 & (b_t != IGNORED)[:, None], b_dz, 0.0)
        b_dl = b_dz.to(dl_ptr.dtype.element_ty)
        tl.store(p_d + o_v[None, :], b_dl, mask=m_2)
        if BIAS_GRAD:  # the stored values' sums (what the gradient GEMMs read), in fp32
            tl.store(
                db_ptr + i_n.to(tl.int64) * V + o_v,
                tl.sum(b_dl.to(tl.float32), axis=0),
                mask=o_v < V,
            )


def dlogits_from_logits(
    logits, targets, lse, mean, grads, out, p: LogprobParams, cfg: KernelConfig, db=None
) -> None:
    """d_logits of the rows of ``logits [k, >= V]`` (raw fp32 logits ``h W^T (+ b)`` of V
    real columns from vocabulary id ``p.vocab_start``, V = ``out.shape[1]``) into ``out [k,
    V]``; ``targets``: the rows' raw ids, ``grads``: fp32 ``(g_lp, g_ent, g_lse)``
    (contiguous, or None); ``db``: None, or a contiguous fp32 ``[cdiv(k,
    loss.bias_block[0]), V]`` buffer for the row blocks' column sums."""
    k, v = out.shape
    if k == 0 or v == 0:
        return
    lc = cfg.loss
    block_n, block_v, blocks = lc.block if db is None else lc.bias_block
    g_lp, g_ent, g_lse = grads
    dlogits_l_kernel[(triton.cdiv(k, block_n), triton.cdiv(v, block_v * blocks))](
        l_ptr=logits,
        t_ptr=targets,
        lse_ptr=lse,
        mean_ptr=mean,
        glp_ptr=g_lp,
        gent_ptr=g_ent,
        glse_ptr=g_lse,
        dl_ptr=out,
        db_ptr=db,
        N=k,
        V=v,
        ignore_index=p.ignore_index,
        first_id=p.vocab_start,
        stride_ln=logits.stride(0),
        stride_dn=out.stride(0),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCKS=blocks,
        ENTROPY=g_ent is not None,
        HAS_LP=g_lp is not None,
        HAS_LSE=g_lse is not None,
        IGNORED=IGNORED,
        BIAS_GRAD=db is not None,
        **transform_args(p.transform),
        **launch_opts(lc, logits.device),
    )


@triton.jit(do_not_specialize=["numel"])
def scale_kernel(x_ptr, g_ptr, numel, BLOCK: tl.constexpr):
    """``x *= g`` in place, over blocks ``pid, pid + programs, ...``; nothing is read or
    written when g is 1 (the usual ``loss.backward()``), and no host sync is needed to
    know it."""
    b_g = tl.load(g_ptr).to(tl.float32)
    if b_g != 1.0:
        for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            o = start + tl.arange(0, BLOCK)  # int64 when numel is (past 2^31)
            m = o < numel
            b_x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
            tl.store(x_ptr + o, (b_x * b_g).to(x_ptr.dtype.element_ty), mask=m)


def scale_on_device_(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``grad *= g`` (``g`` a 0-d upstream gradient) by :func:`scale_kernel`: a pass over
    ``grad`` only where g is not 1. The product is rounded once, from fp32."""
    numel = grad.numel()
    if numel == 0:
        return grad
    block = 4096
    sms = sm_count(grad.device) or 4
    grid = (max(1, min(triton.cdiv(numel, block), 8 * sms)),)
    g = g.reshape(1).float()
    scale_kernel[grid](x_ptr=grad, g_ptr=g, numel=numel, BLOCK=block, **compile_opts(grad.device))
    return grad


class LossGrads:
    """The fused loss's gradients, chunk by chunk of ``d l``: grad_hidden's rows (cuBLAS,
    fp32 out; under tensor parallel their sum starts as they are final), grad_weight (one
    gradient chunk: in place, input dtype; else an fp32 accumulator, the first chunk
    overwriting) and grad_bias' fp32 column sums."""

    def __init__(self, hidden, weight, bias, v_real: int, needs, rows: tuple[int, int], p, cfg):
        need_h, need_w, need_b = needs
        n, h_dim = hidden.shape
        dev = hidden.device
        self.hidden, self.weight, self.bias, self.v_real = hidden, weight, bias, v_real
        self.reduce = p.tp_size > 1 and p.reduce_grad_hidden
        self.grad_h = self.grad_w = self.acc_w = self.acc_b = self.db = None
        if need_h:
            h_dtype = torch.float32 if self.reduce else hidden.dtype
            alloc = scratch.empty if v_real > 0 else torch.zeros
            self.grad_h = alloc((n, h_dim), dtype=h_dtype, device=dev)
        if need_w and n <= rows[1]:  # one gradient chunk: grad_W in place, input dtype
            self.grad_w = grad_weight_buffer(weight, v_real, n)
        elif need_w:
            self.acc_w = torch.zeros_like(weight, dtype=torch.float32)
        if need_b:
            self.acc_b = torch.zeros(v_real, dtype=torch.float32, device=dev)
            blocks = triton.cdiv(rows[0], cfg.loss.bias_block[0])  # [blocks, v_real] column sums
            self.db = scratch.empty((blocks, max(v_real, 1)), dtype=torch.float32, device=dev)
        enabled = need_h and self.reduce
        self.sums = RowSums(self.grad_h, p.tp_group, p.tp_size, enabled=enabled)

    def add(self, g0: int, g1: int, dl: torch.Tensor, w_real: torch.Tensor) -> None:
        """The gradient chunk of rows ``[g0, g1)`` and its ``dl [g1 - g0, V_r]``."""
        if self.grad_h is not None:
            self.grad_h[g0:g1] = mm_f32(dl, w_real)
            self.sums.ready(g1)
        if self.grad_w is not None and self.v_real > 0:
            grad_weight_slice(dl, self.hidden, self.grad_w[: self.v_real])
        elif self.acc_w is not None and self.v_real > 0:
            addmm_f32_(self.acc_w[: self.v_real], dl.T, self.hidden[g0:g1], accumulate=g0 > 0)

    def finish(self):
        grad_h = self.grad_h
        if grad_h is not None and self.reduce:
            self.sums.finish()
            grad_h = grad_h.to(self.hidden.dtype)
        grad_w = self.grad_w
        if self.acc_w is not None:
            grad_w = self.acc_w.to(self.weight.dtype)  # no copy for fp32 weights
        return grad_h, grad_w, bias_grad(self.acc_b, self.bias)


def _logits_chunk(hidden, w_real, b_real, targets, ignored, r0, r1, lbuf, p, cfg, spec):
    """Rows ``[r0, r1)``: the forward statistics (the raw logits kept in ``lbuf``), the
    outputs ``(token_loss, logprob, entropy, lse)``, the raw ``(lse, E)`` and the loss's
    per-row derivatives (None without gradients)."""
    t_c = targets[r0:r1]
    stats = forward_stats(hidden[r0:r1], w_real, t_c, p.vocab_start, p, cfg, b_real, lbuf)
    gathered = gather_partials(stats, p)  # TP: one partial per rank
    lse_c, mean_c, (lp_c, e_c, ls_c) = merge_outputs(
        gathered, t_c, p.ignore_index, entropy=p.return_entropy, return_lse=True
    )
    values = block_values(spec.per_token, r0, r1, r1 - r0)
    loss_c, g = block_loss(spec, lp_c, e_c, ls_c, ignored[r0:r1], values)
    return (loss_c, lp_c, e_c, ls_c), (lse_c, mean_c), g


def forward(hidden, weight, bias, targets, p: LogprobParams, spec: LossSpec, cfg: KernelConfig):
    """``((token_loss, logprob, entropy, lse), (grad_hidden, grad_weight, grad_bias))``: the
    per-token outputs (entropy None unless computed) and the loss's finished gradients
    (None where ``spec.needs`` says no)."""
    hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
    ignored = ignored_rows(targets, p.ignore_index)  # the loss function's dead rows
    n = hidden.shape[0]
    dev = hidden.device
    v_real = w_real.shape[0]
    b_real = None if bias is None else bias[:v_real].float()
    rows, g_rows = chunk_rows(p, cfg, hidden.element_size(), spec.block_rows)
    rows, g_rows = min(rows, max(n, 1)), min(g_rows, max(n, 1))
    width = pad128(max(v_real, 1))
    lbuf = scratch.empty((rows, width), dtype=torch.float32, device=dev)
    dl_buf = None
    if spec.any_grad:
        dl_buf = scratch.empty((g_rows, width), dtype=hidden.dtype, device=dev)
    outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4)]
    out = LossGrads(hidden, weight, bias, v_real, spec.needs, (rows, g_rows), p, cfg)
    _, splits = shard_splits(v_real, p, cfg)
    sms = sm_count(dev) if p.tp_size == 1 and spec.block_rows is None else None
    for g0 in range(0, n, g_rows):
        g1 = min(n, g0 + g_rows)
        r1 = g0
        for k in logits_chunks(g1 - g0, rows, cfg.logits.block_n, splits, sms):
            r0, r1 = r1, r1 + k
            args = (hidden, w_real, b_real, targets, ignored, r0, r1, lbuf[:k], p, cfg, spec)
            values, (lse_c, mean_c), g = _logits_chunk(*args)
            for o, x in zip(outs, values, strict=True):
                if x is not None:
                    o[r0:r1] = x
            if not spec.any_grad:
                continue
            part = None if out.db is None else out.db[: triton.cdiv(k, cfg.loss.bias_block[0])]
            part = None if part is None else part[:, :v_real]
            dl = dl_buf[r0 - g0 : r1 - g0, :v_real]
            # g: fp32 (g_lp, g_ent, g_lse), 0 on dead rows (block_loss)
            dlogits_from_logits(lbuf[:k], targets[r0:r1], lse_c, mean_c, g, dl, p, cfg, part)
            if part is not None:
                add_column_sums(out.acc_b, part)
        if spec.any_grad:
            out.add(g0, g1, dl_buf[: g1 - g0, :v_real], w_real)
    if not p.return_entropy:
        outs[2] = None
    return tuple(outs), out.finish()


class LinearLogprobLossTriton(FinishedGradients):
    """Fused Triton implementation of the loss: takes the launch config current at its
    forward, calls :func:`forward` and keeps its finished gradients for the backward
    (:class:`~lp_kernels.core.loss.FinishedGradients`; the scaling by the upstream
    gradient runs on the device, :func:`scale_on_device_`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams, spec: LossSpec):
        ctx.set_materialize_grads(False)
        cfg = config_for(hidden.device, hidden.dtype)
        outputs, grads = forward(hidden, weight, bias, targets, p, spec, cfg)
        ctx.scale = scale_on_device_
        return finish(ctx, outputs, grads, spec)
