"""The ``torch`` backend of ``linear_logprob``: chunked over rows, logits recomputed in backward.

Data flow for one rank (V_r = this shard's real columns, C = chunk rows)::

    forward   for each chunk of C rows (the last one zero-padded, lp_kernels.core.chunks):
                z = transform(h_c @ W_r^T + b)             [C, V_r] fp32 (GEMM, fp32 out)
                (m, s, a, t) per row  -> stats[N, 4]       (core.stats.local_stats)
              all-gather stats over tp_group -> [P, N, 4] -> merge in rank order
              -> logprob, entropy, lse (saved: lse, E)
              extras= (core.extras): each chunk's (x, q, u, i) per row from the same z,
              gathered and merged in rank order beside the statistics (no gradient)
    backward  for each chunk:
                z recomputed; d z = p * (g_lse - g_lp - g_ent (z - E)) + g_lp onehot
                d l = d z * dz/dl, rounded to the input dtype for the two GEMMs
                grad_h[c]  = d l @ W_r                     (fp32 out)
                grad_W_r  += d l^T @ h_c                   (fp32 accumulator)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

Memory: O(C x V_r) fp32 scratch (two such buffers at most), the fp32 grad_W accumulator
(V_local x H; it *is* the gradient for fp32 weights) and, under tensor parallelism, an fp32
[N, H] buffer for the grad_hidden all-reduce. Never [N, V].

Batch invariance (on CPU): a row's outputs and its grad_hidden row do not depend on N, on
the other rows or on ``chunk_size`` (every chunk has one shape; padding rows carry zero
upstream gradient). On CUDA this backend is run-to-run reproducible but NOT
batch-invariant: cuBLAS and torch's reductions choose their summation order from the shape
and even from a row's position in the chunk. The triton backend, the default on CUDA, is
batch-invariant there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lp_kernels.core.chunks import chunks, padded_rows
from lp_kernels.core.compile import backend_backward
from lp_kernels.core.extras import NO_EXTRAS, ExtraRows, extra_outputs, mark_extras, merge_extras
from lp_kernels.core.matmul import addmm_f32_, mm_f32, scratch
from lp_kernels.core.stats import (
    N_STATS,
    bias_grad,
    d_logits_,
    local_stats,
    masked_outputs,
    masked_upstream,
    merge_stats,
    target_columns,
)
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums, gather_stats

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def logits_chunks(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    p: LogprobParams,
    *,
    b_real: torch.Tensor | None = None,
    zero_rows: torch.Tensor | None = None,
    slope: bool = False,
) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(r0, r1, rows, h_c, z, s)`` per chunk: hidden rows ``[r0, r1)`` padded to
    ``rows``, ``z = transform(h_c W_r^T + b)`` (fp32 ``[rows, V_r]``; ``b_real``: the fp32 bias
    of ``w_real``'s rows, or None) and the transform's slope ``s`` (``slope`` and a cap;
    else None).

    Rows flagged in ``zero_rows [N]`` get the logits of a zero hidden row (``h_c`` itself is
    yielded unchanged): the backward's ignored rows, so that their d_logits are exact zeros
    even where their hidden state is not finite.
    """
    for r0, r1, rows in chunks(hidden.shape[0], p.chunk_size):
        h_c = padded_rows(hidden, r0, r1, rows)
        h_z = h_c
        if zero_rows is not None:
            h_z = torch.where(padded_rows(zero_rows, r0, r1, rows, False)[:, None], 0, h_c)
        z = mm_f32(h_z, w_real.T)  # [rows, V_r]
        if b_real is not None:
            z.add_(b_real)
        s = p.transform.apply_(z, slope=slope)
        yield r0, r1, rows, h_c, z, s


