"""Softmax statistics shared by every op: per-shard partials, their merge, d_logits.

Data flow for one row of scaled logits ``z`` (fp32) split over P vocabulary shards::

    shard r:  m_r = max z            s_r = sum exp(z - m_r)
              a_r = sum exp(z - m_r) * (z - m_r)          (entropy only)
              t_r = z[target] if the target is in shard r else 0
                    |  all-gather (moves bytes, adds nothing)
                    v
    merge in rank order:  M = max_r m_r,  w_r = exp(m_r - M)
              S = sum_r w_r s_r                lse = M + log S
              B = sum_r w_r (a_r + (m_r - M) s_r)
              E - M = B / S  (E = softmax-weighted mean of z)
              entropy = lse - E = log S - B / S
              logprob = sum_r t_r - lse

Why this form: every exponent is taken relative to a maximum, so nothing
overflows; the entropy is assembled from differences ``z - m`` rather than from
``sum p z`` and ``lse`` separately, which would cancel catastrophically when
``|z|`` is large (1e4 logits keep full relative accuracy). The merge visits ranks
in a fixed order and each rank sees the same gathered bytes, so every rank returns
bitwise identical outputs and reruns are bitwise reproducible. A shard with no
real column reports ``m = -inf, s = a = 0`` and drops out of the merge exactly
(``w = 0``).

Backward, for upstream gradients g_lp, g_ent, g_lse of one row and ``p = exp(z - lse)``::

    d z_k = p_k * (g_lse - g_lp - g_ent * (z_k - E)) + g_lp * [k == target]

All of it in fp32.
"""

from __future__ import annotations

import torch

# Number of fp32 statistics a shard reports per row: m, s, a, t.
N_STATS = 4


def local_stats(
    z: torch.Tensor,
    target_local: torch.Tensor,
    in_shard: torch.Tensor,
    *,
    entropy: bool,
    out: torch.Tensor,
    masked: bool = False,
) -> None:
    """Fill ``out [C, 4]`` with one shard's (m, s, a, t) for scaled fp32 logits ``z [C, Vr]``.

    ``z`` is overwritten (it becomes ``z - m``). ``target_local [C]`` int64 holds the
    target's column in this shard, valid where ``in_shard [C]`` is true. ``masked``: ``z``
    may hold ``-inf`` (masked vocabulary entries), whose entropy term ``e (z - m)`` is
    ``0 x -inf``; it is taken as 0 (the limit), which leaves every other term's bits alone.
    A row whose entries here are all ``-inf`` reports ``m = -inf, s = a = 0`` (it drops out
    of the merge exactly, as an empty shard does).
    """
    if z.shape[1] == 0:
        out[:, 0] = float("-inf")
        out[:, 1:] = 0.0
        return
    idx = torch.where(in_shard, target_local, 0).unsqueeze(1)  # [C, 1]
    out[:, 3] = torch.where(in_shard, z.gather(1, idx).squeeze(1), 0.0)
    m = z.amax(dim=1)
    out[:, 0] = m
    # a row all -inf here: subtract 0, not -inf (-inf - -inf would be NaN); exp gives 0
    z.sub_(torch.where(m == float("-inf"), 0.0, m).unsqueeze(1))  # z - m
    e = torch.exp(z)
    out[:, 1] = e.sum(dim=1)
    if entropy and masked:
        out[:, 2] = torch.where(e > 0, e * z, 0.0).sum(dim=1)
    elif entropy:
        out[:, 2] = e.mul_(z).sum(dim=1)
    else:
        out[:, 2] = 0.0


