"""Per-token RL losses for ``linear_logprob_loss``, the weights that aggregate them, and the
reduction of a distillation divergence.

Every loss here is elementwise: row i's value depends on row i's inputs only, so the op
may evaluate it on any chunk of rows and sum the results. A loss object is called as
``loss_fn(logprob, entropy, lse, **per_token) -> [n]`` with ``logprob`` and ``lse`` fp32
``[n]`` (differentiated by autograd), ``entropy`` fp32 ``[n]`` or None (the op computes
it only when ``loss_fn.needs_entropy``), and constant per-token tensors ``[n]``. The op
sums the returned vector, so the aggregation (token mean, sequence mean...) lives in the
per-token ``weights`` that :func:`token_weights` builds. Ignored rows are evaluated at
all-zero inputs and then masked out; every loss is finite there.

With ``r = exp(logprob - old_logprob)`` and ``d = ref_logprob - logprob``:

====================  ====================================================================
``kl_k1``             ``logprob - ref_logprob``
``kl_k2``             ``0.5 (logprob - ref_logprob)^2``
``kl_k3``             ``exp(d) - d - 1`` (>= 0; clamped as verl's ``low_var_kl`` by default)
``clipped_surrogate`` ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``; with a dual
                      clip ``c``, for ``A < 0``: ``min(that, -c A)``
``PolicyLoss``        ``w (surrogate + kl_coef KL - entropy_coef H + z_loss_coef lse^2)``
====================  ====================================================================

The named constructors and the aggregation each paper uses:

=============  ========================================  ==============================
``grpo()``     clip 0.2, KL k3 with coefficient 0.04     ``"seq-mean-token-mean"``
``dapo()``     clip 0.2 / 0.28 (clip-higher), no KL      ``"token-mean"``
``dr_grpo()``  clip 0.2, no KL                           ``"seq-mean-token-sum-norm"``
``ppo()``      clip 0.2, optional dual clip              ``"token-mean"``
=============  ========================================  ==============================

Distillation: ``lp_kernels.linear_divergence`` returns a per-row ``divergence`` ``[*]``
(0 on masked rows); :func:`distill_loss` reduces it to the scalar a trainer backpropagates:

===================================  ============================================================
``reduction="token-mean"``           ``sum(divergence[mask]) / count(mask)`` (TRL's GKD loss)
``... num_items_in_batch=n``         ``sum(divergence[mask]) / n``: transformers' Trainer mean,
                                     correct under gradient accumulation
``reduction="sum"``                  ``sum(divergence[mask])``
===================================  ============================================================

Numerics: the ratio's log is clamped to ``[-max_log_ratio, max_log_ratio]`` (20 by default,
as verl does) before ``exp``, so neither the surrogate nor k3 overflows. k3 near ``d = 0``
is a difference of nearly equal terms: the naive ``exp(d) - d - 1`` in fp32 is 5% off at
``|d| = 1e-3`` and 0 below 3e-4, and ``expm1(d) - d`` still loses ``~1e-7 / |d|``
relative; so for ``|d| < 1/2`` it is summed from its Taylor series (to ``d^12 / 12!``)
and its value and gradient keep fp32's full relative accuracy (fp64: about 1e-12). Clip
bounds are inclusive: a ratio exactly on a bound gets the unclipped gradient.

Example::

    >>> import torch
    >>> from lp_kernels.losses import dapo, token_weights
    >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> w = token_weights(mask, "token-mean")[mask.bool()]  # the completion tokens' rows
    >>> lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    >>> adv = torch.tensor([1.0, 1.0, -1.0])
    >>> loss = dapo()(lp, None, torch.zeros(3), old_logprob=None, advantages=adv, weights=w)
    >>> loss.sum().backward()
    >>> lp.grad
    tensor([-0.3333, -0.3333,  0.3333])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
AggregationMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
_KL_ESTIMATORS = ("k1", "k2", "k3")
_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
DistillReduction = Literal["token-mean", "sum"]
_DISTILL_REDUCTIONS = ("token-mean", "sum")


def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 estimate of ``KL(pi || ref)`` from tokens sampled by pi: ``logprob - ref_logprob``.

    Unbiased but high-variance, and negative on some tokens. Shapes broadcast; ``[n]`` fp32
    in, ``[n]`` out.
    """
    return logprob - ref_logprob


