"""The ``triton`` backend of ``linear_logprob_loss``: the forward kernel's logits kept for
the gradient, so the step runs three GEMMs.

Data flow for one rank (V_r = real columns, R = logits block rows, G = gradient block rows,
a multiple of R; both from :func:`block_rows`, never from N)::

    for each gradient block of G rows:
      for each logits block of R rows in it:
        fwd_stats_kernel (STORE_L): the forward's statistics, and the raw logits
            l = h W^T (+ b) (fp32) -> lbuf [R, V_r]
        all-gather over tp_group; merge_kernel -> logprob, entropy, lse (final)
        loss_fn under autograd -> g_lp, g_ent, g_lse per row
        dlogits_l_kernel: d l from lbuf, the d_logits kernel's arithmetic without its
            GEMM -> dl [G, V_r] (input dtype)
      grad_h[block] = dl @ W_r                               cuBLAS, fp32 out
      grad_W = dl^T @ h  (one block: in place, input dtype; else an fp32 accumulator)
    grad_h all-reduced over tp_group (fp32) unless reduce_grad_hidden=False

The per-token outputs are the forward kernel's (batch-invariant, as ``linear_logprob``'s).
The gradients are reproducible run to run; cuBLAS chooses the GEMMs' kernels by shape, so
unlike ``linear_logprob``'s they are not batch-invariant.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.backward import (
    add_column_sums,
    dlogits_rows,
    dlogits_tile,
    grad_weight_buffer,
    grad_weight_slice,
    kernel_inputs,
)
from lp_kernels.backends.triton.config import (
    LOSS_GRAD_BYTES,
    LOSS_LOGITS_BYTES,
    TileConfig,
    cap_args,
    compile_opts,
    config_for,
    launch_opts,
    pad128,
    sm_count,
)
from lp_kernels.backends.triton.forward import (
    forward_stats,
    gather_partials,
    merge_outputs,
    shard_splits,
)
from lp_kernels.backends.triton.tl_utils import IGNORED, target_codes
from lp_kernels.core.loss import FinishedGradients, LossSpec, block_loss, block_values, finish
from lp_kernels.core.matmul import addmm_f32_, mm_f32, scratch
from lp_kernels.core.stats import bias_grad, ignored_rows
from lp_kernels.core.types import LogprobParams
from lp_kernels.distributed.collectives import RowSums


@triton.jit(do_not_specialize=["N", "V", "ignore_index", "first_id"])
def dlogits_l_kernel(
    l_ptr, t_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, glse_ptr, dl_ptr, db_ptr,
    N, V, ignore_index, first_id, inv_t, cap, inv_cap, stride_ln, stride_dn,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILES: tl.constexpr, ENTROPY: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_LSE: tl.constexpr, IGNORED: tl.constexpr,
    BIAS_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """d l = (p (c0 - g_ent (z - E)) + g_lp [col == target]) / T from stored raw logits l
    (``h W^T + b``), z = softcap(l) / T: ``backward.dlogits_tile``, the arithmetic of the
    backward's ``dlogits_kernel`` on the same l, without the GEMM that recomputes it.

    Each program covers ``TILES`` consecutive ``[BLOCK_N, BLOCK_V]`` tiles of one row
    block. ``t_ptr``: the rows' raw target ids, ``first_id`` the id of column 0; ignored
    rows (code ``IGNORED``) get exact zeros whatever l holds. ``BIAS_GRAD``: each program
    writes the fp32 column sums of its tiles' stored d l to row ``i_n`` of ``db_ptr``
    (``[blocks, V]``).
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
    for j in tl.static_range(TILES):
        v0 = (tl.program_id(1) * TILES + j) * BLOCK_V
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_2 = m_n[:, None] & (o_v < V)[None, :]
        b_l = tl.load(p_l + o_v[None, :], mask=m_2, other=0.0)
        b_dz = dlogits_tile(
            b_l, b_t, b_lse, b_glp, b_glse, b_mean, b_gent, v0, inv_t, cap, inv_cap, BLOCK_V,
            ENTROPY, HAS_LP, SOFTCAP, INTERPRET,
        )  # fmt: skip
        b_dz = tl.where(m_2 & (b_t != IGNORED)[:, None], b_dz, 0.0)
        b_dl = b_dz.to(dl_ptr.dtype.element_ty)
        tl.store(p_d + o_v[None, :], b_dl, mask=m_2)
        if BIAS_GRAD:  # the stored values' sums (what the gradient GEMMs read), in fp32
            tl.store(
                db_ptr + i_n.to(tl.int64) * V + o_v, tl.sum(b_dl.to(tl.float32), axis=0),
                mask=o_v < V,
            )  # fmt: skip