def merge_stats(
    stats: torch.Tensor, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Merge ``stats [P, N, 4]`` in rank order.

    Returns ``(lse, E, target_logit, entropy)``: ``lse`` and ``target_logit`` [N]
    fp32; ``E`` (softmax mean of z, needed by the entropy gradient) and ``entropy``
    [N] fp32 or None when ``entropy`` is False.
    """
    m, s, a, t = stats.unbind(dim=2)  # each [P, N]
    if stats.shape[0] == 1:
        big_m, big_s, zt = m[0], s[0], t[0]
        big_b = a[0] if entropy else None
    else:
        big_m = m.amax(dim=0)
        w = torch.exp(m - big_m)  # 0 for empty shards (m = -inf)
        big_s = w[0] * s[0]
        zt = t[0]
        for r in range(1, stats.shape[0]):
            big_s = big_s + w[r] * s[r]
            zt = zt + t[r]
        big_b = None
        if entropy:
            shift = torch.where(w > 0, m - big_m, 0.0)
            big_b = w[0] * (a[0] + shift[0] * s[0])
            for r in range(1, stats.shape[0]):
                big_b = big_b + w[r] * (a[r] + shift[r] * s[r])
    log_s = torch.log(big_s)
    lse = big_m + log_s
    if not entropy:
        return lse, None, zt, None
    mean_shift = big_b / big_s  # E - M
    return lse, big_m + mean_shift, zt, log_s - mean_shift


def masked_upstream(ignored: torch.Tensor, *grads):
    """Upstream gradients as fp32 ``[N]``, zero on ignored rows (None stays None)."""
    return tuple(None if g is None else torch.where(ignored, 0.0, g.float()) for g in grads)


def lse_coefficient(g_lp, g_lse, n: int, device: torch.device) -> torch.Tensor:
    """``c0 = g_lse - g_lp`` per row (fp32, contiguous ``[n]``), zeros for absent gradients."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    c0 = (g_lse if g_lse is not None else zero) - (g_lp if g_lp is not None else zero)
    return c0.expand(n).contiguous()


def d_logits_(
    z: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor | None,
    target_local: torch.Tensor,
    in_shard: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    g_lse: torch.Tensor | None,
    *,
    masked: bool = False,
) -> torch.Tensor:
    """Turn scaled fp32 logits ``z [C, Vr]`` into ``d loss / d z`` in place and return it.

    Upstream gradients are per row ([C] fp32, zero on ignored rows) or None (unused).
    ``masked``: ``z`` may hold ``-inf``; there ``p = 0`` and the entropy factor
    ``-g_ent (z - E)`` is infinite, so the entry's gradient is taken as its limit, 0 (plus
    ``g_lp`` at a masked target: ``d log p_t / d z_t = 1 - p_t``).
    """
    c0 = lse_coefficient(g_lp, g_lse, z.shape[0], z.device)
    if g_ent is not None:
        assert mean_z is not None
        z.sub_(mean_z.unsqueeze(1))  # z - E
        p = torch.exp(z + (mean_z - lse).unsqueeze(1))
        if masked:  # -inf - E: p = 0 there; 0 x inf must not reach the product
            z.masked_fill_(z == float("-inf"), 0.0)
        z.mul_(-g_ent.unsqueeze(1)).add_(c0.unsqueeze(1)).mul_(p)
    else:
        z.sub_(lse.unsqueeze(1)).exp_().mul_(c0.unsqueeze(1))
    if g_lp is not None and z.shape[1] > 0:
        rows = torch.arange(z.shape[0], device=z.device)
        cols = torch.where(in_shard, target_local, 0)
        z[rows, cols] = z[rows, cols] + torch.where(in_shard, g_lp, 0.0)
    return z


def masked_outputs(
    ignored: torch.Tensor,
    zt: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logprob, entropy, lse)`` from merged statistics, exactly 0 on ignored rows.

    A row whose log-sum-exp is not finite (a NaN or inf among its inputs, or logits past
    the fp32 range) gets NaN in every field, never a finite or infinite stand-in.
    """
    nan = torch.full((), float("nan"), dtype=torch.float32, device=lse.device)
    bad = ~torch.isfinite(lse)

    def out(x):
        return torch.where(ignored, 0.0, torch.where(bad, nan, x))

    return (
        out(zt - lse),
        None if entropy is None else out(entropy),
        out(lse) if return_lse else None,
    )


def ignored_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[N]`` bool: the rows whose target equals ``ignore_index`` (compared in int64)."""
    info = torch.iinfo(targets.dtype)
    if not info.min <= ignore_index <= info.max:  # outside the targets' dtype: no row
        return torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    return targets == ignore_index


def target_columns(targets: torch.Tensor, ignore_index: int, vocab_start: int, v_real: int):
    """``(column in this shard, target is in this shard, row is ignored)``, each ``[N]``."""
    targets = targets.long()  # int32 targets: compare in int64 (torch would wrap ignore_index)
    ignored = targets == ignore_index
    t_local = targets - vocab_start
    in_shard = (~ignored) & (t_local >= 0) & (t_local < v_real)
    return t_local, in_shard, ignored


def bias_grad(acc_b: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """grad_bias in the bias' dtype from its fp32 sum over the real columns (zero past them:
    padding columns)."""
    if acc_b is None:
        return None
    out = torch.zeros_like(bias)
    out[: acc_b.shape[0]] = acc_b
    return out
