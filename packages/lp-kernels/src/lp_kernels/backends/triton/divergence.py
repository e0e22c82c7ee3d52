"""The ``triton`` engine of ``linear_divergence``: both heads' logits from cuBLAS GEMMs (fp32
out), everything after them in Triton kernels that read each raw logit once per pass.

Per chunk of C rows, with ``l_s``, ``l_t`` the two GEMM outputs ``[C, V_r]`` fp32::

    _lse_kernel    grid (C, S): a row's split of SPLIT columns: both transforms (bias, scale,
                   cap, temperature), online (max, sum exp) of z and y -> [S, C, 4]
    _sums_kernel   grid (C, S): with the rows' whole lse(z), lse(y): the split's divergence,
                   entropies and K (core.divergence) -> [S, C, 4], added over S in order
    _dl_kernel     grid (C, S): d l = d D / d z * dz/dl * g, stored in the GEMM dtype

The splits' partials are merged by ``lp_kernels.backends.divergence`` (which also merges
them over ``tp_group``). The formulas are those of :mod:`lp_kernels.core.divergence`, the
transform that of :mod:`lp_kernels.backends.triton.softmax` (``cap_value``: the accurate
cap, with its slope). Terms whose weight ``p`` or ``q`` is 0 are 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lp_kernels.backends.triton.softmax import cap_value, transform_args
from lp_kernels.core.divergence import KINDS, N_SUMS, DivergenceParams
from lp_kernels.core.matmul import mm_f32

BLOCK = 1024
"""Columns per step of a kernel's loop over its split."""
SPLIT = 4096
"""Columns per program (a multiple of :data:`BLOCK`)."""