def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 estimate of ``KL(pi || ref)``: ``0.5 (logprob - ref_logprob)^2``.

    Non-negative, low-variance, biased; its gradient is that of the true KL to first order.
    """
    return 0.5 * (logprob - ref_logprob).square()


# 1/k! for k = K down to 2: the Taylor coefficients of exp(d) - 1 - d, for Horner's rule.
# Below |d| = 1/2 the first term left out, d^(K+1) / (K+1)!, is under 2 (1/2)^(K-1) / (K+1)!
# of the sum's d^2 / 2: 2e-9 for K = 9 (fp32 and narrower), 1.6e-13 for K = 12 (fp64).
_TAYLOR = {
    "short": tuple(1.0 / math.factorial(k) for k in range(9, 1, -1)),
    "long": tuple(1.0 / math.factorial(k) for k in range(12, 1, -1)),
}


def _expm1_minus_identity(d: torch.Tensor) -> torch.Tensor:
    """``exp(d) - 1 - d`` to full relative accuracy: Taylor series for ``|d| < 1/2``."""
    small = d.abs() < 0.5
    x = torch.where(small, d, 0.0)  # the unused branch stays finite, so its gradient is 0
    coefs = _TAYLOR["long" if d.dtype == torch.float64 else "short"]
    poly = torch.full_like(x, coefs[0])
    for c in coefs[1:]:
        poly = poly * x + c
    return torch.where(small, poly * x.square(), torch.expm1(d) - d)


def kl_k3(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    *,
    max_log_ratio: float | None = 20.0,
    max_kl: float | None = 10.0,
) -> torch.Tensor:
    """k3 estimate of ``KL(pi || ref)``: ``exp(d) - d - 1`` with ``d = ref_logprob - logprob``.

    Schulman's unbiased, low-variance, non-negative estimator ("Approximating KL
    Divergence", 2020), GRPO's KL term. Accurate to rounding near ``d = 0`` (see the
    module docstring).

    Args:
        logprob: ``[n]`` float log-probs of the sampled tokens under the policy.
        ref_logprob: ``[n]`` float log-probs under the reference policy (a constant).
        max_log_ratio: ``d`` is clamped to ``[-max_log_ratio, max_log_ratio]`` first (no
            gradient at or past it); None: no clamp. The default 20 is verl's ``low_var_kl``.
        max_kl: the estimate is clamped to ``[-max_kl, max_kl]`` (no gradient at or past
            it); None: no clamp. The default 10 is verl's ``low_var_kl``.

    Returns:
        ``[n]`` the per-token estimate, in the promoted dtype of the inputs.
    """
    return _k3_parts(logprob, ref_logprob, max_log_ratio, max_kl, grad=False)[0]


def _k3_parts(logprob, ref_logprob, max_log_ratio, max_kl, *, grad: bool):
    """``(kl_k3, d kl_k3 / d logprob or None)``: the value by :func:`kl_k3`'s operations;
    the derivative ``-expm1(d)`` where neither clamp is past its bound (a clamp passes the
    gradient at its bound, as autograd's does), else 0."""
    d = ref_logprob - logprob
    live = None
    if max_log_ratio is not None:
        if grad:
            live = (d >= -max_log_ratio) & (d <= max_log_ratio)
        d = d.clamp(-max_log_ratio, max_log_ratio)
    kl = _expm1_minus_identity(d)
    if max_kl is not None:
        if grad:
            inside = (kl >= -max_kl) & (kl <= max_kl)
            live = inside if live is None else live & inside
        kl = kl.clamp(-max_kl, max_kl)
    if not grad:
        return kl, None
    slope = -torch.expm1(d)
    return kl, slope if live is None else torch.where(live, slope, 0.0)


def clipped_surrogate(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    *,
    max_log_ratio: float | None = 20.0,
) -> torch.Tensor:
    """PPO's clipped objective as a per-token loss: ``-min(r A, clip(r, 1 - lo, 1 + hi) A)``.

    ``r = exp(logprob - old_logprob)``. Equivalently ``-A min(r, 1 + hi)`` where ``A >= 0``
    and ``-A max(r, 1 - lo)`` where ``A < 0``: the gradient w.r.t. ``logprob`` is ``-A r``
    inside the trust region and 0 where the ratio is clipped. With ``dual_clip = c > 1``
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games"), tokens with ``A < 0`` take
    ``min(that, -c A)``, which bounds the loss of a ratio that ran far above 1. Bounds are
    inclusive (a ratio exactly on one gets the unclipped gradient).

    Args:
        logprob: ``[n]`` float log-probs of the sampled tokens under the current policy.
        old_logprob: ``[n]`` float log-probs under the policy that sampled them (constant).
        advantages: ``[n]`` float advantages (constant).
        clip_low: ``eps_low``, the ratio's lower bound is ``1 - clip_low``.
        clip_high: ``eps_high``, the ratio's upper bound is ``1 + clip_high``.
        dual_clip: None, or ``c > 1``.
        max_log_ratio: ``logprob - old_logprob`` is clamped to ``[-max_log_ratio,
            max_log_ratio]`` before ``exp`` (no gradient at or past it), as verl does with
            20, the default; the ratio then stays below 5e8, finite in fp32. None: no clamp.

    Returns:
        ``[n]`` per-token loss (the negated objective), in the promoted dtype of the inputs.
    """
    clip = (clip_low, clip_high, dual_clip)
    return _surrogate_parts(logprob, old_logprob, advantages, *clip, max_log_ratio, grad=False)[0]


def _surrogate_parts(
    logprob, old_logprob, advantages, clip_low, clip_high, dual_clip, max_log_ratio, *, grad
):
    """``(clipped_surrogate, its derivative with respect to logprob or None)``: the value by
    the same operations; the derivative ``-A r`` where the bound in use does not clip the
    ratio and the log-ratio clamp is not past its bound, else 0."""
    log_ratio = logprob - old_logprob
    live = None
    if max_log_ratio is not None:
        if grad:
            live = (log_ratio >= -max_log_ratio) & (log_ratio <= max_log_ratio)
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)
    # min(.) keeps min(r, 1 + hi) where A >= 0 and max(r, 1 - lo) where A < 0; where instead
    # of clamp, whose gradient is 0 at the bound itself (the bounds are inclusive here)
    above = ratio > 1.0 + clip_high
    below = ratio < 1.0 - clip_low
    upper = torch.where(above, 1.0 + clip_high, ratio)
    lower = torch.where(below, 1.0 - clip_low, ratio)
    if dual_clip is not None:
        past_dual = ratio > dual_clip
        lower = torch.where(past_dual, dual_clip, lower)
        below = below | past_dual
    positive = advantages >= 0
    neg_adv = -advantages
    value = neg_adv * torch.where(positive, upper, lower)
    if not grad:
        return value, None
    clipped = torch.where(positive, above, below)
    if live is not None:
        clipped = clipped | ~live
    return value, torch.where(clipped, 0.0, neg_adv * ratio)


