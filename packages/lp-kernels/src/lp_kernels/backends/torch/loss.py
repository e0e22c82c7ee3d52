"""The ``torch`` backend of ``linear_logprob_loss``: the logits of a block of rows computed
once, kept for its statistics and its gradient.

Data flow for one rank (V_r = this shard's real columns, C = block rows)::

    forward   for each block of C token rows (the last zero-padded, as in linear.py):
                z = softcap(h_c W_r^T + b) / T          [C, V_r] fp32 (GEMM, fp32 out)
                (m, s, a, t) per row; all-gather over tp_group; merge in rank order
                -> logprob, entropy, lse of the block    (final: the whole vocabulary)
                loss_fn on them under autograd -> g_lp, g_ent, g_lse per row
                d z from the kept z (no second logits GEMM); d l = d z / T (x slope)
                grad_h[c]  = d l @ W_r      grad_W_r += d l^T @ h_c   (fp32)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False
    backward  the finished gradients times the loss's upstream gradient

Ignored rows take a zero hidden row for their logits (exact zero gradients even where
their hidden state is not finite), as in the backward of ``linear_logprob``.
"""

from __future__ import annotations

import torch

from lp_kernels._loss import FinishedGradients, LossSpec, block_loss, block_values, finish
from lp_kernels._matmul import addmm_f32_, mm_f32, scratch
from lp_kernels._stats import (
    N_STATS,
    d_logits_,
    local_stats,
    masked_outputs,
    merge_stats,
    target_columns,
)
from lp_kernels._types import LogprobParams
from lp_kernels.backends.torch.linear import bias_grad, capped_logits_chunks, padded_rows
from lp_kernels.distributed.collectives import RowSums, gather_stats


class LinearLogprobLossTorch(FinishedGradients):
    """Chunked torch implementation of the fused loss; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams, spec: LossSpec):
        ctx.set_materialize_grads(False)
        n, h_dim = hidden.shape
        dev = hidden.device
        need_h, need_w, need_b = spec.needs
        grad = spec.any_grad
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        b_real = None if bias is None else bias[:v_real].float()
        t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
        outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4)]
        token_loss, logprob, entropy, lse = outs
        reduce_h = p.tp_size > 1 and p.reduce_grad_hidden
        grad_h = acc_w = acc_b = None
        if need_h:
            h_dtype = torch.float32 if reduce_h else hidden.dtype
            grad_h = scratch.empty((n, h_dim), dtype=h_dtype, device=dev)
        if need_w:
            acc_w = torch.zeros_like(weight, dtype=torch.float32)
        if need_b:
            acc_b = torch.zeros(v_real, dtype=torch.float32, device=dev)
        sums = RowSums(grad_h, p.tp_group, p.tp_size, enabled=need_h and reduce_h)
        slope = grad and p.softcap is not None
        for r0, r1, rows, h_c, z, cap_slope in capped_logits_chunks(
            hidden, w_real, p, ignored, b_real, slope=slope
        ):
            k = r1 - r0
            dead = padded_rows(ignored, r0, r1, rows, True)
            t_c = padded_rows(t_local, r0, r1, rows)
            in_c = padded_rows(in_shard, r0, r1, rows, False)
            part = torch.empty((rows, N_STATS), dtype=torch.float32, device=dev)
            local_stats(z, t_c, in_c, entropy=p.return_entropy, out=part)  # z -> z - m
            gathered = gather_stats(part, p.tp_group, p.tp_size)
            lse_c, mean_c, zt_c, ent_c = merge_stats(gathered, entropy=p.return_entropy)
            lp_c, e_c, ls_c = masked_outputs(dead, zt_c, lse_c, ent_c, return_lse=True)
            values = block_values(spec.per_token, r0, r1, rows)
            loss_c, g = block_loss(spec, lp_c, e_c, ls_c, dead, values)
            for out, x in zip(outs, (loss_c, lp_c, e_c, ls_c), strict=True):
                if x is not None:
                    out[r0:r1] = x[:k]
            if not grad:
                continue
            g_lp, g_ent, g_lse = g  # fp32, 0 on dead rows (block_loss)
            # z holds z - m (m: this shard's max): shift lse and E alike; dead rows get
            # lse = +inf, so p = 0 and d z = 0 exactly there
            m = part[:, 0]
            shift = torch.where(m == float("-inf"), 0.0, m)
            lse_s = torch.where(dead, float("inf"), lse_c - shift)
            mean_s = None if mean_c is None else torch.where(dead, 0.0, mean_c - shift)
            dz = d_logits_(z, lse_s, mean_s, t_c, in_c, g_lp, g_ent, g_lse)
            if p.temperature != 1.0:
                dz.mul_(p.inv_temperature)
            if cap_slope is not None:  # d l = d z / T * (1 - tanh^2)
                dz.mul_(cap_slope)
            dl = dz.to(hidden.dtype)
            if acc_b is not None:  # the sums of what the gradient GEMMs read, in fp32
                acc_b += dl.sum(dim=0, dtype=torch.float32)
            if need_h:
                grad_h[r0:r1] = mm_f32(dl, w_real)[:k]
                sums.ready(r1)
            if need_w and v_real > 0:
                addmm_f32_(acc_w[:v_real], dl.T, h_c)
        if not p.return_entropy:
            entropy = None
        if need_h and reduce_h:
            sums.finish()
            grad_h = grad_h.to(hidden.dtype)
        grad_w = acc_w.to(weight.dtype) if need_w else None  # no copy for fp32 weights
        grads = (grad_h, grad_w, bias_grad(acc_b, bias))
        return finish(ctx, (token_loss, logprob, entropy, lse), grads, spec)