@triton.jit
def _side(l_row, b_ptr, cols, ok, scale, cap, inv_cap, inv_t, HAS_BIAS, SCALE, CAP):
    """``(z, dz/dl)`` of a block of one row's raw logits (``z = -inf`` where not ``ok``)."""
    l = tl.load(l_row + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        l += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    grad = inv_t
    if SCALE:
        l = l * scale
        grad = grad * scale
    if CAP:
        l, slope = cap_value(l, cap, inv_cap)
        grad = grad * slope
    return tl.where(ok, l * inv_t, float("-inf")), grad


@triton.jit
def _row_split(ls_ptr, lt_ptr, stride_s, stride_t, V, SPLIT: tl.constexpr):
    """``(row, split, first column, end column, student row, teacher row)`` of a program."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    c0 = j * SPLIT
    c1 = tl.minimum(c0 + SPLIT, V)
    return (
        row,
        j,
        c0,
        c1,
        ls_ptr + row.to(tl.int64) * stride_s,
        lt_ptr + row.to(tl.int64) * stride_t,
    )


@triton.jit
def _online(z, m, s):
    """The running ``(max, sum exp(. - max))`` after a block ``z``."""
    big = tl.maximum(m, tl.max(z, axis=0))
    safe = tl.where(big == float("-inf"), 0.0, big)
    s = s * tl.exp(m - safe) + tl.sum(tl.exp(z - safe), axis=0)
    return big, s


@triton.jit
def _weighted(w, x):
    return tl.sum(tl.where(w > 0, w * x, 0.0), axis=0)


@triton.jit
def _mixture_gaps(d, log_1mb, log_b):
    """``(lp - lm, lq - lm)`` from ``d = lp - lq`` (``core.divergence.mixture_gaps``)."""
    b = log_b - d
    hi = tl.maximum(log_1mb, b)
    lo = tl.minimum(log_1mb, b)
    r = hi + tl.log(1.0 + tl.exp(lo - hi))
    return -r, tl.where(d == float("-inf"), -log_b, -d - r)


@triton.jit
def _lse_kernel(
    ls_ptr, lt_ptr, bs_ptr, bt_ptr, out_ptr, rows, V, stride_s, stride_t,
    s_scale, s_cap, s_inv_cap, s_inv_t, t_scale, t_cap, t_inv_cap, t_inv_t,
    S_BIAS: tl.constexpr, S_SCALE: tl.constexpr, S_CAP: tl.constexpr,
    T_BIAS: tl.constexpr, T_SCALE: tl.constexpr, T_CAP: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, j, c0, c1, ls_row, lt_row = _row_split(ls_ptr, lt_ptr, stride_s, stride_t, V, SPLIT)
    ms = float("-inf")
    ss = 0.0
    mt = float("-inf")
    st = 0.0
    for off in range(c0, c1, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < c1
        z, _ = _side(ls_row, bs_ptr, cols, ok, s_scale, s_cap, s_inv_cap, s_inv_t,
                     S_BIAS, S_SCALE, S_CAP)  # fmt: skip
        y, _ = _side(lt_row, bt_ptr, cols, ok, t_scale, t_cap, t_inv_cap, t_inv_t,
                     T_BIAS, T_SCALE, T_CAP)  # fmt: skip
        ms, ss = _online(z, ms, ss)
        mt, st = _online(y, mt, st)
    out = out_ptr + (j.to(tl.int64) * rows + row) * 4
    tl.store(out, ms)
    tl.store(out + 1, ss)
    tl.store(out + 2, mt)
    tl.store(out + 3, st)


@triton.jit
def _sums_kernel(
    ls_ptr, lt_ptr, bs_ptr, bt_ptr, lse_ptr, out_ptr, rows, V, stride_s, stride_t,
    s_scale, s_cap, s_inv_cap, s_inv_t, t_scale, t_cap, t_inv_cap, t_inv_t,
    beta, log_1mb, log_b,
    S_BIAS: tl.constexpr, S_SCALE: tl.constexpr, S_CAP: tl.constexpr,
    T_BIAS: tl.constexpr, T_SCALE: tl.constexpr, T_CAP: tl.constexpr,
    KIND: tl.constexpr, N_SUMS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, j, c0, c1, ls_row, lt_row = _row_split(ls_ptr, lt_ptr, stride_s, stride_t, V, SPLIT)
    lse_s = tl.load(lse_ptr + row * 2)
    lse_t = tl.load(lse_ptr + row * 2 + 1)
    div = 0.0
    ent_s = 0.0
    ent_t = 0.0
    k = 0.0
    a = 0.0
    for off in range(c0, c1, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < c1
        z, _ = _side(ls_row, bs_ptr, cols, ok, s_scale, s_cap, s_inv_cap, s_inv_t,
                     S_BIAS, S_SCALE, S_CAP)  # fmt: skip
        y, _ = _side(lt_row, bt_ptr, cols, ok, t_scale, t_cap, t_inv_cap, t_inv_t,
                     T_BIAS, T_SCALE, T_CAP)  # fmt: skip
        lp = z - lse_s
        lq = y - lse_t
        p = tl.exp(lp)
        q = tl.exp(lq)
        ent_s -= _weighted(p, lp)
        ent_t -= _weighted(q, lq)
        d = (z - y) - (lse_s - lse_t)
        if KIND == 2:
            gap_p, gap_q = _mixture_gaps(d, log_1mb, log_b)
            kb = _weighted(p, gap_p)
            div += beta * _weighted(q, gap_q) + (1.0 - beta) * kb
            k += kb
            a += _weighted(p, tl.abs(gap_p))
        else:
            if KIND == 1:
                div += _weighted(p, d)
                a += _weighted(p, tl.abs(d))
            else:
                div += _weighted(q, -d)
    out = out_ptr + (j.to(tl.int64) * rows + row) * N_SUMS
    tl.store(out, div)
    tl.store(out + 1, ent_s)
    tl.store(out + 2, ent_t)
    tl.store(out + 3, k)
    tl.store(out + 4, a)


@triton.jit
def _dl_kernel(
    ls_ptr, lt_ptr, bs_ptr, bt_ptr, saved_ptr, g_ptr, dl_ptr, V, stride_s, stride_t, stride_d,
    s_scale, s_cap, s_inv_cap, s_inv_t, t_scale, t_cap, t_inv_cap, t_inv_t,
    beta, log_1mb, log_b,
    S_BIAS: tl.constexpr, S_SCALE: tl.constexpr, S_CAP: tl.constexpr,
    T_BIAS: tl.constexpr, T_SCALE: tl.constexpr, T_CAP: tl.constexpr,
    KIND: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, _, c0, c1, ls_row, lt_row = _row_split(ls_ptr, lt_ptr, stride_s, stride_t, V, SPLIT)
    dl_row = dl_ptr + row.to(tl.int64) * stride_d
    lse_s = tl.load(saved_ptr + row * 4)
    lse_t = tl.load(saved_ptr + row * 4 + 1)
    div = tl.load(saved_ptr + row * 4 + 2)
    k = tl.load(saved_ptr + row * 4 + 3)
    g = tl.load(g_ptr + row)
    for off in range(c0, c1, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < c1
        z, grad = _side(ls_row, bs_ptr, cols, ok, s_scale, s_cap, s_inv_cap, s_inv_t,
                        S_BIAS, S_SCALE, S_CAP)  # fmt: skip
        y, _ = _side(lt_row, bt_ptr, cols, ok, t_scale, t_cap, t_inv_cap, t_inv_t,
                     T_BIAS, T_SCALE, T_CAP)  # fmt: skip
        lp = z - lse_s
        p = tl.exp(lp)
        if KIND == 0:
            dz = p - tl.exp(y - lse_t)
        elif KIND == 1:
            d = (z - y) - (lse_s - lse_t)
            dz = tl.where(p > 0, p * (d - div), 0.0)
        else:
            gap_p, _ = _mixture_gaps((z - y) - (lse_s - lse_t), log_1mb, log_b)
            dz = tl.where(p > 0, (1.0 - beta) * p * (gap_p - k), 0.0)
        dl = tl.where(g != 0, dz * g * grad, 0.0)
        tl.store(dl_row + cols, dl.to(dl_ptr.dtype.element_ty), mask=ok)


def _args(dp: DivergenceParams, state) -> dict:
    """The kernels' transform, bias and kind arguments."""
    _, _, b_s, b_t, _ = state
    out = {"S_BIAS": b_s is not None, "T_BIAS": b_t is not None}
    for side, transform in (("s", dp.student.transform), ("t", dp.teacher_transform)):
        for key, value in transform_args(transform).items():  # SCALE -> S_SCALE, cap -> s_cap
            out[f"{side}_{key}" if key.islower() else f"{side.upper()}_{key}"] = value
    return out


def _kind_args(dp: DivergenceParams) -> dict:
    beta = dp.beta if dp.kind == "jsd" else 0.5
    return {
        "beta": beta,
        "log_1mb": math.log1p(-beta),
        "log_b": math.log(beta),
        "KIND": KINDS.index(dp.kind),
    }


def _launch(kernel, state, *args, **kwargs) -> None:
    l_s, l_t, b_s, b_t, _ = state
    rows, v = l_s.shape
    grid = (rows, max(1, triton.cdiv(v, SPLIT)))
    if rows == 0:
        return
    dummy = l_s  # an unused bias pointer
    kernel[grid](
        l_s, l_t, dummy if b_s is None else b_s, dummy if b_t is None else b_t, *args,
        SPLIT=SPLIT, BLOCK=BLOCK, num_warps=4, **kwargs,
    )  # fmt: skip


class TritonEngine:
    """A chunk's state is ``(l_s, l_t, b_s, b_t, dtype)``: both heads' raw GEMM outputs (fp32
    ``[C, V_r]``), their fp32 biases (or None) and the GEMM dtype of ``d l``."""

    @staticmethod
    def chunks(hidden, w_s, b_s, t_hidden, w_t, b_t, dp, *, backward=None):
        """``(r0, r1, h_c, state)`` per chunk of ``chunk_size`` rows (the last one shorter)
        for real weight rows ``w_s``, ``w_t`` and their fp32 biases (or None)."""
        p = dp.student
        b_s = None if b_s is None else b_s.contiguous()
        b_t = None if b_t is None else b_t.contiguous()
        for r0 in range(0, hidden.shape[0], p.chunk_size):
            r1 = min(r0 + p.chunk_size, hidden.shape[0])
            h_c = hidden[r0:r1]
            l_s, l_t = mm_f32(h_c, w_s.T), mm_f32(t_hidden[r0:r1], w_t.T)
            yield r0, r1, h_c, (l_s, l_t, b_s, b_t, hidden.dtype)

    @staticmethod
    def lse_partials(state, dp: DivergenceParams):
        l_s, l_t = state[:2]
        rows, v = l_s.shape
        parts = torch.empty((max(1, triton.cdiv(v, SPLIT)), rows, 4), device=l_s.device)
        strides = (l_s.stride(0), l_t.stride(0))
        _launch(_lse_kernel, state, parts, rows, v, *strides, **_args(dp, state))
        return parts[..., :2], parts[..., 2:]

    @staticmethod
    def local_sums(state, lse_s, lse_t, dp: DivergenceParams) -> torch.Tensor:
        l_s, l_t = state[:2]
        rows, v = l_s.shape
        lse = torch.stack([lse_s, lse_t], dim=1).contiguous()
        parts = torch.zeros((max(1, triton.cdiv(v, SPLIT)), rows, N_SUMS), device=l_s.device)
        _launch(
            _sums_kernel, state, lse, parts, rows, v, l_s.stride(0), l_t.stride(0),
            **_args(dp, state), **_kind_args(dp), N_SUMS=N_SUMS,
        )  # fmt: skip
        return parts.sum(dim=0)

    @staticmethod
    def dlogits(state, saved, g, dp: DivergenceParams) -> torch.Tensor:
        """``d loss / d l`` of the chunk in the GEMM dtype, for its saved statistics ``[C,
        4]`` and upstream gradient ``g [C]`` (0 on ignored rows)."""
        l_s, l_t = state[:2]
        dl = torch.empty(l_s.shape, dtype=state[4], device=l_s.device)
        _launch(
            _dl_kernel, state, saved.contiguous(), g.contiguous(), dl, l_s.shape[1],
            l_s.stride(0), l_t.stride(0), dl.stride(0), **_args(dp, state), **_kind_args(dp),
        )  # fmt: skip
        return dl