def _reject(field: str, expected: str, value: Any) -> None:
    raise ValueError(f"{field} must be {expected}, got {value!r}")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class PolicyLoss:
    """Clipped policy-gradient loss with optional KL, entropy bonus and z-loss, per token.

    ``loss = weights * (clipped_surrogate + kl_coef * KL(logprob vs ref_logprob)
    - entropy_coef * entropy + z_loss_coef * lse^2)``. Use a named constructor
    (:func:`grpo`, :func:`dapo`, :func:`dr_grpo`, :func:`ppo`) for a paper's defaults.
    """

    clip_low: float = 0.2
    """``eps_low`` in ``[0, 1)``: the ratio's lower bound is ``1 - clip_low``."""
    clip_high: float = 0.2
    """``eps_high >= 0``: the ratio's upper bound is ``1 + clip_high``."""
    dual_clip: float | None = None
    """None, or ``c > 1``: for ``A < 0`` the surrogate is capped at ``-c A``."""
    kl_coef: float = 0.0
    """``>= 0``; non-zero needs ``ref_logprob`` at call time."""
    kl_estimator: KLEstimator = "k3"
    """``"k1"``, ``"k2"`` or ``"k3"`` (:func:`kl_k1`, :func:`kl_k2`, :func:`kl_k3`)."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``loss -= entropy_coef * entropy`` (negative penalizes entropy)."""
    z_loss_coef: float = 0.0
    """``>= 0``: ``loss += z_loss_coef * lse^2`` keeps the log-partition near 0."""
    max_log_ratio: float | None = 20.0
    """Clamp of the log-ratio before ``exp`` in the surrogate and k3; None: no clamp."""
    max_kl: float | None = 10.0
    """Clamp of the k3 estimate (verl's ``low_var_kl``); None: no clamp."""

    def __post_init__(self) -> None:
        if not (_real(self.clip_low) and 0 <= self.clip_low < 1):
            _reject(
                "clip_low", "a float in [0, 1) (the lower bound 1 - clip_low > 0)", self.clip_low
            )
        if not (_real(self.clip_high) and self.clip_high >= 0):
            _reject("clip_high", "a float >= 0", self.clip_high)
        if self.dual_clip is not None and not (_real(self.dual_clip) and self.dual_clip > 1):
            _reject("dual_clip", "None or a float > 1 (3.0 is common)", self.dual_clip)
        if not (_real(self.kl_coef) and self.kl_coef >= 0):
            _reject("kl_coef", "a float >= 0", self.kl_coef)
        if self.kl_estimator not in _KL_ESTIMATORS:
            _reject("kl_estimator", f"one of {_KL_ESTIMATORS}", self.kl_estimator)
        if not _real(self.entropy_coef):
            _reject("entropy_coef", "a finite float", self.entropy_coef)
        if not (_real(self.z_loss_coef) and self.z_loss_coef >= 0):
            _reject("z_loss_coef", "a float >= 0", self.z_loss_coef)
        for name in ("max_log_ratio", "max_kl"):
            value = getattr(self, name)
            if value is not None and not (_real(value) and value > 0):
                _reject(name, "None or a float > 0", value)

    @property
    def needs_entropy(self) -> bool:
        """Whether the op must compute the entropy (``entropy_coef != 0``)."""
        return self.entropy_coef != 0

    def __call__(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        lse: torch.Tensor | None,
        *,
        old_logprob: torch.Tensor | None = None,
        advantages: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprob: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss ``[n]``; the caller (or ``linear_logprob_loss``) sums it.

        Args:
            logprob: ``[n]`` fp32 log-probs of the sampled tokens (differentiated).
            entropy: ``[n]`` fp32 entropy per row, or None; needed when ``entropy_coef != 0``.
            lse: ``[n]`` fp32 log-sum-exp per row, or None; needed when ``z_loss_coef != 0``.
            old_logprob: ``[n]`` log-probs under the sampling policy, or None for on-policy
                updates: then ``logprob.detach()`` stands in, the ratio is 1 and the
                surrogate's gradient is ``-A dlogprob`` (plain policy gradient).
            advantages: ``[n]`` advantages.
            weights: ``[n]`` per-token weights (e.g. from :func:`token_weights`), or None
                for 1 (the op's sum is then a plain token sum).
            ref_logprob: ``[n]`` reference-policy log-probs; needed when ``kl_coef != 0``.

        Returns:
            ``[n]`` per-token loss (fp32 for fp32 ``logprob``). An input that a term with
            coefficient 0 would read (``entropy``, ``lse``) is not used, so autograd gives
            it no gradient (None, not zeros).

        Raises:
            ValueError: a needed input is None, or a per-token tensor's shape is not
                ``logprob``'s.
        """
        given = {"entropy": entropy, "lse": lse, "old_logprob": old_logprob}
        given |= {"advantages": advantages, "weights": weights, "ref_logprob": ref_logprob}
        return self._evaluate(logprob, given, grad=False)[0]

    def value_and_grad(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        lse: torch.Tensor | None,
        *,
        old_logprob: torch.Tensor | None = None,
        advantages: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprob: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """The per-token loss and its derivatives, in closed form and without autograd.

        Returns ``(loss, (g_lp, g_ent, g_lse))``: ``loss`` is this object's ``__call__`` on
        the same inputs (the same operations, so the same bits), ``g_*`` its derivatives
        per row with respect to ``logprob``, ``entropy`` and ``lse`` (None for an input
        that a term with coefficient 0 does not read, as autograd's ``allow_unused``
        gives). They equal autograd's through ``__call__`` up to rounding: clamps pass the
        gradient at their bounds and block it past them, and k3's derivative is
        ``-expm1(d)``.

        :func:`lp_kernels.linear_logprob_loss` calls this, when a ``loss_fn`` has it, instead
        of differentiating ``loss_fn`` per block: the value's operations and a few more in
        place of autograd's graph and its backward pass.
        """
        given = {"entropy": entropy, "lse": lse, "old_logprob": old_logprob}
        given |= {"advantages": advantages, "weights": weights, "ref_logprob": ref_logprob}
        with torch.no_grad():
            return self._evaluate(logprob, given, grad=True)

    def _evaluate(self, logprob: torch.Tensor, given: dict, *, grad: bool):
        """``(loss, (g_lp, g_ent, g_lse) or None)``: the loss by the same operations either
        way; with ``grad``, its derivatives in closed form too."""
        for name, t in given.items():
            if t is not None and t.shape != logprob.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, logprob {tuple(logprob.shape)}"
                )
        entropy, lse, weights = given["entropy"], given["lse"], given["weights"]
        old = given["old_logprob"]
        old = logprob.detach() if old is None else old
        clip = (self.clip_low, self.clip_high, self.dual_clip)
        loss, g_lp = _surrogate_parts(
            logprob, old, given["advantages"], *clip, self.max_log_ratio, grad=grad
        )
        if self.kl_coef != 0:
            ref = given["ref_logprob"]
            if ref is None:
                raise ValueError(f"kl_coef={self.kl_coef} needs ref_logprob: pass it per token")
            if self.kl_estimator == "k3":
                kl, g_kl = _k3_parts(logprob, ref, self.max_log_ratio, self.max_kl, grad=grad)
            elif self.kl_estimator == "k2":  # kl_k2's operations, the difference kept
                diff = logprob - ref
                kl, g_kl = 0.5 * diff.square(), (diff if grad else None)
            else:
                kl, g_kl = kl_k1(logprob, ref), None
            loss = loss + self.kl_coef * kl
            if grad:
                g_lp = g_lp + (self.kl_coef if g_kl is None else self.kl_coef * g_kl)
        g_ent = g_lse = None
        if self.entropy_coef != 0:
            if entropy is None:
                raise ValueError(
                    f"entropy_coef={self.entropy_coef} needs the entropy, got None: pass "
                    "return_entropy=True (or leave it None) to linear_logprob_loss"
                )
            loss = loss - self.entropy_coef * entropy
            if grad:
                g_ent = torch.full_like(logprob, -self.entropy_coef)
        if self.z_loss_coef != 0:
            if lse is None:
                raise ValueError(f"z_loss_coef={self.z_loss_coef} needs lse, got None")
            loss = loss + self.z_loss_coef * lse.square()
            if grad:
                g_lse = (2.0 * self.z_loss_coef) * lse
        if weights is not None:
            loss = weights * loss
        if not grad:
            return loss, None
        if weights is not None:
            g_lp, g_ent, g_lse = (None if g is None else g * weights for g in (g_lp, g_ent, g_lse))
        return loss, (g_lp, g_ent, g_lse)


def grpo(clip: float = 0.2, kl_coef: float = 0.04, **overrides: Any) -> PolicyLoss:
    """GRPO (Shao et al. 2024, "DeepSeekMath"): symmetric clip 0.2, k3 KL with beta 0.04.

    The paper averages tokens within a completion, then completions: pair it with
    ``token_weights(mask, "seq-mean-token-mean")``. ``overrides``: other
    :class:`PolicyLoss` fields (they win over the defaults).
    """
    fields = {"clip_low": clip, "clip_high": clip, "kl_coef": kl_coef, "kl_estimator": "k3"}
    return PolicyLoss(**(fields | overrides))


def dapo(clip_low: float = 0.2, clip_high: float = 0.28, **overrides: Any) -> PolicyLoss:
    """DAPO (Yu et al. 2025): clip-higher (``eps_low`` 0.2, ``eps_high`` 0.28), no KL.

    The paper averages over all tokens of the batch: pair it with
    ``token_weights(mask, "token-mean")``. ``overrides``: other :class:`PolicyLoss` fields.
    """
    fields = {"clip_low": clip_low, "clip_high": clip_high, "kl_coef": 0.0}
    return PolicyLoss(**(fields | overrides))


def dr_grpo(clip: float = 0.2, **overrides: Any) -> PolicyLoss:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): clip 0.2, no KL.

    The paper drops the length normalization: each completion's token sum is divided by a
    constant, pair it with ``token_weights(mask, "seq-mean-token-sum-norm")``. (Its other
    change, advantages not divided by the group's std, is the caller's.) ``overrides``:
    other :class:`PolicyLoss` fields.
    """
    return PolicyLoss(**({"clip_low": clip, "clip_high": clip, "kl_coef": 0.0} | overrides))


def ppo(clip: float = 0.2, dual_clip: float | None = None, **overrides: Any) -> PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization"), clip 0.2.

    ``dual_clip``: None, or ``c > 1`` (3.0 in Ye et al. 2020). Commonly paired with
    ``token_weights(mask, "token-mean")``. ``overrides``: other :class:`PolicyLoss` fields.
    """
    fields = {"clip_low": clip, "clip_high": clip, "dual_clip": dual_clip}
    return PolicyLoss(**(fields | overrides))


def _count(name: str, value: int | torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    """``value`` (int or 0-d tensor) or ``default``, as fp32, at least 1 (never divide by 0)."""
    if value is None:
        value = default
    elif not isinstance(value, torch.Tensor) and not (
        isinstance(value, int) and not isinstance(value, bool) and value >= 0
    ):
        _reject(name, "None, an int >= 0 or a 0-d tensor", value)
    return torch.as_tensor(value, dtype=torch.float32, device=default.device).clamp(min=1)


def token_weights(
    mask: torch.Tensor,
    mode: AggregationMode,
    *,
    max_tokens: int | None = None,
    global_tokens: int | torch.Tensor | None = None,
    global_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights whose weighted sum realizes verl's loss-aggregation modes.

    With ``len_b`` the number of counted tokens of row b, ``S`` the number of rows with at
    least one, ``B`` all rows and ``x`` any per-token loss, ``sum(w * x)`` is:

    - ``"token-mean"``: ``sum_bt x / sum_b len_b`` (DAPO).
    - ``"seq-mean-token-mean"``: ``(1 / S) sum_b (1 / len_b) sum_t x`` (GRPO).
    - ``"seq-mean-token-sum"``: ``(1 / S) sum_b sum_t x``.
    - ``"seq-mean-token-sum-norm"``: ``(1 / (max_tokens B)) sum_bt x`` (Dr. GRPO: a
      constant divisor). verl divides by ``max_tokens`` alone: ``global_sequences=1``
      gives its scale.

    Data parallel: a step split into micro-batches and ranks should divide by the counts of
    the whole step; pass them as ``global_tokens`` (token-mean) or ``global_sequences``
    (the seq-mean modes), e.g. an ``all_reduce`` of the local counts summed over
    micro-batches. Then the per-micro-batch sums add up to the step's mean, but DDP and
    FSDP *average* gradients over ranks: multiply the loss by the world size (verl scales
    by its ``dp_size`` the same way).

    Args:
        mask: ``[B, T]`` bool or 0/1 of the completion tokens that count.
        mode: one of the four above.
        max_tokens: the constant of ``"seq-mean-token-sum-norm"`` (the generation budget);
            default ``T``. Other modes reject it.
        global_tokens: ``"token-mean"`` only: the token count to divide by (int >= 0, or
            a 0-d tensor to avoid a host sync); default this batch's.
        global_sequences: seq-mean modes only: the sequence count to divide by; default
            ``S`` (``B`` for ``"seq-mean-token-sum-norm"``).

    Returns:
        ``[B, T]`` fp32 on ``mask``'s device, 0 where ``mask`` is 0; an empty row gets 0
        and never a division by zero. Index it like the loss rows, e.g. ``w[mask.bool()]``.

    Raises:
        ValueError: ``mask`` is not 2-D, ``mode`` is unknown, or an option does not apply.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if mode not in _MODES:
        _reject("mode", f"one of {_MODES}", mode)
    if global_tokens is not None and mode != "token-mean":
        raise ValueError(f"global_tokens applies to mode 'token-mean', not {mode!r}")
    if global_sequences is not None and mode == "token-mean":
        raise ValueError("global_sequences applies to the seq-mean modes: use global_tokens")
    if max_tokens is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"max_tokens applies to mode 'seq-mean-token-sum-norm', not {mode!r}")
    m = (mask != 0).to(torch.float32)
    lengths = m.sum(dim=1, keepdim=True)  # [B, 1]
    if mode == "token-mean":
        return m / _count("global_tokens", global_tokens, lengths.sum())
    if mode == "seq-mean-token-sum-norm":
        if max_tokens is None:
            max_tokens = max(mask.shape[1], 1)
        if isinstance(max_tokens, bool) or not (isinstance(max_tokens, int) and max_tokens > 0):
            _reject("max_tokens", "None or an int > 0", max_tokens)
        rows = torch.tensor(float(mask.shape[0]), device=mask.device)
        return m / (max_tokens * _count("global_sequences", global_sequences, rows))
    sequences = _count("global_sequences", global_sequences, (lengths > 0).sum())
    if mode == "seq-mean-token-sum":
        return m / sequences
    return m / (lengths.clamp(min=1) * sequences)


def distill_loss(
    divergence: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    reduction: DistillReduction = "token-mean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar distillation loss from ``linear_divergence``'s per-row ``divergence``.

    Args:
        divergence: ``[*]`` float per-row divergence (``DivergenceOutput.divergence``, fp32).
        mask: ``[*]`` bool or 0/1 of the rows that count (the rows that predict completion
            tokens), or None for every row. Rows outside it add nothing and get no gradient.
        reduction: ``"token-mean"``: the masked sum divided by the number of masked rows
            (at least 1, so an empty mask gives 0); ``"sum"``: the masked sum.
        num_items_in_batch: ``"token-mean"`` only: the divisor instead of this batch's row
            count, as transformers' ``Trainer`` passes it to ``compute_loss`` (the target
            tokens of the whole accumulated step, an int >= 0 or a 0-d tensor; 0 counts
            as 1). The micro-batch losses then add up to the step's token mean.

    Returns:
        A 0-d tensor in ``divergence``'s dtype, differentiable into ``divergence``.

    Raises:
        TypeError: ``divergence`` is not a floating tensor, ``mask`` not a bool or integer
            tensor, ``num_items_in_batch`` not an int or a tensor.
        ValueError: ``mask``'s shape is not ``divergence``'s, an unknown ``reduction``,
            ``num_items_in_batch`` negative, not 0-d, or given with ``reduction="sum"``.

    Example:
        >>> d = torch.tensor([[0.5, 1.5, 9.0], [2.0, 9.0, 9.0]])
        >>> m = torch.tensor([[True, True, False], [True, False, False]])
        >>> distill_loss(d, m), distill_loss(d, m, num_items_in_batch=8)
        (tensor(1.3333), tensor(0.5000))
    """
    if not isinstance(divergence, torch.Tensor) or not divergence.dtype.is_floating_point:
        raise TypeError(f"divergence must be a floating tensor, got {_describe(divergence)}")
    if reduction not in _DISTILL_REDUCTIONS:
        _reject("reduction", f"one of {_DISTILL_REDUCTIONS}", reduction)
    if num_items_in_batch is not None:
        if reduction != "token-mean":
            raise ValueError(
                f"num_items_in_batch applies to reduction 'token-mean', not {reduction!r}"
            )
        _check_items(num_items_in_batch)
    if mask is None:
        total, rows = divergence.sum(), torch.tensor(divergence.numel(), device=divergence.device)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point or mask.is_complex():
            raise TypeError(f"mask must be a bool or 0/1 integer tensor, got {_describe(mask)}")
        if mask.shape != divergence.shape:
            raise ValueError(
                f"mask must have divergence's shape {tuple(divergence.shape)}, got "
                f"{tuple(mask.shape)}"
            )
        keep = mask.to(device=divergence.device) != 0
        total = torch.where(keep, divergence, 0.0).sum()  # where: a masked NaN stays out
        rows = keep.sum()
    if reduction == "sum":
        return total
    return total / _count("num_items_in_batch", num_items_in_batch, rows).to(total.dtype)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return repr(value)


def _check_items(value: Any) -> None:
    """``num_items_in_batch``: an int >= 0 or a 0-d real tensor (its value is not read:
    reading it would sync the host)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"num_items_in_batch must be a 0-d real tensor, got shape "
                f"{tuple(value.shape)} {value.dtype}"
            )
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_items_in_batch must be None, an int or a 0-d tensor, got {value!r}")
    elif value < 0:
        _reject("num_items_in_batch", "an int >= 0", value)
