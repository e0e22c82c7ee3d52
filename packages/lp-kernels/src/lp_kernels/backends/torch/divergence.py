"""The ``torch`` engine of the divergence ops: the student's and the teacher's softmax
arguments of a chunk of rows as fp32 torch tensors, and torch ops on them.

``linear_divergence`` takes the chunks of both heads' GEMMs (``torch.linear.logits_chunks``:
fp32 out, the transform applied); ``vocab_parallel_divergence`` reads the student's logits
and the teacher's log-probs a chunk of rows at a time (:func:`logit_chunks`). The host loop
and the merges are :mod:`lp_kernels.backends.divergence`'s.
"""

from __future__ import annotations

import torch

from lp_kernels.backends.torch.linear import logits_chunks
from lp_kernels.core.divergence import DivergenceParams, block_sums, d_student_


def _max_sum(x: torch.Tensor) -> torch.Tensor:
    """``[1, C, 2]``: ``(max, sum exp(x - max))`` per row of ``x [C, Vr]``; a row with no
    finite maximum here (no columns, or all ``-inf``) reports ``(-inf, 0)``."""
    out = torch.empty((1, x.shape[0], 2), dtype=torch.float32, device=x.device)
    if x.shape[1] == 0:
        out[0, :, 0], out[0, :, 1] = float("-inf"), 0.0
        return out
    m = x.amax(dim=1)
    out[0, :, 0] = m
    out[0, :, 1] = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[:, None]).sum(dim=1)
    return out


class TorchEngine:
    """A chunk's state is ``(z, s, y)``: the student's softmax arguments (fp32 ``[C, V_r]``),
    its transform's slope (backward with a cap, else None) and the teacher's."""

    @staticmethod
    def chunks(hidden, w_s, b_s, t_hidden, w_t, b_t, dp, *, backward=None):
        """``(r0, r1, h_c, state)`` per chunk of rows (padded to the call's chunk rows, as
        ``logits_chunks`` pads them) for real weight rows ``w_s``, ``w_t`` and their fp32
        biases (or None); ``backward``: the ignored rows, whose student logits are taken
        from a zero row, with the slope."""
        p = dp.student
        slope = backward is not None
        student = logits_chunks(hidden, w_s, p, b_real=b_s, zero_rows=backward, slope=slope)
        teacher = logits_chunks(t_hidden, w_t, dp.teacher, b_real=b_t)
        for (r0, r1, _, h_c, z, s), (*_, y, _) in zip(student, teacher, strict=True):
            yield r0, r1, h_c, (z, s, y)

    @staticmethod
    def lse_partials(state, dp: DivergenceParams):
        z, _, y = state
        return _max_sum(z), _max_sum(y)

    @staticmethod
    def local_sums(state, lse_s, lse_t, dp: DivergenceParams) -> torch.Tensor:
        z, _, y = state
        return block_sums(z, y, lse_s, lse_t, dp.kind, dp.beta)

    @staticmethod
    def dlogits(state, saved, g, dp: DivergenceParams) -> torch.Tensor:
        """fp32 ``d loss / d l`` of the chunk (in ``z``'s storage) for its saved statistics
        ``[C, 4]`` and upstream gradient ``g [C]`` (0 on ignored and padding rows)."""
        z, slope, y = state
        lse_s, lse_t, div, k = saved.unbind(dim=1)
        dz = d_student_(z, y, lse_s, lse_t, div, k, g, dp.kind, dp.beta)
        if slope is not None:  # a row with g = 0 may hold any logits (NaN: NaN slope)
            slope = torch.where(g[:, None] != 0, slope, 0.0)
        return dp.student.transform.chain_(dz, slope)


def logit_chunks(logits, teacher, dp: DivergenceParams, *, slope: bool = False):
    """``(r0, r1, state)`` per chunk of rows of ``vocab_parallel_divergence``: the student's
    softmax arguments (an fp32 copy of its logits, transformed), the slope (``slope`` and a
    cap, else None) and the teacher's log-probs (fp32) over this shard's real columns."""
    p = dp.student
    v_real = p.local_real_columns(logits.shape[1])
    for r0 in range(0, logits.shape[0], p.chunk_size):
        r1 = min(r0 + p.chunk_size, logits.shape[0])
        z = logits[r0:r1, :v_real].to(torch.float32, copy=True)
        s = p.transform.apply_(z, slope=slope)
        yield r0, r1, (z, s, teacher[r0:r1, :v_real].float())