def dlogits_from_logits(
    logits, targets, lse, mean, grads, out, p: LogprobParams, cfg: TileConfig, db=None
) -> None:
    """d_logits of the rows of ``logits [k, >= V]`` (raw fp32 logits ``h W^T (+ b)`` of V
    real columns from vocabulary id ``p.vocab_start``, V = ``out.shape[1]``) into ``out [k,
    V]``; ``targets``: the rows' raw ids, ``grads``: fp32 ``(g_lp, g_ent, g_lse)`` (contiguous,
    or None); ``db``: None, or a contiguous fp32 ``[cdiv(k, cfg.loss_bias_block[0]), V]``
    buffer for the row blocks' column sums."""
    k, v = out.shape
    if k == 0 or v == 0:
        return
    block_n, block_v, tiles = cfg.loss_block if db is None else cfg.loss_bias_block
    opts = launch_opts(
        dataclasses.replace(cfg, num_stages=1, num_warps=cfg.loss_warps), logits.device
    )
    g_lp, g_ent, g_lse = (lse if g is None else g for g in grads)
    dlogits_l_kernel[(triton.cdiv(k, block_n), triton.cdiv(v, block_v * tiles))](
        logits, targets, lse, mean if mean is not None else lse, g_lp, g_ent, g_lse, out,
        lse if db is None else db,
        k, v, p.ignore_index, p.vocab_start, p.transform.inv_temperature, *cap_args(p), logits.stride(0),
        out.stride(0),
        BLOCK_N=block_n, BLOCK_V=block_v, TILES=tiles, ENTROPY=grads[1] is not None,
        HAS_LP=grads[0] is not None, HAS_LSE=grads[2] is not None, IGNORED=IGNORED,
        BIAS_GRAD=db is not None, SOFTCAP=p.transform.softcap is not None,
        INTERPRET=logits.device.type == "cpu", **opts,
    )  # fmt: skip


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
    scale_kernel[grid](grad, g.reshape(1).float(), numel, BLOCK=block, **compile_opts(grad.device))
    return grad


def pow2_floor(x: int) -> int:
    return 1 << max(int(x).bit_length() - 1, 0)


