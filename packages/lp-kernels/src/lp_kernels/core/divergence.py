"""Divergences between a student's and a teacher's next-token distributions: per-row sums
and the student's logit gradient, from fp32 softmax arguments of one block of rows.

With ``z`` the student's and ``y`` the teacher's softmax arguments over a row's real columns
(the whole logit transform of each side applied), ``lp = z - lse(z)``, ``lq = y - lse(y)``,
``p = exp(lp)``, ``q = exp(lq)`` and, for ``jsd``, ``lm = log(beta q + (1 - beta) p)``::

    kind          divergence D                          d D / d z_v
    forward_kl    sum q (lq - lp)                        p_v - q_v
    reverse_kl    sum p (lp - lq)                        p_v (lp_v - lq_v - D)
    jsd           beta sum q (lq - lm)                   (1 - beta) p_v (lp_v - lm_v - K)
                  + (1 - beta) K,  K = sum p (lp - lm)

    student entropy -sum p lp,  teacher entropy -sum q lq

Every sum is over a block's columns (a shard's, under tensor parallel); the log-sum-exps
are the whole vocabulary's, so the blocks' sums add up to the row's. A term whose weight
(``p`` or ``q``) is exactly 0 is 0, so ``-inf`` entries (a masked vocabulary, a top-k
teacher) drop out: ``forward_kl`` and ``jsd`` stay finite where ``q = 0``; ``reverse_kl``
is ``+inf`` where ``p > 0 = q``, its true value. ``lp - lq`` is formed as ``(z - y) - (lse(z)
- lse(y))``, one rounding of the row's constant, not two large numbers cancelling.
All of it in fp32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogprobParams

Kind = Literal["forward_kl", "reverse_kl", "jsd"]
KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")

N_SUMS = 5
"""Per-row sums a block reports: the divergence, the two entropies, ``K`` (``jsd``) and
``A``, the sum of the gradient's terms' magnitudes before the row's constant (``sum p |lp -
lq|``, ``jsd``: ``sum p |lp - lm|``; 0 for ``forward_kl``), which bounds ``sum |d D / d z|``
(:func:`grad_bound`)."""


N_SAVED = 4
"""Per-row statistics the backward reads: lse(z), lse(y), the divergence, ``K``."""


@dataclass(frozen=True)
class DivergenceParams:
    """One divergence call's resolved options: the student's :class:`LogprobParams` (its
    transform, layout, chunk), the teacher's transform, the kind, ``beta`` and the backend
    (``"torch"`` or ``"triton"``)."""

    student: LogprobParams
    teacher_transform: LogitTransform
    kind: str
    beta: float
    backend: str = "torch"

    @property
    def teacher(self) -> LogprobParams:
        """The student's params with the teacher's transform."""
        return dataclasses.replace(self.student, transform=self.teacher_transform)


def check_kind(kind, beta) -> float:
    """``beta`` as a float after checking ``kind`` and ``beta`` (``TypeError`` /
    ``ValueError`` naming the argument); ``beta`` is read by ``jsd`` only."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise TypeError(f"beta must be a Python float, got {type(beta).__name__}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for kind='jsd', got {beta}")
    return float(beta)


def _weighted(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum w x`` over columns, a term with ``w = 0`` taken as 0 (``x`` may be infinite)."""
    return torch.where(w > 0, w * x, 0.0).sum(dim=1)


def mixture_gaps(d: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp - lm, lq - lm)`` from ``d = lp - lq``: with ``r = lm - lp = log((1 - beta) +
    beta e^-d)``, a log-sum-exp of two O(1) terms where ``p`` and ``q`` are close (no
    cancellation of the large ``lp`` and ``lm``); ``lq - lm = -d - r``, and ``-log beta``
    where ``p = 0``."""
    r = torch.logaddexp(torch.full_like(d, math.log1p(-beta)), math.log(beta) - d)
    return -r, torch.where(torch.isinf(d) & (d < 0), -math.log(beta), -d - r)


def block_sums(
    z: torch.Tensor,
    y: torch.Tensor,
    lse_s: torch.Tensor,
    lse_t: torch.Tensor,
    kind: str,
    beta: float,
) -> torch.Tensor:
    """``[C, 5]``: this block's part of each row's divergence, student entropy, teacher
    entropy, ``K`` (0 unless ``jsd``) and ``A`` (:data:`N_SUMS`), for ``z``, ``y`` ``[C,
    Vr]`` and the rows' whole log-sum-exps ``lse_s``, ``lse_t`` ``[C]``."""
    lp = z - lse_s[:, None]
    lq = y - lse_t[:, None]
    p, q = torch.exp(lp), torch.exp(lq)
    out = torch.zeros((z.shape[0], N_SUMS), dtype=torch.float32, device=z.device)
    out[:, 1] = -_weighted(p, lp)
    out[:, 2] = -_weighted(q, lq)
    d = (z - y) - (lse_s - lse_t)[:, None]  # lp - lq
    if kind == "jsd":
        gap_p, gap_q = mixture_gaps(d, beta)
        k = _weighted(p, gap_p)
        out[:, 0] = beta * _weighted(q, gap_q) + (1.0 - beta) * k
        out[:, 3] = k
        out[:, 4] = _weighted(p, gap_p.abs())
        return out
    if kind == "reverse_kl":
        out[:, 0] = _weighted(p, d)
        out[:, 4] = _weighted(p, d.abs())
    else:
        out[:, 0] = _weighted(q, -d)
    return out


def grad_bound(div: torch.Tensor, k: torch.Tensor, a: torch.Tensor, kind: str, beta: float):
    """A float64 bound on ``sum_v |d D / d z_v|`` per row from its divergence, ``K`` and
    ``A``: ``sum |p - q| <= 2``; ``sum p |lp - lq - D| <= A + |D|``; ``(1 - beta) sum p |lp
    - lm - K| <= (1 - beta) (A + |K|)``."""
    if kind == "forward_kl":
        return torch.full(div.shape, 2.0, dtype=torch.float64, device=div.device)
    if kind == "reverse_kl":
        return a.double() + div.double().abs()
    return (1.0 - beta) * (a.double() + k.double().abs())


def d_student_(
    z: torch.Tensor,
    y: torch.Tensor,
    lse_s: torch.Tensor,
    lse_t: torch.Tensor,
    div: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    kind: str,
    beta: float,
) -> torch.Tensor:
    """``d loss / d z`` for a per-row upstream gradient ``g [C]`` of the divergence, in
    ``z``'s storage (``z`` is overwritten). ``div`` and ``k`` are the rows' whole
    divergence and ``K``; a row with ``g = 0`` gets exact zeros."""
    lp = z - lse_s[:, None]
    p = torch.exp(lp)
    if kind == "forward_kl":
        dz = p - torch.exp(y - lse_t[:, None])
    elif kind == "reverse_kl":
        d = (z - y) - (lse_s - lse_t)[:, None]
        dz = torch.where(p > 0, p * (d - div[:, None]), 0.0)
    else:
        gap_p, _ = mixture_gaps((z - y) - (lse_s - lse_t)[:, None], beta)
        dz = torch.where(p > 0, (1.0 - beta) * p * (gap_p - k[:, None]), 0.0)
    dz = torch.where(g[:, None] != 0, dz * g[:, None], 0.0)
    return z.copy_(dz)
