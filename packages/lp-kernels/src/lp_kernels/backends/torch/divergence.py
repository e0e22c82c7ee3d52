"""The ``torch`` backend of ``linear_divergence`` and ``vocab_parallel_divergence``: chunked
over rows, logits recomputed in backward.

Data flow for one rank (V_r = this shard's real columns, C = chunk rows)::

    forward   for each chunk of C rows:
                z = transform_s(h_c W_r^T + b)      y = transform_t(ht_c Wt_r^T + bt)
                                                    [C, V_r] fp32 each (GEMMs, fp32 out)
                (max, sum exp) of z and of y        [C, 4]  -> all-gather, merge in rank
                                                               order -> lse(z), lse(y)
                the chunk's sums (core.divergence)  [C, 4]  -> all-gather, add in rank order
              -> divergence, entropies (saved: lse(z), lse(y), D, K)
    backward  for each chunk: z, y recomputed; d z (core.divergence.d_student_)
                d l = d z * dz/dl, rounded to the input dtype for the two GEMMs
                grad_h[c] = d l @ W_r,  grad_W_r += d l^T @ h_c  (torch.linear.ChunkGrads)

``vocab_parallel_divergence`` reads ``z`` from the student's logits and ``y`` from the
teacher's log-probs, chunk by chunk, and returns ``grad_logits``.

Under tensor parallel every chunk makes two all-gathers of ``[C, 4]``: every rank must use
the same ``chunk_size`` (the per-call rank record checks it). Run-to-run reproducible; a
row's results depend on the shard layout in the last bits (the sums follow the shards).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lp_kernels.backends.torch.linear import ChunkGrads, logits_chunks
from lp_kernels.core.chunks import padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.divergence import N_SUMS, block_sums, d_student_
from lp_kernels.core.matmul import scratch
from lp_kernels.core.stats import masked_upstream, merge_stats
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import gather_stats

N_SAVED = 4
"""Per-row statistics the backward reads: lse(z), lse(y), the divergence, ``K``."""


@dataclass(frozen=True)
class DivergenceParams:
    """One divergence call's resolved options: the student's :class:`LogprobParams` (its
    transform, layout, chunk), the teacher's transform, the kind and ``beta``."""

    student: LogprobParams
    teacher_transform: LogitTransform
    kind: str
    beta: float

    @property
    def teacher(self) -> LogprobParams:
        """The student's params with the teacher's transform."""
        return dataclasses.replace(self.student, transform=self.teacher_transform)


