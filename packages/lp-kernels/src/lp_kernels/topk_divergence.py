"""Distillation from a teacher's top-k payload (ids and log-probs), without ``[N, V]`` logits.

The public op is :func:`lp_kernels.linear_topk_divergence` (in ``lp_kernels.divergence``,
beside the other divergence ops, where the logit options are spelled out); this module is
its machinery. Per row, with ``S`` the row's ``k`` teacher ids, ``z`` the student's softmax
arguments (the whole logit transform applied) and ``lq`` the teacher's log-probs at ``S``::

    hidden [N, H] --linear_logprob (no target needed)--> lse [N], entropy [N]
                                 (a full-vocabulary pass: fp32 statistics, exact gradient p)
    hidden, W[S] (this rank's ids) --gather GEMV, fp32--> l [N, k]  --TP sum--> z [N, k]
    lp = z - lse                       the student's log-probs at S
    divergence over S (+ a tail)       [N, k] torch ops in fp32, differentiated by autograd

The gathered logits cost ``N k H`` multiply-adds; the row blocks of :class:`GatheredLogits`
bound the gathered ``[C, k, H]`` rows, which are gathered again in the backward instead of
being kept. Under tensor parallel each rank gathers the ids it owns and one all-reduce of
``[N, k]`` fp32 (a sum of one value and zeros: exact) gives every rank every ``z``; the
backward sums ``grad_hidden``'s partials over the group as ``linear_logprob`` does.
``tail="renormalize"`` needs no log-sum-exp (``lse`` cancels), so it makes no vocabulary
pass at all: its cost is the gather.

``deterministic=True``: ``lse`` and the entropy come from ``linear_logprob``'s deterministic
path, ``z`` is exact under the TP sum, and the gather's gradients are summed in int64 fixed
point (``lp_kernels.core.fixed_point``): each term ``d l[n, j] * W[id, :]`` (``grad_hidden``)
or ``d l[n, j] * h[n, :]`` (``grad_weight``, ``grad_bias``) is one fp32 product, scaled by a
power of two from a bound every rank computes alike (``sum |d l|`` of the replicated ``d l``
times the global ``max |W|`` per row, or ``max |h|`` per call), rounded and added as
integers. Integer addition is associative, so neither the order of ``index_add_`` nor the
TP all-reduce changes the bits: outputs and gradients are bitwise equal across TP degrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lp_kernels import _checks
from lp_kernels._prepare import Prepared, prepare
from lp_kernels.backends.resolve import resolve_backend
from lp_kernels.core import amp
from lp_kernels.core.fixed_point import MARGIN, exponents, from_fixed_point
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import TopkDivergenceOutput
from lp_kernels.distributed.collectives import global_abs_max

KINDS = ("forward_kl", "reverse_kl", "jsd", "mixed_kl")
TAILS = ("renormalize", "bucket", "none", "truncate")
TAIL_MIN = 2.0**-24
"""The smallest tail mass of ``tail="bucket"``: each side's log top-k mass is clamped at
``log(1 - TAIL_MIN)`` (about ``-6e-8``, the fp32 resolution of ``1 - mass``), so that the
tail's log-prob stays finite when the k ids hold all the mass up to rounding."""
GATHER_ELEMENTS = 1 << 24
"""fp32 elements of one row block's gathered weight rows ``[C, k, H]`` (64 MiB; the block
also holds their products with the hidden rows: elementwise fp32, no TF32 GEMM)."""
IGNORED = -(2**62)
"""The target code of a masked row in the preparation path (its ``ignore_index``)."""
OP = "linear_topk_divergence"


