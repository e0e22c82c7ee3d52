"""The ``torch`` backend of ``linear_logprob_loss``: the logits of a chunk of rows computed
once, kept for its statistics and its gradient.

Data flow for one rank (V_r = this shard's real columns, C = chunk rows)::

    forward   for each chunk of C rows (the last zero-padded, as in linear.py):
                z = transform(h_c W_r^T + b)             [C, V_r] fp32 (GEMM, fp32 out)
                (m, s, a, t) per row; all-gather over tp_group; merge in rank order
                -> logprob, entropy, lse of the chunk    (final: the whole vocabulary)
                loss_fn on them -> g_lp, g_ent, g_lse per row
                d z from the kept z (no second logits GEMM); d l = d z * dz/dl
                grad_h[c]  = d l @ W_r      grad_W_r += d l^T @ h_c   (fp32)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False
    backward  the finished gradients times the loss's upstream gradient

Ignored rows take a zero hidden row for their logits (exact zero gradients even where
their hidden state is not finite), as in the backward of ``linear_logprob``.
"""

from __future__ import annotations

import torch

from lp_kernels.backends.torch.linear import ChunkGrads, Grads, logits_chunks
from lp_kernels.core.chunks import padded_rows
from lp_kernels.core.loss import FinishedGradients, LossSpec, block_loss, block_values, finish
from lp_kernels.core.stats import (
    N_STATS,
    d_logits_,
    local_stats,
    masked_outputs,
    merge_stats,
    target_columns,
)
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import gather_stats


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    p: LogprobParams,
    spec: LossSpec,
) -> tuple[tuple, Grads]:
    """``((token_loss, logprob, entropy, lse), (grad_hidden, grad_weight, grad_bias))``:
    the per-token outputs (entropy None unless computed) and the loss's finished gradients
    (None where ``spec.needs`` says no)."""
    n = hidden.shape[0]
    dev = hidden.device
    out = ChunkGrads(hidden, weight, bias, spec.needs, p)
    b_real = None if bias is None else bias[: out.v_real].float()
    cols = target_columns(targets, p.ignore_index, p.vocab_start, out.v_real)
    outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4)]
    slope = spec.any_grad and p.transform.capped
    for r0, r1, rows, h_c, z, z_slope in logits_chunks(
        hidden, out.w_real, p, b_real=b_real, zero_rows=cols[2], slope=slope
    ):
        fills = zip(cols, (0, False, True), strict=True)
        t_c, in_c, dead = (padded_rows(x, r0, r1, rows, fill) for x, fill in fills)
        part = torch.empty((rows, N_STATS), dtype=torch.float32, device=dev)
        local_stats(z, t_c, in_c, entropy=p.return_entropy, out=part)  # z -> z - m
        gathered = gather_stats(part, p.tp_group, p.tp_size)
        lse_c, mean_c, zt_c, ent_c = merge_stats(gathered, entropy=p.return_entropy)
        lp_c, e_c, ls_c = masked_outputs(dead, zt_c, lse_c, ent_c, return_lse=True)
        values = block_values(spec.per_token, r0, r1, rows)
        loss_c, g = block_loss(spec, lp_c, e_c, ls_c, dead, values)
        for o, x in zip(outs, (loss_c, lp_c, e_c, ls_c), strict=True):
            if x is not None:
                o[r0:r1] = x[: r1 - r0]
        if spec.any_grad:
            # z holds z - m (m: this shard's max): shift lse and E alike; dead rows get
            # lse = +inf, so p = 0 and d z = 0 exactly there
            shift = torch.where(part[:, 0] == float("-inf"), 0.0, part[:, 0])
            lse_s = torch.where(dead, float("inf"), lse_c - shift)
            mean_s = None if mean_c is None else torch.where(dead, 0.0, mean_c - shift)
            dz = d_logits_(z, lse_s, mean_s, t_c, in_c, *g)  # g: 0 on dead rows
            out.add(r0, r1, h_c, p.transform.chain_(dz, z_slope).to(hidden.dtype))
    if not p.return_entropy:
        outs[2] = None
    return tuple(outs), out.finish()


class LinearLogprobLossTorch(FinishedGradients):
    """Chunked torch implementation of the fused loss: calls :func:`forward` and keeps its
    finished gradients for the backward (:class:`~lp_kernels.core.loss.FinishedGradients`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams, spec: LossSpec):
        ctx.set_materialize_grads(False)
        outputs, grads = forward(hidden, weight, bias, targets, p, spec)
        return finish(ctx, outputs, grads, spec)
