"""``linear_divergence``'s autograd Function: the one host loop of both backends.

Data flow for one rank (V_r = this shard's real columns, C = chunk rows)::

    forward   for each chunk of C rows (an engine's chunks: its GEMMs of both heads):
                (max, sum exp) partials of z and of y     engine.lse_partials
                merged over the engine's splits, then all-gathered over tp_group and
                merged in rank order                      -> lse(z), lse(y)   [C]
                the chunk's sums (core.divergence)        engine.local_sums   [C, 4]
                all-gathered, added in rank order          -> D, entropies, K
              saved per row: lse(z), lse(y), D, K
    backward  for each chunk: d l (GEMM dtype)            engine.dlogits
              grad_h[c] = d l @ W_r, grad_W_r += d l^T @ h_c, grad_b += column sums
              (torch.linear.ChunkGrads; grad_h all-reduced over tp_group)

The engines: :class:`lp_kernels.backends.torch.divergence.TorchEngine` (torch ops on the
transformed logits) and ``lp_kernels.backends.triton.divergence.TritonEngine`` (Triton
kernels on the raw GEMM output: transform, statistics and d l in one pass each). Under
tensor parallel every chunk makes two all-gathers of ``[C, k]``: every rank uses the same
chunk rows (the per-call rank record checks ``chunk_size``). Run-to-run reproducible; a
row's last bits depend on the shard layout and, with the triton engine, on the chunk rows.
Each Function's passes are host functions (:func:`host_forward`, :func:`host_backward`,
:func:`logits_forward`, :func:`logits_backward`, :func:`loss_forward`) that the custom ops of
``lp_kernels.library_divergence`` call as well.
"""

from __future__ import annotations

import torch

from lp_kernels.backends.torch.divergence import TorchEngine, logit_chunks
from lp_kernels.backends.torch.linear import ChunkGrads
from lp_kernels.core.chunks import padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.divergence import N_SAVED, N_SUMS, DivergenceParams
from lp_kernels.core.loss import FinishedGradients
from lp_kernels.core.matmul import scratch
from lp_kernels.core.stats import masked_upstream, merge_stats
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import gather_stats


def engine_of(dp: DivergenceParams):
    """The engine of ``dp.backend`` (:class:`TorchEngine` or the triton one)."""
    if dp.backend == "triton":  # imported here: triton is optional
        from lp_kernels.backends.triton.divergence import TritonEngine

        return TritonEngine
    return TorchEngine


def merged_lse(parts: torch.Tensor) -> torch.Tensor:
    """``[C]`` log-sum-exp of ``[S, C, 2]`` ``(max, sum exp(. - max))`` partials, merged over
    the first axis as one reduction (its bits follow the shape, not the layout)."""
    m, s = parts.unbind(dim=2)  # [S, C] each
    big = m.amax(dim=0)
    safe = torch.where(big == float("-inf"), 0.0, big)
    return big + torch.log((torch.exp(m - safe) * s).sum(dim=0))


def as_partial(lse: torch.Tensor) -> torch.Tensor:
    """``[C, 2]``: a log-sum-exp as the partial ``(lse, 1)`` (``(-inf, 0)`` when empty)."""
    return torch.stack([lse, (lse > float("-inf")).float()], dim=1)


def whole_lse(parts: torch.Tensor, p: LogprobParams) -> torch.Tensor:
    """The rows' log-sum-exp over the whole vocabulary from this rank's ``[S, C, 2]``
    partials: merged over ``S``, then over ``tp_group`` in rank order."""
    lse = merged_lse(parts)
    if p.tp_size == 1:
        return lse
    gathered = gather_stats(as_partial(lse), p.tp_group, p.tp_size)
    zeros = torch.zeros_like(gathered)
    return merge_stats(torch.cat([gathered, zeros], dim=2), entropy=False)[0]


def whole_sums(local: torch.Tensor, p: LogprobParams) -> torch.Tensor:
    """``[C, k]`` sums over the whole vocabulary: every rank's, added in rank order."""
    parts = gather_stats(local, p.tp_group, p.tp_size)
    sums = parts[0]
    for r in range(1, parts.shape[0]):
        sums = sums + parts[r]
    return sums


def row_outputs(ignored: torch.Tensor, sums: torch.Tensor) -> tuple:
    """``(divergence, student entropy, teacher entropy)`` ``[N]`` from the rows' sums, 0 on
    ignored rows."""
    return tuple(torch.where(ignored, 0.0, sums[:, j]) for j in range(3))


def finish_forward(ctx, dp: DivergenceParams, saved: tuple, ignored, sums) -> tuple:
    """Save ``saved`` and ``dp`` on ``ctx``; return :func:`row_outputs`, the entropies not
    differentiable."""
    ctx.save_for_backward(*saved)
    ctx.params = dp
    outputs = row_outputs(ignored, sums)
    ctx.mark_non_differentiable(*outputs[1:])
    return outputs