def block_rows(p: LogprobParams, cfg: TileConfig, itemsize: int, rows: int | None):
    """``(R, G)``: rows of a logits block and of a gradient block (a multiple of R).

    From the config, the byte budgets and the widest shard of the group (so every rank
    makes the same blocks and exchanges), or the caller's ``rows`` (``chunk_size``) for
    both; never from N."""
    if rows is not None:
        return rows, rows
    width = pad128(max(1, min(p.max_v_local, p.vocab_size)))
    r = max(16, min(cfg.loss_rows, pow2_floor(LOSS_LOGITS_BYTES // (4 * width))))
    g = min(cfg.loss_grad_rows, pow2_floor(LOSS_GRAD_BYTES // (itemsize * width)))
    return r, max(r, g // r * r)


def logits_blocks(rows: int, r_max: int, block_n: int, splits: int, sms: int | None) -> list[int]:
    """Row counts of the logits blocks that cover a gradient block of ``rows`` rows, each at
    most ``r_max``: the count and sizes whose forward launches waste the fewest program
    slots on ``sms`` multiprocessors.

    A block of ``k`` rows launches ``cdiv(k, block_n) * splits`` programs of equal work
    (the last split's may be shorter), so it takes ``cdiv(programs, sms)`` waves; the
    count with the fewest waves in all wins, the fewer blocks on a tie (each block costs
    a launch, an exchange and a ``loss_fn`` call), among equal blocks of ``r_max`` rows
    and a shorter last one, and row blocks spread evenly over each count from the
    fewest up (larger first). Only the launch changes: every row's statistics and
    logits are its own. ``sms`` None (no waves to fit, or ranks that need not agree on
    it), or ``r_max`` not a multiple of ``block_n``: equal blocks of ``r_max`` rows and a
    shorter last one.
    """
    if rows <= 0:
        return []
    plain = [min(r_max, rows - r0) for r0 in range(0, rows, r_max)]
    if sms is None or rows <= block_n or r_max % block_n:
        return plain
    units = triton.cdiv(rows, block_n)
    unit_max = max(1, r_max // block_n)
    candidates = [[triton.cdiv(k, block_n) for k in plain]]  # full blocks, then the rest
    first = triton.cdiv(units, unit_max)
    for count in range(first, min(units, first + 8) + 1):  # balanced, larger first
        q, extra = divmod(units, count)
        candidates.append([q + 1] * extra + [q] * (count - extra))
    best = min(
        (sum(triton.cdiv(u * splits, sms) for u in parts), len(parts), i)
        for i, parts in enumerate(candidates)
        if max(parts) <= unit_max
    )
    sizes = [u * block_n for u in candidates[best[2]]]
    sizes[-1] -= sum(sizes) - rows  # the last block ends at the gradient block's end
    return sizes


class LinearLogprobLossTriton(FinishedGradients):
    """Fused Triton implementation of the loss; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, p: LogprobParams, spec: LossSpec):
        ctx.set_materialize_grads(False)
        cfg = p.tile_config or config_for(hidden.device, hidden.dtype)
        hidden, w_real, targets = kernel_inputs(hidden, weight, targets, p)
        ignored = ignored_rows(targets, p.ignore_index)  # the loss function's dead rows
        n, h_dim = hidden.shape
        dev = hidden.device
        v_real = w_real.shape[0]
        b_real = None if bias is None else bias[:v_real].float()
        need_h, need_w, need_b = spec.needs
        grad = spec.any_grad
        rows, g_rows = block_rows(p, cfg, hidden.element_size(), spec.block_rows)
        rows, g_rows = min(rows, max(n, 1)), min(g_rows, max(n, 1))
        width = pad128(max(v_real, 1))
        lbuf = scratch.empty((rows, width), dtype=torch.float32, device=dev)
        dl_buf = scratch.empty((g_rows, width), dtype=hidden.dtype, device=dev) if grad else None
        outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(4)]
        token_loss, logprob, entropy, lse = outs
        reduce_h = p.tp_size > 1 and p.reduce_grad_hidden
        grad_h = grad_w = acc_w = acc_b = db = None
        if need_h:
            h_dtype = torch.float32 if reduce_h else hidden.dtype
            alloc = scratch.empty if v_real > 0 else torch.zeros
            grad_h = alloc((n, h_dim), dtype=h_dtype, device=dev)
        if need_w and n <= g_rows:  # one gradient block: grad_W in place, input dtype
            grad_w = grad_weight_buffer(weight, v_real, n)
        elif need_w:
            acc_w = torch.zeros_like(weight, dtype=torch.float32)
        if need_b:
            acc_b = torch.zeros(v_real, dtype=torch.float32, device=dev)
            blocks = triton.cdiv(rows, cfg.loss_bias_block[0])  # [blocks, v_real] column sums
            db = scratch.empty((blocks, max(v_real, 1)), dtype=torch.float32, device=dev)
        sums = RowSums(grad_h, p.tp_group, p.tp_size, enabled=need_h and reduce_h)
        _, splits = shard_splits(v_real, p, cfg)
        sms = sm_count(dev) if p.tp_size == 1 and spec.block_rows is None else None
        for g0 in range(0, n, g_rows):
            g1 = min(n, g0 + g_rows)
            r1 = g0
            for k in logits_blocks(g1 - g0, rows, cfg.block_n, splits, sms):
                r0, r1 = r1, r1 + k
                t_c = targets[r0:r1]
                stats = forward_stats(
                    hidden[r0:r1], w_real, t_c, p.vocab_start, p, cfg, b_real, lbuf[:k]
                )
                gathered = gather_partials(stats, p)  # TP: one partial per rank
                dead = ignored[r0:r1]
                lse_c, mean_c, (lp_c, e_c, ls_c) = merge_outputs(
                    gathered, t_c, p.ignore_index, entropy=p.return_entropy,
                    return_lse=True,
                )  # fmt: skip
                values = block_values(spec.per_token, r0, r1, k)
                loss_c, g = block_loss(spec, lp_c, e_c, ls_c, dead, values)
                for out, x in zip(outs, (loss_c, lp_c, e_c, ls_c), strict=True):
                    if x is not None:
                        out[r0:r1] = x
                if not grad:
                    continue
                part = None if db is None else db[: triton.cdiv(k, cfg.loss_bias_block[0]), :v_real]
                dl = dl_buf[r0 - g0 : r1 - g0, :v_real]
                # g: fp32 (g_lp, g_ent, g_lse), 0 on dead rows (block_loss)
                dlogits_from_logits(lbuf[:k], t_c, lse_c, mean_c, g, dl, p, cfg, part)
                if part is not None:
                    add_column_sums(acc_b, part)
            if not grad:
                continue
            dl = dl_buf[: g1 - g0, :v_real]
            if need_h:
                grad_h[g0:g1] = mm_f32(dl, w_real)
                sums.ready(g1)
            if grad_w is not None and v_real > 0:
                grad_weight_slice(dl, hidden, grad_w[:v_real])
            elif acc_w is not None and v_real > 0:
                addmm_f32_(acc_w[:v_real], dl.T, hidden[g0:g1], accumulate=g0 > 0)
        if not p.return_entropy:
            entropy = None
        if need_h and reduce_h:
            sums.finish()
            grad_h = grad_h.to(hidden.dtype)
        if acc_w is not None:
            grad_w = acc_w.to(weight.dtype)  # no copy for fp32 weights
        grads = (grad_h, grad_w, bias_grad(acc_b, bias))
        ctx.scale = scale_on_device_
        return finish(ctx, (token_loss, logprob, entropy, lse), grads, spec)
