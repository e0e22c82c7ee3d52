"""The ``torch`` backend of ``linear_logprob``: chunked over tokens, logits recomputed in backward.

Data flow for one rank (V_r = this shard's real columns, C = chunk rows)::

    forward   for each chunk of C token rows (last one zero-padded, see below):
                z = (h_c @ W_r^T) / T                     [C, V_r] fp32 (GEMM, fp32 out)
                (m, s, a, t) per row  -> stats[N, 4]       (_stats.local_stats)
              all-gather stats over tp_group -> [P, N, 4] -> merge in rank order
              -> logprob, entropy, lse (saved: lse, E)
    backward  for each chunk:
                z recomputed; d z = p * (g_lse - g_lp - g_ent (z - E)) + g_lp onehot
                d l = d z / T, rounded to the input dtype for the two GEMMs
                grad_h[c]  = d l @ W_r                     (fp32 out)
                grad_W_r  += d l^T @ h_c                   (fp32 accumulator)
              grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

Memory: O(C x V_r) fp32 scratch (two such buffers at most), the fp32 grad_W
accumulator (V_local x H; it *is* the gradient for fp32 weights) and, under tensor
parallelism, an fp32 [N, H] buffer for the grad_hidden all-reduce. Never [N, V].

Batch invariance (on CPU): a row's outputs and its grad_hidden row do not depend
on N, on the other rows or on ``chunk_size``. BLAS picks other kernels for a few
rows (MKL's GEMV path for one or two rows changes the bits), so every block of work
has the same number of rows, at least 16, the last one zero-padded; padding rows carry
zero upstream gradient. That number is the chunk, or for N below it N rounded up to a
power of two (``block_rows``): the scratch follows ``min(N, chunk)``, never a huge
``chunk_size`` alone. On CPU a row's bits do not depend on the block's row count (from 16
rows on; tested with ``torch.equal`` across chunk sizes and N). On CUDA this backend is
run-to-run reproducible but NOT batch-invariant: cuBLAS and torch's reductions choose
their summation order from the shape and even from a row's position in the block
(measured on H200 with fixed-shape padded chunks). The triton backend, the default on
CUDA, is batch-invariant there.
"""

from __future__ import annotations

import torch

from lp_kernels._compile import backend_backward
from lp_kernels._matmul import addmm_f32_, mm_f32, scratch
from lp_kernels._softcap import softcap_
from lp_kernels._stats import (
    N_STATS,
    d_logits_,
    local_stats,
    masked_outputs,
    masked_upstream,
    merge_stats,
    target_columns,
)
from lp_kernels._types import LogprobParams
from lp_kernels.distributed.collectives import RowSums, gather_stats

_SCRATCH_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}
_MIN_ROWS = 16
_MAX_ROWS = {"cuda": 4096, "cpu": 256}


def default_chunk_rows(v_real: int, device: torch.device) -> int:
    """Rows per chunk: a power of two keeping one fp32 [C, V_r] buffer within budget.

    Depends on the shard width and device only, never on the token count.
    """
    kind = "cuda" if device.type == "cuda" else "cpu"
    rows = _SCRATCH_BYTES[kind] // (4 * max(v_real, 1))
    rows = 1 << max(rows.bit_length() - 1, 0)
    return max(_MIN_ROWS, min(rows, _MAX_ROWS[kind]))