@dataclass(frozen=True)
class TopkOptions:
    """The divergence's options, checked (:func:`check_options`)."""

    kind: str
    """``forward_kl``, ``reverse_kl``, ``jsd`` or ``mixed_kl``."""
    beta: float
    """``jsd``'s teacher weight in the mixture, ``mixed_kl``'s weight of the forward KL."""
    tail: str
    """``renormalize``, ``bucket``, ``none`` or ``truncate``."""
    outside_logprob: float
    """The teacher log-prob ``tail="truncate"`` assumes outside the ids (reverse KL)."""

    @property
    def needs_lse(self) -> bool:
        return self.tail != "renormalize"

    @property
    def needs_entropy(self) -> bool:
        return self.tail == "truncate" and self.kind in ("reverse_kl", "mixed_kl")


def check_options(kind: Any, beta: Any, tail: Any, outside_logprob: Any) -> TopkOptions:
    """The options, each checked (``TypeError`` / ``ValueError`` naming the argument)."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(tail, str) or tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    for name, x in (("beta", beta), ("outside_logprob", outside_logprob)):
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise TypeError(f"{name} must be a Python float, got {type(x).__name__}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for kind='jsd', got {beta}")
    if kind == "mixed_kl" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] for kind='mixed_kl', got {beta}")
    if not (math.isfinite(outside_logprob) and outside_logprob <= 0):
        raise ValueError(f"outside_logprob must be finite and <= 0, got {outside_logprob}")
    return TopkOptions(kind, float(beta), tail, float(outside_logprob))


def _check_constant(x: Any, name: str) -> None:
    if isinstance(x, torch.Tensor) and x.requires_grad:
        raise ValueError(
            f"{name} requires grad, but the teacher is a constant of the divergence (no "
            f"gradient reaches it): pass {name}.detach(), or compute it under torch.no_grad()"
        )


def check_payload(hidden: Any, teacher_ids: Any, teacher_logprobs: Any, mask: Any):
    """``(ids [N, k] int64, lq [N, k] fp32, ignored [N] bool)`` of a call, checked (shapes,
    dtypes, devices, ``requires_grad``); masked rows' ids are 0 and their log-probs 0."""
    _checks.check_tensor(hidden, "hidden")
    _checks.check_tensor(teacher_ids, "teacher_ids")
    _checks.check_tensor(teacher_logprobs, "teacher_logprobs")
    if teacher_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_ids must be int64 (or int32), got {teacher_ids.dtype}")
    _checks.check_float_dtype(teacher_logprobs, "teacher_logprobs")
    _check_constant(teacher_logprobs, "teacher_logprobs")
    lead = hidden.shape[:-1]
    if teacher_ids.dim() != len(lead) + 1 or teacher_ids.shape[:-1] != lead:
        raise ValueError(
            f"teacher_ids must be [*, k] with hidden's leading shape {tuple(lead)}, got "
            f"{tuple(teacher_ids.shape)}"
        )
    if teacher_ids.shape[-1] == 0:
        raise ValueError("teacher_ids must hold at least one id per row (k >= 1), got k = 0")
    if teacher_logprobs.shape != teacher_ids.shape:
        raise ValueError(
            f"teacher_logprobs must have teacher_ids' shape {tuple(teacher_ids.shape)}, got "
            f"{tuple(teacher_logprobs.shape)}"
        )
    for x, name in ((teacher_ids, "teacher_ids"), (teacher_logprobs, "teacher_logprobs")):
        if x.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {x.device}")
    ignored = _ignored_rows(mask, lead, hidden.device)
    k = teacher_ids.shape[-1]
    ids = teacher_ids.reshape(-1, k).long()
    ids = torch.where(ignored[:, None], 0, ids)
    lq = torch.where(ignored[:, None], 0.0, teacher_logprobs.reshape(-1, k).float())
    return ids, lq, ignored