def _max_sum(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out [C, 2] = (max, sum exp(x - max))`` per row of ``x [C, Vr]``; a row with no
    finite maximum here (no columns, or all ``-inf``) reports ``(-inf, 0)``."""
    if x.shape[1] == 0:
        out[:, 0], out[:, 1] = float("-inf"), 0.0
        return
    m = x.amax(dim=1)
    out[:, 0] = m
    out[:, 1] = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[:, None]).sum(dim=1)


def _lse(gathered: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp of ``[P, C, 2]`` partials, merged in rank order."""
    zeros = torch.zeros_like(gathered)
    return merge_stats(torch.cat([gathered, zeros], dim=2), entropy=False)[0]


def chunk_forward(z, y, dp: DivergenceParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saved [C, 4], sums [C, 4])`` of one chunk: the rows' lse(z), lse(y), divergence
    and ``K``, and their divergence, entropies and ``K`` (whole rows: merged over
    ``tp_group``)."""
    p = dp.student
    part = torch.empty((z.shape[0], 4), dtype=torch.float32, device=z.device)
    _max_sum(z, part[:, :2])
    _max_sum(y, part[:, 2:])
    gathered = gather_stats(part, p.tp_group, p.tp_size)
    lse_s, lse_t = _lse(gathered[..., :2]), _lse(gathered[..., 2:])
    local = block_sums(z, y, lse_s, lse_t, dp.kind, dp.beta)
    parts = gather_stats(local, p.tp_group, p.tp_size)
    sums = parts[0]
    for r in range(1, parts.shape[0]):  # rank order
        sums = sums + parts[r]
    saved = torch.stack([lse_s, lse_t, sums[:, 0], sums[:, 3]], dim=1)
    return saved, sums


def finished(ignored: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(divergence, student entropy, teacher entropy)`` ``[N]``, 0 on ignored rows."""
    return tuple(torch.where(ignored, 0.0, sums[:, j]) for j in range(3))


def chunk_backward(z, y, saved, g, dp: DivergenceParams, slope) -> torch.Tensor:
    """``d loss / d l`` (fp32, in ``z``'s storage) of one chunk for its saved statistics
    ``[C, 4]`` and upstream gradient ``g [C]`` (0 on ignored and padding rows)."""
    lse_s, lse_t, div, k = saved.unbind(dim=1)
    dz = d_student_(z, y, lse_s, lse_t, div, k, g, dp.kind, dp.beta)
    return dp.student.transform.chain_(dz, slope)


def _pairs(hidden, weight, bias, t_hidden, t_weight, t_bias, dp, *, zero_rows=None, slope=False):
    """The student's and the teacher's chunks side by side: ``(r0, r1, rows, h_c, z, s, y)``
    (see ``torch.linear.logits_chunks``)."""
    p = dp.student
    v_real = p.local_real_columns(weight.shape[0])
    b_s = None if bias is None else bias[:v_real].float()
    b_t = None if t_bias is None else t_bias[:v_real].float()
    student = logits_chunks(
        hidden, weight[:v_real], p, b_real=b_s, zero_rows=zero_rows, slope=slope
    )
    teacher = logits_chunks(t_hidden, t_weight[:v_real], dp.teacher, b_real=b_t)
    for (r0, r1, rows, h_c, z, s), (*_, y, _) in zip(student, teacher, strict=True):
        yield r0, r1, rows, h_c, z, s, y


class LinearDivergenceTorch(torch.autograd.Function):
    """``linear_divergence`` on chunked torch ops. Inputs: the student's ``hidden [N, H]``,
    ``weight``, ``bias``, the teacher's, ``ignored [N]`` bool and :class:`DivergenceParams`;
    outputs ``(divergence, student entropy, teacher entropy)`` ``[N]`` fp32 (the entropies
    not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, dp):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        saved = scratch.empty((n, N_SAVED), dtype=torch.float32, device=hidden.device)
        sums = scratch.empty((n, N_SUMS), dtype=torch.float32, device=hidden.device)
        for r0, r1, _, _, z, _, y in _pairs(hidden, weight, bias, t_hidden, t_weight, t_bias, dp):
            rows_saved, rows_sums = chunk_forward(z, y, dp)
            saved[r0:r1] = rows_saved[: r1 - r0]
            sums[r0:r1] = rows_sums[: r1 - r0]
        ctx.save_for_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, saved)
        ctx.params = dp
        outputs = finished(ignored, sums)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_div, *_):
        hidden, weight, bias, t_hidden, t_weight, t_bias, ignored, saved = ctx.saved_tensors
        dp = ctx.params
        needs = tuple(ctx.needs_input_grad[:3])
        if g_div is None or not any(needs):
            return (None,) * 8
        out = ChunkGrads(hidden, weight, bias, needs, dp.student)
        (g,) = masked_upstream(ignored, g_div)
        for r0, r1, rows, h_c, z, slope, y in _pairs(
            hidden, weight, bias, t_hidden, t_weight, t_bias, dp, zero_rows=ignored, slope=True
        ):
            g_c = padded_rows(g, r0, r1, rows)
            dl = chunk_backward(z, y, padded_rows(saved, r0, r1, rows), g_c, dp, slope)
            # ignored rows' hidden may be anything (NaN): their d l is 0, keep 0 * h out
            h_c = torch.where(padded_rows(ignored, r0, r1, rows, False)[:, None], 0, h_c)
            out.add(r0, r1, h_c, dl.to(hidden.dtype))
        return (*out.finish(), None, None, None, None, None)


class VocabParallelDivergenceTorch(torch.autograd.Function):
    """``vocab_parallel_divergence``: inputs ``logits [N, V_local]``, ``teacher_logprobs
    [N, V_local]``, ``ignored [N]`` and :class:`DivergenceParams`; outputs as
    :class:`LinearDivergenceTorch`'s, the divergence differentiable into ``logits``."""

    @staticmethod
    def forward(ctx, logits, teacher, ignored, dp):
        ctx.set_materialize_grads(False)
        n = logits.shape[0]
        saved = scratch.empty((n, N_SAVED), dtype=torch.float32, device=logits.device)
        sums = scratch.empty((n, N_SUMS), dtype=torch.float32, device=logits.device)
        for r0, r1, z, _, y in _logit_chunks(logits, teacher, dp):
            saved[r0:r1], sums[r0:r1] = chunk_forward(z, y, dp)
        ctx.save_for_backward(logits, teacher, ignored, saved)
        ctx.params = dp
        outputs = finished(ignored, sums)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_div, *_):
        logits, teacher, ignored, saved = ctx.saved_tensors
        dp = ctx.params
        if g_div is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        (g,) = masked_upstream(ignored, g_div)
        grad = torch.zeros_like(logits)
        for r0, r1, z, slope, y in _logit_chunks(logits, teacher, dp, slope=True):
            dl = chunk_backward(z, y, saved[r0:r1], g[r0:r1], dp, slope)
            grad[r0:r1, : dl.shape[1]] = dl
        return grad, None, None, None


def _logit_chunks(logits, teacher, dp: DivergenceParams, *, slope: bool = False):
    """``(r0, r1, z, s, y)`` per chunk of rows: the student's softmax arguments ``z`` (fp32
    ``[C, V_r]``), the transform's slope ``s`` (``slope`` and a cap, else None) and the
    teacher's log-probs ``y`` (fp32) over this shard's real columns."""
    p = dp.student
    v_real = p.local_real_columns(logits.shape[1])
    for r0 in range(0, logits.shape[0], p.chunk_size):
        r1 = min(r0 + p.chunk_size, logits.shape[0])
        z = logits[r0:r1, :v_real].to(torch.float32, copy=True)
        s = p.transform.apply_(z, slope=slope)
        yield r0, r1, z, s, teacher[r0:r1, :v_real].float()