def padded_rows(
    x: torch.Tensor, r0: int, r1: int, rows: int, fill: float | bool = 0
) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``x`` padded with ``fill`` to ``rows`` rows (a view if unpadded)."""
    if r1 - r0 == rows:
        return x[r0:r1]
    out = torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out[: r1 - r0] = x[r0:r1]
    return out


def block_rows(n: int, chunk: int) -> int:
    """Rows of every block of ``n`` token rows under a ``chunk``: ``chunk`` (at least 16)
    when ``n`` fills it, else ``n`` rounded up to a power of two (at least 16, at most the
    chunk). So the scratch is bounded by ``min(n, chunk)`` rows (up to 2 x, or 16 rows),
    whatever ``chunk_size`` says, and one call has one block shape."""
    chunk = max(chunk, _MIN_ROWS)  # BLAS takes other code paths for a few rows
    if n >= chunk:
        return chunk
    return min(chunk, max(_MIN_ROWS, 1 << max(n - 1, 0).bit_length()))


def chunks(n: int, chunk: int):
    """``(r0, r1, rows)`` for each block; every block is padded to ``rows`` rows
    (:func:`block_rows`)."""
    rows = block_rows(n, chunk)
    for r0 in range(0, n, rows):
        yield r0, min(n, r0 + rows), rows


def scaled_logits_chunks(
    hidden: torch.Tensor,
    w_real: torch.Tensor,
    p: LogprobParams,
    zero_rows: torch.Tensor | None = None,
    b_real: torch.Tensor | None = None,
):
    """Yield ``(r0, r1, rows, h_c, z)``: padded hidden rows and ``z = softcap(h_c W_r^T + b) /
    T`` in fp32 (``b_real``: the fp32 bias of ``w_real``'s rows, or None; the cap if
    ``p.softcap``).

    Rows flagged in ``zero_rows [N]`` get logits of a zero hidden row (``h_c`` itself is
    yielded unchanged): the backward's ignored rows, so that their d_logits are exact
    zeros even where their hidden state is not finite, at the cost of one pass over the
    ``[C, H]`` chunk rather than over ``[C, V]``.
    """
    for r0, r1, rows, h_c, z, _ in capped_logits_chunks(hidden, w_real, p, zero_rows, b_real):
        yield r0, r1, rows, h_c, z


def capped_logits_chunks(
    hidden, w_real, p: LogprobParams, zero_rows=None, b_real=None, slope: bool = False
):
    """:func:`scaled_logits_chunks` with a sixth item: the cap's slope ``1 - tanh^2``
    (fp32 ``[rows, V_r]``) when ``slope`` and ``p.softcap``, else None."""
    for r0, r1, rows in chunks(hidden.shape[0], p.chunk_size):
        h_c = padded_rows(hidden, r0, r1, rows)
        h_z = h_c
        if zero_rows is not None:
            h_z = torch.where(padded_rows(zero_rows, r0, r1, rows, False)[:, None], 0, h_c)
        z = mm_f32(h_z, w_real.T)  # [rows, V_r]
        if b_real is not None:
            z.add_(b_real)
        s = None
        if p.softcap is not None:  # on the raw logits, before the temperature
            s = softcap_(z, p.softcap, slope=slope)
        if p.temperature != 1.0:
            z.mul_(p.inv_temperature)
        yield r0, r1, rows, h_c, z, s


class LinearLogprobTorch(torch.autograd.Function):
    """Chunked torch implementation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        b_real = None if bias is None else bias[:v_real].float()
        t_local, in_shard, ignored = target_columns(targets, p.ignore_index, p.vocab_start, v_real)
        stats = scratch.empty((n, N_STATS), dtype=torch.float32, device=hidden.device)
        for r0, r1, rows, _, z in scaled_logits_chunks(hidden, w_real, p, b_real=b_real):
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
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z)
        ctx.params = p
        return masked_outputs(ignored, zt, lse, ent, return_lse=p.return_lse)

    @staticmethod
    @backend_backward
    def backward(ctx, g_lp, g_ent, g_lse):
        hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
        p: LogprobParams = ctx.params
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, h_dim = hidden.shape
        v_real = p.local_real_columns(weight.shape[0])
        w_real = weight[:v_real]
        b_real = None if bias is None else bias[:v_real].float()
        acc_b = torch.zeros(v_real, dtype=torch.float32, device=hidden.device) if need_b else None
        reduce_h = p.tp_size > 1 and p.reduce_grad_hidden
        grad_h = None
        if need_h:
            h_dtype = torch.float32 if reduce_h else hidden.dtype
            grad_h = scratch.empty((n, h_dim), dtype=h_dtype, device=hidden.device)
        acc_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        # each chunk's rows are final at once: their TP sum runs beside the next GEMMs
        sums = RowSums(grad_h, p.tp_group, p.tp_size, enabled=need_h and reduce_h)
        for r0, r1, h_c, dl in logits_grad_chunks(
            hidden, w_real, targets, lse, mean_z, (g_lp, g_ent, g_lse), p,
            b_real=b_real, grad_bias=acc_b,
        ):  # fmt: skip
            if need_h:
                grad_h[r0:r1] = mm_f32(dl, w_real)[: r1 - r0]
                sums.ready(r1)
            if need_w and v_real > 0:
                addmm_f32_(acc_w[:v_real], dl.T, h_c)
        if need_h and reduce_h:
            sums.finish()
            grad_h = grad_h.to(hidden.dtype)
        grad_w = acc_w.to(weight.dtype) if need_w else None  # no copy for fp32 weights
        return grad_h, grad_w, bias_grad(acc_b, bias), None, None