def real_heads(weight, bias, t_weight, t_bias, p: LogprobParams) -> tuple:
    """``(w_s, b_s, w_t, b_t)``: both heads' real rows and fp32 biases (or None)."""
    v = p.local_real_columns(weight.shape[0])
    b_s = None if bias is None else bias[:v].float()
    b_t = None if t_bias is None else t_bias[:v].float()
    return weight[:v], b_s, t_weight[:v], b_t


def chunk_forward(engine, state, dp: DivergenceParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saved [C, 4], sums [C, 5])`` of one chunk: its rows' lse(z), lse(y), divergence
    and ``K``, and their sums (``core.divergence.N_SUMS``) over the whole vocabulary."""
    p = dp.student
    parts_s, parts_t = engine.lse_partials(state, dp)
    lse_s, lse_t = whole_lse(parts_s, p), whole_lse(parts_t, p)
    sums = whole_sums(engine.local_sums(state, lse_s, lse_t, dp), p)
    saved = torch.stack([lse_s, lse_t, sums[:, 0], sums[:, 3]], dim=1)
    return saved, sums


def add_chunk_grads(out: ChunkGrads, engine, state, rows: tuple, saved, g, ignored, dp) -> None:
    """One chunk's ``d l`` (the engine's, for its saved statistics ``[C, 4]`` and the rows'
    upstream ``g [N]``) into the gradient GEMMs of ``out``; ``rows = (r0, r1, h_c)``."""
    r0, r1, h_c = rows
    c = h_c.shape[0]
    dl = engine.dlogits(state, saved, padded_rows(g, r0, r1, c), dp)
    # ignored rows' hidden may be anything (NaN): their d l is 0, keep 0 * h out
    h_c = torch.where(padded_rows(ignored, r0, r1, c, False)[:, None], 0, h_c)
    out.add(r0, r1, h_c, dl.to(h_c.dtype))


def host_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, dp: DivergenceParams):
    """``(saved [N, 4], sums [N, 5])``: :class:`LinearDivergence`'s forward on the prepared
    heads (its rows' statistics for the backward, and their sums)."""
    engine = engine_of(dp)
    n = hidden.shape[0]
    saved = scratch.empty((n, N_SAVED), dtype=torch.float32, device=hidden.device)
    sums = scratch.empty((n, N_SUMS), dtype=torch.float32, device=hidden.device)
    w_s, b_s, w_t, b_t = real_heads(weight, bias, t_weight, t_bias, dp.student)
    for r0, r1, _, state in engine.chunks(hidden, w_s, b_s, t_hidden, w_t, b_t, dp):
        rows_saved, rows_sums = chunk_forward(engine, state, dp)
        saved[r0:r1] = rows_saved[: r1 - r0]
        sums[r0:r1] = rows_sums[: r1 - r0]
    return saved, sums


def host_backward(kept: tuple, g_div: torch.Tensor, needs: tuple, dp: DivergenceParams):
    """``(grad_hidden, grad_weight, grad_bias)`` of :class:`LinearDivergence` for the forward's
    ``kept = (hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, saved)``."""
    hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, saved = kept
    engine = engine_of(dp)
    out = ChunkGrads(hidden, weight, bias, needs, dp.student)
    (g,) = masked_upstream(ignored, g_div)
    w_s, b_s, w_t, b_t = real_heads(weight, bias, t_weight, t_bias, dp.student)
    chunks = engine.chunks(hidden, w_s, b_s, t_hidden, w_t, b_t, dp, backward=ignored)
    for r0, r1, h_c, state in chunks:
        rows_saved = padded_rows(saved, r0, r1, h_c.shape[0])
        add_chunk_grads(out, engine, state, (r0, r1, h_c), rows_saved, g, ignored, dp)
    return out.finish()


class LinearDivergence(torch.autograd.Function):
    """``linear_divergence``. Inputs: the student's ``hidden [N, H]``, ``weight``, ``bias``,
    the teacher's, ``ignored [N]`` bool and :class:`DivergenceParams`; outputs
    ``(divergence, student entropy, teacher entropy)`` ``[N]`` fp32, the entropies not
    differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, dp):
        ctx.set_materialize_grads(False)
        heads = (hidden, weight, bias, t_hidden, t_weight, t_bias)
        saved, sums = host_forward(*heads, dp)
        return finish_forward(ctx, dp, (*heads, ignored, saved), ignored, sums)

    @staticmethod
    @backend_backward
    def backward(ctx, g_div, *_):
        needs = tuple(ctx.needs_input_grad[:3])
        if g_div is None or not any(needs):
            return (None,) * 8
        grads = host_backward(ctx.saved_tensors, g_div, needs, ctx.params)
        return (*grads, None, None, None, None, None)


def logits_forward(logits, teacher, dp: DivergenceParams):
    """``(saved [N, 4], sums [N, 5])``: :class:`VocabParallelDivergence`'s forward."""
    n = logits.shape[0]
    saved = scratch.empty((n, N_SAVED), dtype=torch.float32, device=logits.device)
    sums = scratch.empty((n, N_SUMS), dtype=torch.float32, device=logits.device)
    for r0, r1, state in logit_chunks(logits, teacher, dp):
        saved[r0:r1], sums[r0:r1] = chunk_forward(TorchEngine, state, dp)
    return saved, sums


def logits_backward(logits, teacher, ignored, saved, g_div, dp: DivergenceParams):
    """``grad_logits`` of :class:`VocabParallelDivergence` (``saved``: the forward's)."""
    (g,) = masked_upstream(ignored, g_div)
    grad = torch.zeros_like(logits)
    for r0, r1, state in logit_chunks(logits, teacher, dp, slope=True):
        dl = TorchEngine.dlogits(state, saved[r0:r1], g[r0:r1], dp)
        grad[r0:r1, : dl.shape[1]] = dl
    return grad


class VocabParallelDivergence(torch.autograd.Function):
    """``vocab_parallel_divergence`` (torch engine): inputs ``logits [N, V_local]``,
    ``teacher_logprobs [N, V_local]``, ``ignored [N]`` and :class:`DivergenceParams`;
    outputs as :class:`LinearDivergence`'s, the divergence differentiable into ``logits``
    (zero on padding columns and ignored rows)."""

    @staticmethod
    def forward(ctx, logits, teacher, ignored, dp):
        ctx.set_materialize_grads(False)
        saved, sums = logits_forward(logits, teacher, dp)
        return finish_forward(ctx, dp, (logits, teacher, ignored, saved), ignored, sums)

    @staticmethod
    @backend_backward
    def backward(ctx, g_div, *_):
        logits, teacher, ignored, saved = ctx.saved_tensors
        if g_div is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        return logits_backward(logits, teacher, ignored, saved, g_div, ctx.params), None, None, None


def loss_forward(heads: tuple, ignored, w, needs: tuple, dp: DivergenceParams) -> tuple:
    """``(loss, (divergence, student entropy, teacher entropy), (grad_hidden, grad_weight,
    grad_bias))`` of :class:`LinearDivergenceLoss` for the prepared ``heads = (hidden,
    weight, bias, t_hidden, t_weight, t_bias)`` and row weights ``w [N]`` fp32: the loss's
    gradients for an upstream gradient of 1 (None where ``needs`` is False)."""
    hidden, weight, bias, t_hidden, t_weight, t_bias = heads
    engine = engine_of(dp)
    out = ChunkGrads(hidden, weight, bias, needs, dp.student) if any(needs) else None
    (g,) = masked_upstream(ignored, w)
    sums = scratch.empty((hidden.shape[0], N_SUMS), dtype=torch.float32, device=hidden.device)
    w_s, b_s, w_t, b_t = real_heads(weight, bias, t_weight, t_bias, dp.student)
    chunks = engine.chunks(hidden, w_s, b_s, t_hidden, w_t, b_t, dp, backward=ignored)
    for r0, r1, h_c, state in chunks:
        saved, rows_sums = chunk_forward(engine, state, dp)
        sums[r0:r1] = rows_sums[: r1 - r0]
        if out is not None:
            add_chunk_grads(out, engine, state, (r0, r1, h_c), saved, g, ignored, dp)
    grads = (None, None, None) if out is None else out.finish()
    per_row = row_outputs(ignored, sums)
    return (per_row[0] * g).sum(), per_row, grads


class LinearDivergenceLoss(FinishedGradients):
    """``linear_divergence_loss``: ``sum_n w_n D_n`` with the gradients finished in the
    forward. Each chunk's logits are computed once: its statistics, sums and ``d l`` (for the
    upstream ``w``) from them, then the two gradient GEMMs, so a step costs four GEMMs where
    the op and ``backward()`` cost six. The backward scales the kept gradients by the loss's
    upstream gradient (``core.loss.FinishedGradients``). Inputs as
    :class:`LinearDivergence`'s and ``w [N]`` fp32; outputs ``(loss, divergence, student
    entropy, teacher entropy)``, only the loss differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, w, dp):
        ctx.set_materialize_grads(False)
        needs = (
            hidden.requires_grad,
            weight.requires_grad,
            bias is not None and bias.requires_grad,
        )
        heads = (hidden, weight, bias, t_hidden, t_weight, t_bias)
        loss, per_row, ctx.grads = loss_forward(heads, ignored, w, needs, dp)
        ctx.op, ctx.constants = "linear_divergence_loss", 6
        ctx.mark_non_differentiable(*per_row)
        return loss, *per_row