def dlogits_chunks(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    upstream: Grads,
    p: LogprobParams,
    *,
    first_id: int | None = None,
    b_real: torch.Tensor | None = None,
    grad_bias: torch.Tensor | None = None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Yield ``(r0, r1, h_c, d_l)`` per chunk: the padded hidden rows and ``d loss / d l``.

    ``d_l [rows, V_r]`` is rounded to the input dtype, ready for the two gradient GEMMs;
    padding rows and ignored rows have zero upstream gradient. ``w_real``'s first row is
    vocabulary id ``first_id`` (default: the shard's start). ``b_real``: the fp32 bias of
    ``w_real``'s rows, or None; ``grad_bias`` (fp32 ``[V_r]``, or None) gets each chunk's
    column sums of ``d_l`` (as rounded, summed in fp32) added, in chunk order.
    """
    v_real = w_real.shape[0]
    start = p.vocab_start if first_id is None else first_id
    t_local, in_shard, ignored = target_columns(targets, p.ignore_index, start, v_real)
    g_lp, g_ent, g_lse = masked_upstream(ignored, *upstream)
    if g_ent is not None and mean_z is None:
        raise RuntimeError("entropy gradient without return_entropy (internal error)")
    # ignored rows: logits of a zero row (the bias alone) and lse = +inf, E = 0, so that
    # p = 0 and d_logits = 0 * 0 exactly; padding rows likewise
    lse = torch.where(ignored, float("inf"), lse)
    mean_z = None if mean_z is None else torch.where(ignored, 0.0, mean_z)
    for r0, r1, rows, h_c, z, slope in logits_chunks(
        hidden, w_real, p, b_real=b_real, zero_rows=ignored, slope=True
    ):
        dz = d_logits_(
            z,
            padded_rows(lse, r0, r1, rows, float("inf")),
            _padded(mean_z, r0, r1, rows),
            padded_rows(t_local, r0, r1, rows),
            padded_rows(in_shard, r0, r1, rows, False),
            _padded(g_lp, r0, r1, rows),
            _padded(g_ent, r0, r1, rows),
            _padded(g_lse, r0, r1, rows),
        )
        dl = p.transform.chain_(dz, slope).to(hidden.dtype)
        if grad_bias is not None:  # the sums of what the gradient GEMMs read, in fp32
            grad_bias += dl.sum(dim=0, dtype=torch.float32)
        yield r0, r1, h_c, dl


def _padded(x: torch.Tensor | None, r0: int, r1: int, rows: int) -> torch.Tensor | None:
    return None if x is None else padded_rows(x, r0, r1, rows)


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    p: LogprobParams,
) -> tuple[tuple, torch.Tensor, torch.Tensor | None]:
    """``((logprob, entropy, lse), lse, E)``: the op's outputs (masked) and the raw
    statistics the backward reads (E, the softmax mean of z, only with entropy)."""
    n = hidden.shape[0]
    v_real = p.local_real_columns(weight.shape[0])
    b_real = None if bias is None else bias[:v_real].float()
    t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
    stats = scratch.empty((n, N_STATS), dtype=torch.float32, device=hidden.device)
    extra = ExtraRows(n, hidden.device) if p.extras else None
    for r0, r1, rows, _, z, _ in logits_chunks(hidden, weight[:v_real], p, b_real=b_real):
        if extra is not None:  # before local_stats turns z into z - m
            extra.add(r0, r1, z, p.vocab_start)
        part = torch.empty((rows, N_STATS), dtype=torch.float32, device=hidden.device)
        local_stats(
            z,
            padded_rows(t_local, r0, r1, rows),
            padded_rows(in_shard, r0, r1, rows, False),
            entropy=p.return_entropy,
            out=part,
        )
        stats[r0:r1] = part[: r1 - r0]
    gathered = gather_stats(stats, p.tp_group, p.tp_size)
    lse, mean_z, zt, ent = merge_stats(gathered, entropy=p.return_entropy)
    outputs = masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)
    return (*outputs, *merged_extras(extra, lse, targets, p)), lse, mean_z


def merged_extras(extra: ExtraRows | None, lse, targets, p: LogprobParams) -> tuple:
    """The ``extras=`` outputs from every rank's :class:`ExtraRows` (gathered, merged in rank
    order); :data:`NO_EXTRAS` without it."""
    if extra is None:
        return NO_EXTRAS
    x = gather_stats(extra.x, p.tp_group, p.tp_size)
    i = gather_stats(extra.i, p.tp_group, p.tp_size)
    return extra_outputs(*merge_extras(x, i), lse, targets, p)


class ChunkGrads:
    """The gradient GEMMs of each chunk's ``d l``, for the default and the loss paths:
    grad_hidden's rows (fp32 out; under tensor parallel an fp32 buffer whose rows are
    all-reduced as soon as they are final), grad_weight's fp32 accumulator and grad_bias'
    fp32 column sums (of what the GEMMs read)."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool], p: LogprobParams):
        need_h, need_w, need_b = needs
        n, h_dim = hidden.shape
        dev = hidden.device
        self.v_real = p.local_real_columns(weight.shape[0])
        self.w_real = weight[: self.v_real]
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.reduce = p.tp_size > 1 and p.reduce_grad_hidden
        self.grad_h = self.acc_w = self.acc_b = None
        if need_h:
            h_dtype = torch.float32 if self.reduce else hidden.dtype
            self.grad_h = scratch.empty((n, h_dim), dtype=h_dtype, device=dev)
        if need_w:
            self.acc_w = torch.zeros_like(weight, dtype=torch.float32)
        if need_b:
            self.acc_b = torch.zeros(self.v_real, dtype=torch.float32, device=dev)
        enabled = need_h and self.reduce
        self.sums = RowSums(self.grad_h, p.tp_group, p.tp_size, enabled=enabled)

    def add(self, r0: int, r1: int, h_c: torch.Tensor, dl: torch.Tensor) -> None:
        """The chunk of rows ``[r0, r1)``: ``h_c`` its hidden rows and ``dl`` its ``d l``
        (both padded to the chunk's rows; the padding rows of ``dl`` are zeros)."""
        if self.acc_b is not None:
            self.acc_b += dl.sum(dim=0, dtype=torch.float32)
        if self.grad_h is not None:
            self.grad_h[r0:r1] = mm_f32(dl, self.w_real)[: r1 - r0]
            self.sums.ready(r1)
        if self.acc_w is not None and self.v_real > 0:
            addmm_f32_(self.acc_w[: self.v_real], dl.T, h_c)

    def finish(self) -> Grads:
        """``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtypes (None where not
        needed), after grad_hidden's tensor-parallel sum."""
        grad_h = self.grad_h
        if grad_h is not None and self.reduce:
            self.sums.finish()
            grad_h = grad_h.to(self.hidden.dtype)
        grad_w = None if self.acc_w is None else self.acc_w.to(self.weight.dtype)
        return grad_h, grad_w, bias_grad(self.acc_b, self.bias)


def backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    upstream: Grads,
    needs: tuple[bool, bool, bool],
    p: LogprobParams,
) -> Grads:
    """``(grad_hidden, grad_weight, grad_bias)`` (None where ``needs`` says no) for the
    upstream gradients ``(g_lp, g_ent, g_lse)`` of the forward's outputs."""
    out = ChunkGrads(hidden, weight, bias, needs, p)
    b_real = None if bias is None else bias[: out.v_real].float()
    for r0, r1, h_c, dl in dlogits_chunks(
        hidden, out.w_real, targets, lse, mean_z, upstream, p, b_real=b_real
    ):
        out.add(r0, r1, h_c, dl)
    return out.finish()


class LinearLogprobTorch(torch.autograd.Function):
    """Chunked torch implementation: saves the inputs and the statistics, calls
    :func:`forward` and :func:`backward`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        outputs, lse, mean_z = forward(hidden, weight, bias, targets, p)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z)
        ctx.params = p
        mark_extras(ctx, outputs)
        return outputs

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse, *_):
        hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
        upstream = (g_lp, g_ent, g_lse)
        needs = tuple(ctx.needs_input_grad[:3])
        grads = backward(hidden, weight, bias, targets, lse, mean_z, upstream, needs, ctx.params)
        return (*grads, None, None)