def bias_grad(acc_b: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """grad_bias in the bias' dtype from its fp32 sum over the real columns (zero past them:
    padding columns)."""
    if acc_b is None:
        return None
    out = torch.zeros_like(bias)
    out[: acc_b.shape[0]] = acc_b
    return out


def logits_grad_chunks(
    hidden,
    w_real,
    targets,
    lse,
    mean_z,
    upstream,
    p: LogprobParams,
    vocab_start=None,
    b_real=None,
    grad_bias=None,
):
    """Yield ``(r0, r1, h_c, d_l)`` per chunk: the padded hidden rows and ``d loss / d logits``.

    ``d_l [rows, V_r]`` is rounded to the input dtype, ready for the two gradient GEMMs;
    padding rows and ignored rows have zero upstream gradient. ``w_real``'s first row is
    vocabulary id ``vocab_start`` (default: the shard's start). ``b_real``: the fp32 bias of
    ``w_real``'s rows, or None; ``grad_bias`` (fp32 ``[V_r]``, or None) gets each chunk's
    column sums of ``d_l`` (as rounded, summed in fp32) added, in chunk order.
    """
    v_real = w_real.shape[0]
    start = p.vocab_start if vocab_start is None else vocab_start
    t_local, in_shard, ignored = target_columns(targets, p.ignore_index, start, v_real)
    g_lp, g_ent, g_lse = masked_upstream(ignored, *upstream)
    if g_ent is not None and mean_z is None:
        raise RuntimeError("entropy gradient without return_entropy (internal error)")
    # ignored rows: logits of a zero row (the bias alone) and lse = +inf, E = 0, so that
    # p = 0 and d_logits = 0 * 0 exactly; padding rows likewise
    lse = torch.where(ignored, float("inf"), lse)
    mean_z = None if mean_z is None else torch.where(ignored, 0.0, mean_z)

    def pad(x, r0, r1, rows):
        return None if x is None else padded_rows(x, r0, r1, rows)

    for r0, r1, rows, h_c, z, slope in capped_logits_chunks(
        hidden, w_real, p, ignored, b_real, slope=True
    ):
        dz = d_logits_(
            z,
            padded_rows(lse, r0, r1, rows, float("inf")),
            pad(mean_z, r0, r1, rows),
            padded_rows(t_local, r0, r1, rows),
            padded_rows(in_shard, r0, r1, rows, False),
            pad(g_lp, r0, r1, rows),
            pad(g_ent, r0, r1, rows),
            pad(g_lse, r0, r1, rows),
        )
        if p.temperature != 1.0:
            dz.mul_(p.inv_temperature)
        if slope is not None:  # d l = d z / T * (1 - tanh^2)
            dz.mul_(slope)
        dl = dz.to(hidden.dtype)
        if grad_bias is not None:  # the sums of what the gradient GEMMs read, in fp32
            grad_bias += dl.sum(dim=0, dtype=torch.float32)
        yield r0, r1, h_c, dl