def _ignored_rows(mask: Any, lead: torch.Size, device: torch.device) -> torch.Tensor:
    """``[N]`` bool: True for the rows ``mask`` leaves out."""
    if mask is None:
        return torch.zeros(lead.numel(), dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype
        raise TypeError(f"mask must be None or a bool tensor, got {what}")
    if mask.shape != lead or mask.device != device:
        raise ValueError(
            f"mask must have hidden's leading shape {tuple(lead)} on {device}, got "
            f"{tuple(mask.shape)} on {mask.device}"
        )
    return ~mask.reshape(-1)


def row_codes(ids: torch.Tensor, lq: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 targets for the preparation path that carry the payload's verdict: a
    row's smallest id if it is negative, else its largest; -1 for a row that repeats an id
    or holds a NaN or ``+inf`` log-prob; :data:`IGNORED` for a masked row. The per-call rank
    record then raises on every rank for an id out of range, a repeated id or a bad
    log-prob, and for ranks that disagree on them."""
    lo, hi = ids.amin(dim=1), ids.amax(dim=1)
    code = torch.where(lo < 0, lo, hi)
    bad = _repeats(ids) | (torch.isnan(lq) | (lq == math.inf)).any(dim=1)
    code = torch.where(bad, -1, code)
    return torch.where(ignored, IGNORED, code)


def _repeats(ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the row holds an id twice."""
    s = ids.sort(dim=1).values
    return (s[:, 1:] == s[:, :-1]).any(dim=1)


def check_ids(ids: torch.Tensor, lq: torch.Tensor, ignored: torch.Tensor, vocab_size: int):
    """Raise ``ValueError`` for ids outside ``[0, vocab_size)``, a repeated id in a row, or a
    NaN or ``+inf`` teacher log-prob, on the rows kept (one host sync)."""
    keep = ~ignored[:, None]
    bad_id = keep & ((ids < 0) | (ids >= vocab_size))
    bad_lq = keep & (torch.isnan(lq) | (lq == math.inf))
    rep = ~ignored & _repeats(ids)
    counts = torch.stack([bad_id.sum(), rep.sum(), bad_lq.sum()]).tolist()
    if counts[0]:
        n, j = (int(x) for x in bad_id.nonzero()[0])
        raise ValueError(
            f"teacher_ids must be in [0, {vocab_size}) on the rows kept: {counts[0]} are not "
            f"(first: row {n}, slot {j}, id {int(ids[n, j])})"
        )
    if counts[1]:
        n = int(rep.nonzero()[0])
        raise ValueError(
            f"teacher_ids repeats an id within a row on {counts[1]} rows (first: row {n}); "
            "each row must list k distinct ids (drop or mask the repeats)"
        )
    if counts[2]:
        raise ValueError(f"teacher_logprobs holds {counts[2]} NaN or +inf values on rows kept")


@dataclass(frozen=True)
class GatherParams:
    """The gathered logits' options: the transform and this rank's layout."""

    transform: LogitTransform
    vocab_start: int
    v_real: int
    """This rank's real vocabulary rows (padding rows excluded)."""
    tp_group: Any
    tp_size: int
    reduce_grad_hidden: bool
    deterministic: bool


def _owned(ids: torch.Tensor, ignored: torch.Tensor, gp: GatherParams):
    """``(rows [N, k] local weight rows (0 where not owned), owned [N, k] bool)``."""
    local = ids - gp.vocab_start
    owned = (local >= 0) & (local < gp.v_real) & ~ignored[:, None]
    return torch.where(owned, local, 0), owned


def _blocks(n: int, k: int, h: int):
    """Row blocks ``(r0, r1)`` whose gathered rows ``[C, k, H]`` hold about
    :data:`GATHER_ELEMENTS` (from k and H only: the same blocks on every layout)."""
    rows = max(1, GATHER_ELEMENTS // max(1, k * h))
    return [(r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]


class GatheredLogits(torch.autograd.Function):
    """``z [N, k]`` fp32: the student's transformed logits at each row's ids.

    Forward: each rank's owned ids, gathered in row blocks (fp32 products and sums), the raw
    logits summed over the group (all-reduce; exact), the transform. Backward: ``d l`` from
    ``d z``; the gradients from owned ids, rows gathered again; ``grad_hidden`` summed over
    the group unless ``reduce_grad_hidden=False``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, ignored, gp: GatherParams):
        rows, owned = _owned(ids, ignored, gp)
        n, k = ids.shape
        l = torch.zeros((n, k), dtype=torch.float32, device=hidden.device)
        for r0, r1 in _blocks(n, k, hidden.shape[1]) if weight.shape[0] else ():
            h = torch.where(ignored[r0:r1, None], 0.0, hidden[r0:r1].float())
            w = weight[rows[r0:r1]].float()  # [C, k, H]
            l[r0:r1] = (w * h[:, None, :]).sum(dim=-1)
        if bias is not None:
            l += bias[rows].float()
        l = torch.where(owned, l, 0.0)
        if gp.tp_size > 1:
            dist.all_reduce(l, op=dist.ReduceOp.SUM, group=gp.tp_group)
        slope = gp.transform.apply_(l, slope=True)
        ctx.save_for_backward(hidden, weight, bias, rows, owned, ignored, slope)
        ctx.gp = gp
        return l

    @staticmethod
    def backward(ctx, dz):
        hidden, weight, bias, rows, owned, ignored, slope = ctx.saved_tensors
        gp: GatherParams = ctx.gp
        dl = gp.transform.chain_(dz.float().clone(), slope)
        dl = torch.where(ignored[:, None], 0.0, dl)
        needs = ctx.needs_input_grad
        gh = _grad_hidden(hidden, weight, rows, owned, dl, gp) if needs[0] else None
        gw = _grad_rows(hidden, weight, rows, owned, ignored, dl, gp) if needs[1] else None
        gb = None
        if bias is not None and needs[2]:
            ones = torch.ones((hidden.shape[0], 1), dtype=torch.float32, device=dl.device)
            gb = _grad_rows(ones, bias[:, None], rows, owned, ignored, dl, gp)[:, 0]
        return gh, gw, gb, None, None, None


def _grad_hidden(hidden, weight, rows, owned, dl, gp: GatherParams) -> torch.Tensor:
    """``sum_j d l[n, j] W[id_nj]`` over this rank's ids (summed over the group unless
    ``reduce_grad_hidden=False``), in ``hidden``'s dtype; fixed point if deterministic."""
    n, k = dl.shape
    d = torch.where(owned, dl, 0.0)
    det = gp.deterministic
    if det:
        w_abs = global_abs_max(weight[: gp.v_real], gp.tp_group, gp.tp_size)
        bound = dl.double().abs().sum(dim=1) * w_abs * MARGIN
        e = exponents(bound)
        scale = torch.exp2(e)[:, None]
    acc_type = torch.int64 if det else torch.float32
    out = torch.zeros((n, hidden.shape[1]), dtype=acc_type, device=hidden.device)
    for r0, r1 in _blocks(n, k, hidden.shape[1]) if weight.shape[0] else ():
        terms = d[r0:r1, :, None] * weight[rows[r0:r1]].float()  # [C, k, H]
        if det:
            out[r0:r1] = torch.round(terms.double() * scale[r0:r1, :, None]).long().sum(dim=1)
        else:
            out[r0:r1] = terms.sum(dim=1)
    if gp.tp_size > 1 and gp.reduce_grad_hidden:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=gp.tp_group)
    if det:
        return from_fixed_point(out, e, ~torch.isfinite(bound), hidden.dtype)
    return out.to(hidden.dtype)


def _grad_rows(hidden, weight, rows, owned, ignored, dl, gp: GatherParams) -> torch.Tensor:
    """``grad_weight [V_local, H]`` (``weight``'s dtype): ``sum d l[n, j] h[n]`` into each
    owned row, accumulated over the touched rows only; fixed point if deterministic."""
    h_all = torch.where(ignored[:, None], 0.0, hidden.float())
    picked = owned.nonzero()  # [M, 2] in (row, slot) order
    local = rows[owned]
    unique, where = torch.unique(local, return_inverse=True)
    width = hidden.shape[1]
    det = gp.deterministic
    if det:  # one exponent per call, from replicated quantities: the same on every layout
        bound = dl.double().abs().sum() * h_all.abs().amax().double() * MARGIN
        e = exponents(bound.reshape(1))
        scale = torch.exp2(e)
    acc_type = torch.int64 if det else torch.float32
    acc = torch.zeros((unique.numel(), width), dtype=acc_type, device=hidden.device)
    step = max(1, GATHER_ELEMENTS // max(1, width))
    for i0 in range(0, picked.shape[0], step):
        n_i, j_i = picked[i0 : i0 + step].unbind(dim=1)
        terms = dl[n_i, j_i, None] * h_all[n_i]  # [M_i, H]
        if det:
            terms = torch.round(terms.double() * scale).long()
        acc.index_add_(0, where[i0 : i0 + step], terms)
    if det:
        bad = ~torch.isfinite(bound.reshape(1)).expand(unique.numel())
        acc = from_fixed_point(acc, e.expand(unique.numel()), bad, torch.float32)
    grad = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    grad[unique] = acc.to(weight.dtype)
    return grad


def _logaddexp_weights(lt: torch.Tensor, ls: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta e^lt + (1 - beta) e^ls)``."""
    return torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))


def _wsum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum w x`` over the last dimension, a term with ``w = 0`` taken as 0."""
    return torch.where(w > 0, w * x, 0.0).sum(dim=-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x <= log(1 - TAIL_MIN)`` (both branches finite there)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _with_tail(logp: torch.Tensor) -> torch.Tensor:
    """``[N, k + 1]``: the log-probs and the tail bucket ``log(1 - sum e^logp)``."""
    mass = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=math.log1p(-TAIL_MIN))
    return torch.cat([logp, _log1mexp(mass)], dim=-1)


def _divergence(ls, lt, kind: str, beta: float, outside=None) -> torch.Tensor:
    """The divergence over the last dimension between the student's ``ls`` and the
    teacher's ``lt`` log-probs; ``outside``: ``(P_out, sum_out p lp, c)`` of ``truncate``."""
    s, t = torch.exp(ls), torch.exp(lt)
    fwd = _wsum(t, lt - ls)
    if kind == "forward_kl":
        return fwd
    if kind == "jsd":
        lm = _logaddexp_weights(lt, ls, beta)
        div = beta * _wsum(t, lt - lm) + (1.0 - beta) * _wsum(s, ls - lm)
        if outside is not None:  # outside S: m = (1 - beta) p, so lp - lm = -log(1 - beta)
            div = div - (1.0 - beta) * math.log1p(-beta) * outside[0]
        return div
    rev = _wsum(s, ls - lt)
    if outside is not None:
        p_out, plp_out, c = outside
        rev = rev + plp_out - c * p_out
    return rev if kind == "reverse_kl" else beta * fwd + (1.0 - beta) * rev


def topk_rows(z, lse, entropy, lq, o: TopkOptions):
    """``(divergence, student_mass, teacher_mass)`` ``[N]`` fp32 from the student's ``z``
    ``[N, k]``, its ``lse`` and entropy ``[N]`` (None where not needed) and the teacher's
    ``lq [N, k]`` (see :func:`lp_kernels.linear_topk_divergence` for the formulas)."""
    teacher_mass = torch.exp(torch.logsumexp(lq, dim=-1))
    if o.tail == "renormalize":
        ls = z - torch.logsumexp(z, dim=-1, keepdim=True)
        lt = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
        return _divergence(ls, lt, o.kind, o.beta), None, teacher_mass
    lp = z - lse[:, None]
    log_mass = torch.logsumexp(lp, dim=-1)
    if o.tail == "bucket":
        div = _divergence(_with_tail(lp), _with_tail(lq), o.kind, o.beta)
    elif o.tail == "none":
        div = _divergence(lp, lq, o.kind, o.beta)
    else:
        lt = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
        p_out = -torch.expm1(log_mass)
        plp_out = None if entropy is None else -entropy - _wsum(torch.exp(lp), lp)
        div = _divergence(lp, lt, o.kind, o.beta, (p_out, plp_out, o.outside_logprob))
    return div, torch.exp(log_mass).detach(), teacher_mass


def _prepared(hidden, weight, codes, transform, o: TopkOptions, args: dict) -> Prepared:
    """The preparation path's checks, layout and per-call record for this call."""
    group = args["tp_group"]
    exchange = args["validate"] and group is not None and dist.get_world_size(group) > 1
    record = (OP, o.kind, o.beta, o.tail, o.outside_logprob, args["k"], args["lq_dtype"])
    return prepare(
        hidden,
        weight,
        codes,
        transform,
        bias=args["bias"],
        ignore_index=IGNORED,
        return_entropy=o.needs_entropy,
        return_lse=True,
        tp_group=group,
        vocab_start=args["vocab_start"],
        vocab_size=args["vocab_size"],
        reduce_grad_hidden=args["reduce_grad_hidden"],
        deterministic=args["deterministic"],
        deterministic_tile=args["deterministic_tile"],
        backend=args["backend"],
        chunk_size=args["chunk_size"],
        validate=exchange,  # else the ids are checked here, with their own messages
        hint=f"({OP} passes each row's extreme teacher_ids as the targets: its smallest if "
        "negative, else its largest; -1 for a row that repeats an id or holds a NaN or +inf "
        "teacher_logprobs value)",
        divergence=record,
    )


def topk_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    transform: LogitTransform,
    o: TopkOptions,
    args: dict,
) -> TopkDivergenceOutput:
    """:func:`lp_kernels.linear_topk_divergence` for a checked transform and options;
    ``args``: the op's other arguments (``mask``, ``bias``, the layout and backend ones)."""
    ids, lq, ignored = check_payload(hidden, teacher_ids, teacher_logprobs, args["mask"])
    lead = hidden.shape[:-1]
    args = args | {"k": ids.shape[1], "lq_dtype": str(teacher_logprobs.dtype)}
    flat = hidden.reshape(-1, hidden.shape[-1])
    if args["mask"] is not None:  # masked rows may hold NaN: 0 * NaN in a gradient GEMM
        flat = torch.where(ignored[:, None], 0.0, flat).to(flat.dtype)
    prep = _prepared(flat, weight, row_codes(ids, lq, ignored), transform, o, args)
    p = prep.params
    if args["validate"] and not (p.tp_size > 1):
        check_ids(ids, lq, ignored, p.vocab_size)
    v_real = max(0, min(prep.weight.shape[0], p.vocab_size - p.vocab_start))
    gp = GatherParams(
        transform, p.vocab_start, v_real, p.tp_group, p.tp_size, p.reduce_grad_hidden,
        p.deterministic,
    )  # fmt: skip
    lse = entropy = None
    with amp.autocast_off(prep.inputs.device):  # lp's precision policy is its own
        if o.needs_lse:
            device, det = prep.inputs.device, p.deterministic
            function = resolve_backend(args["backend"], device, deterministic=det)
            targets = torch.where(ignored, IGNORED, ids[:, 0])  # not the codes' -1
            out = function.apply(prep.inputs, prep.weight, prep.bias, targets, p)
            entropy, lse = out[1], out[2]
        z = GatheredLogits.apply(prep.inputs, prep.weight, prep.bias, ids, ignored, gp)
        div, s_mass, t_mass = topk_rows(z, lse, entropy, lq, o)
    zero = torch.zeros((), dtype=torch.float32, device=div.device)
    div = torch.where(ignored, zero, div)
    s_mass = None if s_mass is None else torch.where(ignored, zero, s_mass).view(lead)
    t_mass = torch.where(ignored, zero, t_mass)
    return TopkDivergenceOutput(div.view(lead), s_mass, t_mass.view(lead))
