"""fp64 references and the plain low-precision baselines for ``linear_logprob`` and
``linear_divergence`` (the divergence's formulas: the comment over its section below).

Truth (fp64, logits materialized)::

    l       = (hidden @ weight[:V].T (+ bias[:V])) s           [N, V]  float64 (s: logit_scale)
    z       = softcap(l) / T,  softcap(l) = c * tanh(l / c)    (when a cap c is given)
    lse     = logsumexp(z)                                     [N]
    logprob = z[target] - lse                                  [N]
    entropy = -(softmax(z) * log_softmax(z)).sum(-1)           [N]
    rows with target == ignore_index: every output 0, no gradient

Gradients come from torch autograd through exactly that fp64 graph, with a per-row
upstream gradient for each output used (never an implied scalar ``.sum()``): the
vector-Jacobian product ``sum_i g_lp[i] logprob[i] + g_ent[i] entropy[i] + g_lse[i] lse[i]``.
Weight rows ``>= V`` (padding) get an exact zero gradient.

Baseline (what a user without lp writes, in the input dtype)::

    logits = (hidden @ weight.T) / T          # bf16 GEMM, bf16 logits
    logp   = logits[..., :V].float().log_softmax(-1)
    logprob, entropy, lse from logp           # fp32; grads flow back into bf16 tensors

At benchmark shapes (16k tokens x 152k vocabulary) the fp64 logits alone would take 20 GB:
:func:`reference_chunked` computes the same truth a block of rows at a time, with the
closed-form gradient instead of autograd, in fp64 or (for GPU shapes) fp32 with TF32 off.

Its error against the truth is the yardstick of :func:`lp_testing.compare.assert_close`:
a fused kernel is held to "no worse than k x what the materialized path gets".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "DIVERGENCE_KINDS",
    "DIVERGENCE_OUTPUTS",
    "OUTPUTS",
    "TOPK_TAIL_MIN",
    "materialized_baseline",
    "materialized_baseline_from_logits",
    "materialized_divergence_baseline",
    "materialized_divergence_baseline_from_logits",
    "reference_all",
    "reference_chunked",
    "reference_divergence",
    "reference_divergence_from_logits",
    "reference_extras",
    "reference_from_logits",
    "reference_grads",
    "reference_outputs",
    "reference_topk_divergence",
]

OUTPUTS: tuple[str, ...] = ("logprob", "entropy", "lse")
"""Names of the op's per-row outputs, in ``LogProbOutput`` order."""


def _resolve_vocab(columns: int, targets: Tensor, vocab_size: int | None, ignore_index: int) -> int:
    """Check the real vocabulary size and the targets; returns V."""
    v = columns if vocab_size is None else vocab_size
    if not 1 <= v <= columns:
        raise ValueError(f"vocab_size must be in [1, {columns}] (the columns given), got {v}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64, got {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= v))
    count = int(bad.sum())
    if count:
        raise ValueError(
            f"{count} targets are neither ignore_index ({ignore_index}) nor in [0, {v})"
        )
    return v


def _statistics(z: Tensor, targets: Tensor, ignore_index: int) -> dict[str, Tensor]:
    """Per-row logprob, entropy, lse of ``z [N, V]``; zero on ignored rows."""
    keep = targets != ignore_index
    safe = torch.where(keep, targets, 0)
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse.unsqueeze(-1)
    out = {
        "logprob": logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "lse": lse,
    }
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return {name: torch.where(keep, value, zero) for name, value in out.items()}


def reference_extras(z: Tensor, targets: Tensor, ignore_index: int = -100) -> dict[str, Tensor]:
    """fp64 truth of ``extras=``'s statistics from materialized softmax arguments ``z [N, V]``
    (the transformed logits over the real vocabulary):

    - ``log_sum_sq_probs = log sum_v softmax(z)_v^2`` (``logsumexp(2 log_softmax(z))``),
    - ``mean_logit = z.mean(-1)``,
    - ``is_top1 = argmax(z) == target`` (the first maximal column),

    each 0 (False) on rows whose target is ``ignore_index``."""
    z = z.double()
    keep = targets != ignore_index
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return {
        "log_sum_sq_probs": torch.where(keep, torch.logsumexp(2 * z.log_softmax(-1), -1), zero),
        "mean_logit": torch.where(keep, z.mean(-1), zero),
        "is_top1": keep & (z.argmax(-1) == targets),
    }


def _upstream(
    grads: dict[str, Tensor | None], shape: torch.Size, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The upstream gradients that were given, checked to be per-row."""
    used: dict[str, Tensor] = {}
    for name, grad in grads.items():
        if grad is None:
            continue
        if grad.shape != shape:
            raise ValueError(
                f"grad_{name} must have the targets' shape {tuple(shape)} (one value per "
                f"row), got {tuple(grad.shape)}"
            )
        used[name] = grad.to(dtype)
    return used


def _softcapped(l: Tensor, softcap: float | None) -> Tensor:
    """``c * tanh(l / c)`` (``c = softcap``), or ``l`` without a cap."""
    return l if softcap is None else softcap * torch.tanh(l / softcap)


def _vjp(outputs: dict[str, Tensor], upstream: dict[str, Tensor]) -> Tensor:
    """The scalar whose gradient is the vector-Jacobian product with ``upstream``."""
    return sum((outputs[name] * g).sum() for name, g in upstream.items())  # type: ignore[return-value]


def _checked(
    operand: str,
    x: Tensor,
    columns: int,
    targets: Tensor,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    vocab_size: int | None,
    ignore_index: int,
    dtype: torch.dtype,
) -> tuple[int, dict[str, Tensor]]:
    """The argument checks every entry point makes; returns V and the used upstream gradients.

    ``x`` (named ``operand`` in errors) is ``[*, K]`` and must share ``targets``' leading
    shape; ``columns`` is the padded vocabulary; ``grads`` are ``(grad_logprob,
    grad_entropy, grad_lse)``, cast to ``dtype``.
    """
    if x.shape[:-1] != targets.shape:
        raise ValueError(
            f"{operand} {tuple(x.shape)} and targets {tuple(targets.shape)} must share the "
            f"leading shape"
        )
    v = _resolve_vocab(columns, targets, vocab_size, ignore_index)
    return v, _upstream(dict(zip(OUTPUTS, grads, strict=True)), targets.shape, dtype)


def _check_bias(bias: Tensor | None, weight: Tensor) -> None:
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V_pad] = {weight.shape[0]}, got {tuple(bias.shape)}")


def _autograd_result(
    stats: dict[str, Tensor],
    shape: torch.Size,
    upstream: dict[str, Tensor],
    leaves: dict[str, Tensor | None],
) -> dict[str, Tensor | None]:
    """Outputs ``stats`` (reshaped to ``shape``, detached) and, with upstream gradients, the
    gradient of the vector-Jacobian product for each leaf under its key (None for a leaf that
    is None, or for all without upstream gradients). Call inside ``torch.enable_grad()``."""
    outputs = {name: value.reshape(shape) for name, value in stats.items()}
    result: dict[str, Tensor | None] = {k: o.detach() for k, o in outputs.items()}
    result.update(dict.fromkeys(leaves))
    if upstream:
        given = {key: leaf for key, leaf in leaves.items() if leaf is not None}
        grads = torch.autograd.grad(_vjp(outputs, upstream), list(given.values()))
        result.update(zip(given, grads, strict=True))
    return result


def _hidden_shaped(result: dict[str, Tensor | None], hidden: Tensor) -> dict[str, Tensor | None]:
    """``result`` with its ``grad_hidden`` (computed on ``[N, H]`` rows) in ``hidden``'s shape."""
    if result["grad_hidden"] is not None:
        result["grad_hidden"] = result["grad_hidden"].reshape(hidden.shape)
    return result


def reference_all(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> dict[str, Tensor | None]:
    """fp64 truth for every output and, given upstream gradients, every input gradient.

    Args:
        hidden: ``[*, H]`` any float dtype (upcast exactly to float64).
        weight: ``[V_pad, H]`` the full head (not a shard).
        targets: ``[*]`` int64 global ids or ``ignore_index``.
        grad_logprob: ``[*]`` upstream gradient of logprob, or None (output not used).
        grad_entropy: ``[*]`` upstream gradient of entropy, or None.
        grad_lse: ``[*]`` upstream gradient of lse, or None.
        temperature: logits are divided by it.
        ignore_index: target value of ignored rows.
        vocab_size: real vocabulary V; rows ``>= V`` of weight are padding. None: V_pad.
        bias: ``[V_pad]`` LM-head bias (the full one), any float dtype, or None.
        softcap: final-logit cap ``c > 0`` (``z = c tanh(l / c) / T``), or None.
        logit_scale: a multiplier of the logits before the cap (``z = c tanh(s l / c) /
            T``), or None.

    Returns:
        ``{"logprob", "entropy", "lse"}``: ``[*]`` float64, zero on ignored rows;
        ``"grad_hidden"``: ``[*, H]`` and ``"grad_weight"``: ``[V_pad, H]`` float64, or
        None for both when no upstream gradient is given; ``"grad_bias"``: ``[V_pad]``
        float64 (zero on padding), or None without bias or upstream gradient.

    Raises:
        ValueError: targets out of range, bad vocab_size, or upstream gradients that are
            not one value per row.
    """
    grads = (grad_logprob, grad_entropy, grad_lse)
    v, upstream = _checked(
        "hidden", hidden, weight.shape[0], targets, grads, vocab_size, ignore_index, torch.float64
    )
    _check_bias(bias, weight)
    needed = bool(upstream)
    h64 = hidden.reshape(-1, hidden.shape[-1]).detach().to(torch.float64).requires_grad_(needed)
    w64 = weight.detach().to(torch.float64).requires_grad_(needed)
    b64 = None if bias is None else bias.detach().to(torch.float64).requires_grad_(needed)
    with torch.enable_grad():
        logits = h64 @ w64[:v].T
        if b64 is not None:
            logits = logits + b64[:v]
        if logit_scale is not None:
            logits = logits * logit_scale
        z = _softcapped(logits, softcap) / temperature
        stats = _statistics(z, targets.reshape(-1), ignore_index)
        leaves = {"grad_hidden": h64, "grad_weight": w64, "grad_bias": b64}
        result = _autograd_result(stats, targets.shape, upstream, leaves)
    return _hidden_shaped(result, hidden)


def reference_chunked(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    rows: int = 2048,
) -> dict[str, Tensor | None]:
    """The truth of :func:`reference_all`, ``rows`` rows at a time (never ``[N, V]`` at once).

    For shapes whose fp64 logits do not fit in memory. Each block of rows forms its logits
    ``[rows, V]`` in ``dtype`` (TF32 off), its statistics, and the closed-form gradient of
    the per-row vector-Jacobian product::

        l  = (hidden[rows] @ W^T (+ b)) s,  z = softcap(l) / T   (s: logit_scale, or 1)
        p  = softmax(z),  logp = log p,  Hn = entropy
        dz = g_lp (onehot(target) - p) - g_ent p (logp + Hn) + g_lse p
        dl = dz s / T  (with a cap c: dz s (1 - tanh^2(l / c)) / T)
        grad_hidden[rows] = dl @ W,   grad_weight += dl^T @ hidden[rows],   grad_bias += sum dl

    Ignored rows contribute nothing; weight rows ``>= V`` (padding) get exact zeros. Runs
    on the inputs' device, without autograd.

    Args:
        hidden, weight, targets, grad_logprob, grad_entropy, grad_lse, temperature,
            ignore_index, vocab_size, bias, softcap, logit_scale: as in :func:`reference_all`.
        dtype: ``torch.float64`` (the truth) or ``torch.float32`` (a GPU-shape reference).
        rows: rows per block, >= 1 (memory: about three ``[rows, V]`` tensors in ``dtype``).

    Returns:
        The keys of :func:`reference_all`, in ``dtype``.

    Raises:
        ValueError: as :func:`reference_all`, or a ``rows`` < 1, a ``dtype`` that is not
            float64 / float32, or a ``softcap`` that is not a finite number > 0.
    """
    if softcap is not None and not (0 < softcap < float("inf")):
        raise ValueError(f"reference_chunked: softcap must be a finite number > 0, got {softcap}")
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"reference_chunked: dtype must be torch.float64 or float32, got {dtype}")
    if rows < 1:
        raise ValueError(f"reference_chunked: rows must be >= 1, got {rows}")
    grads = (grad_logprob, grad_entropy, grad_lse)
    v, upstream = _checked(
        "hidden", hidden, weight.shape[0], targets, grads, vocab_size, ignore_index, dtype
    )
    _check_bias(bias, weight)
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    flat_up = {name: g.reshape(-1) for name, g in upstream.items()}
    n, dev = h2.shape[0], h2.device
    w = weight.detach()[:v].to(dtype)
    b = None if bias is None else bias.detach()[:v].to(dtype)
    outs = {name: torch.zeros(n, dtype=dtype, device=dev) for name in OUTPUTS}
    grad_h = torch.zeros(h2.shape, dtype=dtype, device=dev) if upstream else None
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=dev) if upstream else None
    grad_b = None
    if upstream and bias is not None:
        grad_b = torch.zeros(weight.shape[:1], dtype=dtype, device=dev)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for r0 in range(0, n, rows):
                r1 = min(r0 + rows, n)
                h = h2[r0:r1].detach().to(dtype)
                t = t1[r0:r1]
                z = h @ w.T  # [rows, V] raw logits l
                if b is not None:
                    z += b
                if logit_scale is not None:
                    z *= logit_scale
                slope = None  # d softcap(l) / dl = 1 - tanh^2(l / c)
                if softcap is not None:
                    z.div_(softcap).tanh_()
                    if upstream:
                        slope = 1 - z * z
                    z.mul_(softcap)
                z /= temperature
                stats = _statistics(z, t, ignore_index)
                for name in OUTPUTS:
                    outs[name][r0:r1] = stats[name]
                if not upstream:
                    continue
                keep = (t != ignore_index).to(dtype)
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                logp = z.sub_(lse)  # z is not needed again: [rows, V] log-probabilities
                p = logp.exp()
                dz = torch.zeros_like(p)
                if "logprob" in flat_up:
                    g = flat_up["logprob"][r0:r1] * keep
                    dz -= g[:, None] * p
                    hit = torch.where(t != ignore_index, t, 0)
                    dz[torch.arange(r1 - r0, device=dev), hit] += g
                if "entropy" in flat_up:
                    g = flat_up["entropy"][r0:r1] * keep
                    ent = -(p * logp).sum(-1, keepdim=True)
                    dz -= g[:, None] * p * (logp + ent)
                if "lse" in flat_up:
                    dz += (flat_up["lse"][r0:r1] * keep)[:, None] * p
                dz /= temperature
                if slope is not None:
                    dz *= slope
                if logit_scale is not None:
                    dz *= logit_scale
                grad_h[r0:r1] = dz @ w
                grad_w[:v].addmm_(dz.T, h)
                if grad_b is not None:
                    grad_b[:v] += dz.sum(0)
                del z, logp, p, dz, slope
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    result: dict[str, Tensor | None] = {k: o.reshape(targets.shape) for k, o in outs.items()}
    result["grad_hidden"] = None if grad_h is None else grad_h.reshape(hidden.shape)
    result["grad_weight"] = grad_w
    result["grad_bias"] = grad_b
    return result


def reference_outputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> dict[str, Tensor]:
    """fp64 ``{"logprob", "entropy", "lse"}``, each ``[*]``, zero on ignored rows.

    Arguments as in :func:`reference_all`.

    Example:
        >>> from lp_testing import make_problem
        >>> p = make_problem(4, 8, 11)
        >>> reference_outputs(p.hidden, p.weight, p.targets)["logprob"].dtype
        torch.float64
    """
    result = reference_all(
        hidden,
        weight,
        targets,
        temperature=temperature,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
    )
    return {name: result[name] for name in OUTPUTS}  # type: ignore[misc]


def reference_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """fp64 ``(grad_hidden [*, H], grad_weight [V_pad, H])`` for per-row upstream gradients.

    Arguments as in :func:`reference_all`; at least one ``grad_*`` must be given.

    Raises:
        ValueError: no upstream gradient, or one that is not ``[*]``.
    """
    if grad_logprob is None and grad_entropy is None and grad_lse is None:
        raise ValueError("reference_grads: give at least one of grad_logprob/entropy/lse")
    result = reference_all(
        hidden,
        weight,
        targets,
        grad_logprob=grad_logprob,
        grad_entropy=grad_entropy,
        grad_lse=grad_lse,
        temperature=temperature,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
    )
    return result["grad_hidden"], result["grad_weight"]  # type: ignore[return-value]


def reference_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> dict[str, Tensor | None]:
    """fp64 truth for ``vocab_parallel_logprob``, which starts from logits
    (``z = softcap(s logits) / T``; ``softcap`` and ``logit_scale`` ``s``: as in
    :func:`reference_all`).

    Args:
        logits: ``[*, V_pad]`` the full (gathered) logits, any float dtype; ``z = logits / T``.
        targets: ``[*]`` int64.
        grad_logprob, grad_entropy, grad_lse: ``[*]`` upstream gradients or None.
        temperature, ignore_index, vocab_size: as in :func:`reference_all`.

    Returns:
        ``{"logprob", "entropy", "lse"}`` ``[*]`` float64 and ``"grad_logits"``
        ``[*, V_pad]`` float64 (zero in padding columns), or None without upstream gradient.
    """
    grads = (grad_logprob, grad_entropy, grad_lse)
    v, upstream = _checked(
        "logits", logits, logits.shape[-1], targets, grads, vocab_size, ignore_index, torch.float64
    )
    x64 = logits.detach().to(torch.float64).requires_grad_(bool(upstream))
    with torch.enable_grad():
        l = x64.reshape(-1, logits.shape[-1])[:, :v]
        if logit_scale is not None:
            l = l * logit_scale
        z = _softcapped(l, softcap) / temperature
        stats = _statistics(z, targets.reshape(-1), ignore_index)
        return _autograd_result(stats, targets.shape, upstream, {"grad_logits": x64})


def _baseline_statistics(
    logits: Tensor, targets: Tensor, ignore_index: int, v: int
) -> dict[str, Tensor]:
    """The naive user's fp32 statistics from low-precision logits ``[*, V_pad]``."""
    keep = targets != ignore_index
    safe = torch.where(keep, targets, 0)
    real = logits[..., :v].float()
    logp = real.log_softmax(-1)
    out = {
        "logprob": logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "lse": real.logsumexp(-1),
    }
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return {name: torch.where(keep, value, zero) for name, value in out.items()}


def materialized_baseline(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> dict[str, Tensor | None]:
    """The plain materialized-logits computation in the input dtype (the error yardstick).

    Logits ``hidden @ weight.T / T`` are formed in the inputs' dtype (a bf16 GEMM gives
    bf16 logits; with mixed dtypes the wider one, the other cast up), then upcast to
    float32 for ``log_softmax``, exactly as a user without lp would write it.
    Runs on the inputs' device. A bias is added and the cap applied in the logits' dtype
    (``F.linear(hidden, weight, bias)``, then Gemma's ``tanh(logits / c) * c``).

    Arguments as in :func:`reference_all`.

    Returns:
        Same keys as :func:`reference_all`: outputs ``[*]`` float32, ``grad_hidden``,
        ``grad_weight`` (and ``grad_bias``) in the inputs' dtypes (None without upstream
        gradient).
    """
    grads = (grad_logprob, grad_entropy, grad_lse)
    v, upstream = _checked(
        "hidden", hidden, weight.shape[0], targets, grads, vocab_size, ignore_index, torch.float32
    )
    h = hidden.reshape(-1, hidden.shape[-1]).detach().clone().requires_grad_(bool(upstream))
    w = weight.detach().clone().requires_grad_(bool(upstream))
    b = None if bias is None else bias.detach().clone().requires_grad_(bool(upstream))
    with torch.enable_grad():
        # mixed dtypes: the wider one, as lp_kernels does (gradients in each input's dtype)
        dtype = torch.promote_types(h.dtype, w.dtype)
        logits = h.to(dtype) @ w.to(dtype).T
        if b is not None:
            logits = logits + b.to(dtype)
        logits = _softcapped(logits, softcap)
        if temperature != 1.0:
            logits = logits / temperature
        stats = _baseline_statistics(logits, targets.reshape(-1), ignore_index, v)
        leaves = {"grad_hidden": h, "grad_weight": w, "grad_bias": b}
        result = _autograd_result(stats, targets.shape, upstream, leaves)
    return _hidden_shaped(result, hidden)


def materialized_baseline_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    grad_logprob: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_lse: Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    softcap: float | None = None,
) -> dict[str, Tensor | None]:
    """The plain computation from low-precision logits (yardstick for the logits op);
    ``softcap`` applied in the logits' dtype.

    ``logits / T`` in the logits' dtype, then float32 ``log_softmax``.

    Returns:
        Same keys as :func:`reference_from_logits`: outputs ``[*]`` float32 and
        ``grad_logits`` in the logits' dtype (None without upstream gradient).
    """
    grads = (grad_logprob, grad_entropy, grad_lse)
    v, upstream = _checked(
        "logits", logits, logits.shape[-1], targets, grads, vocab_size, ignore_index, torch.float32
    )
    x = logits.detach().clone().requires_grad_(bool(upstream))
    with torch.enable_grad():
        capped = _softcapped(x, softcap)
        scaled = capped / temperature if temperature != 1.0 else capped
        stats = _baseline_statistics(scaled, targets, ignore_index, v)
        return _autograd_result(stats, targets.shape, upstream, {"grad_logits": x})


# ----------------------------------------------------------------------------------------
# Divergences between a student head and a teacher head (``linear_divergence``)
#
# Truth (fp64, both heads' logits materialized, rows whose mask is False dropped first)::
#
#     z_s = softcap_s(s_s (h W^T + b)) / T          z_t = softcap_t(s_t (h_t W_t^T + b_t)) / T_t
#     log p = log_softmax(z_s[:, :V])               log q = log_softmax(z_t[:, :V])
#     forward_kl = sum q (log q - log p)            reverse_kl = sum p (log p - log q)
#     jsd = beta sum q (log q - log m) + (1 - beta) sum p (log p - log m),
#           log m = logsumexp([log p + log(1 - beta), log q + log(beta)])
#     student_entropy = -sum p log p,  teacher_entropy = -sum q log q
#
# A term whose weight (q or p) is exactly 0, such as a top-k teacher's -inf column, is 0
# (the limit x log x -> 0), never 0 * inf. Gradients are autograd's through that graph for
# ``sum(upstream * divergence)``; masked rows contribute nothing, so a NaN in a masked
# hidden row reaches no output and no gradient.

DIVERGENCE_OUTPUTS: tuple[str, ...] = ("divergence", "student_entropy", "teacher_entropy")
"""Names of ``linear_divergence``'s per-row outputs, in ``DivergenceOutput`` order."""

DIVERGENCE_KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")
"""The divergences ``linear_divergence`` computes."""


def _weighted_gap(weight: Tensor, log_weight: Tensor, other: Tensor | float) -> Tensor:
    """``sum_v weight (log_weight - other)`` per row, a term being 0 where ``weight == 0``."""
    live = weight > 0
    gap = torch.where(live, log_weight, torch.zeros_like(log_weight)) - other
    return torch.where(live, weight * gap, torch.zeros_like(gap)).sum(-1)


def _divergence_statistics(logp: Tensor, logq: Tensor, kind: str, beta: float) -> dict[str, Tensor]:
    """Per-row divergence and both entropies from student / teacher log-probs ``[rows, V]``."""
    p, q = logp.exp(), logq.exp()
    if kind == "forward_kl":
        div = _weighted_gap(q, logq, logp)
    elif kind == "reverse_kl":
        div = _weighted_gap(p, logp, logq)
    else:
        parts = torch.stack([logp + math.log(1 - beta), logq + math.log(beta)])
        logm = torch.logsumexp(parts, dim=0)
        div = beta * _weighted_gap(q, logq, logm) + (1 - beta) * _weighted_gap(p, logp, logm)
    return {
        "divergence": div,
        "student_entropy": -_weighted_gap(p, logp, 0.0),
        "teacher_entropy": -_weighted_gap(q, logq, 0.0),
    }


def _divergence_rows(
    operand: str,
    lead: torch.Size,
    columns: int,
    *,
    kind: str,
    beta: float,
    mask: Tensor | None,
    vocab_size: int | None,
    upstream: Tensor | None,
) -> tuple[int, Tensor]:
    """The checks every divergence entry point makes; returns V and the kept rows' indices
    (into the flattened leading shape ``lead`` of ``operand``)."""
    if kind not in DIVERGENCE_KINDS:
        raise ValueError(f"kind must be one of {DIVERGENCE_KINDS}, got {kind!r}")
    if kind == "jsd" and not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1) for jsd, got {beta}")
    v = columns if vocab_size is None else vocab_size
    if not 1 <= v <= columns:
        raise ValueError(f"vocab_size must be in [1, {columns}] (the columns given), got {v}")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != lead):
        raise ValueError(
            f"mask must be bool with {operand}'s leading shape {tuple(lead)}, got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
    if upstream is not None and upstream.shape != lead:
        raise ValueError(
            f"upstream must have {operand}'s leading shape {tuple(lead)} (one value per row), "
            f"got {tuple(upstream.shape)}"
        )
    keep = torch.ones(lead, dtype=torch.bool) if mask is None else mask.cpu()
    return v, keep.reshape(-1).nonzero().squeeze(-1)


def _head_z(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    v: int,
    *,
    logit_scale: float | None,
    softcap: float | None,
    temperature: float,
    exact: bool,
) -> Tensor:
    """One head's softmax arguments ``[rows, V]``: fp64 from fp64 operands (``exact``), or
    formed in the operands' (wider) dtype over every weight row, as a user writes it, and
    upcast to float32 after the cut to ``V`` columns."""
    if exact:
        hidden, weight = hidden.to(torch.float64), weight[:v].to(torch.float64)
        bias = None if bias is None else bias[:v].to(torch.float64)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if logit_scale is not None:
        logits = logits * logit_scale
    z = _softcapped(logits, softcap)
    if temperature != 1.0:
        z = z / temperature
    return z if exact else z[:, :v].float()


def _scatter_rows(stats: dict[str, Tensor], rows: Tensor, n: int) -> dict[str, Tensor]:
    """Each kept-row statistic placed at ``rows`` of a zero ``[n]`` vector (differentiably)."""
    return {
        name: value.new_zeros(n).index_put((rows.to(value.device),), value)
        for name, value in stats.items()
    }


def _linear_divergence(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    exact: bool,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    vocab_size: int | None = None,
    upstream: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """:func:`reference_divergence` (``exact``) or :func:`materialized_divergence_baseline`."""
    lead = hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead or teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} / teacher_weight "
            f"{tuple(teacher_weight.shape)} must share hidden's leading shape {tuple(lead)} "
            f"and weight's rows {weight.shape[0]}"
        )
    _check_bias(bias, weight)
    _check_bias(teacher_bias, teacher_weight)
    v, rows = _divergence_rows(
        "hidden", lead, weight.shape[0], kind=kind, beta=beta, mask=mask,
        vocab_size=vocab_size, upstream=upstream,
    )  # fmt: skip
    needed = upstream is not None

    def leaf(x: Tensor | None, grad: bool) -> Tensor | None:
        if x is None:
            return None
        x = x.detach().to(torch.float64) if exact else x.detach().clone()
        return x.requires_grad_(grad)

    h = leaf(hidden.reshape(-1, hidden.shape[-1]), needed)
    w, b = leaf(weight, needed), leaf(bias, needed)
    th = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    t_temp = temperature if teacher_temperature is None else teacher_temperature
    with torch.enable_grad():
        idx = rows.to(h.device)  # type: ignore[union-attr]
        zs = _head_z(
            h[idx], w, b, v, logit_scale=logit_scale, softcap=softcap,  # type: ignore[index]
            temperature=temperature, exact=exact,
        )  # fmt: skip
        zt = _head_z(
            th[idx], teacher_weight.detach(), leaf(teacher_bias, False), v,
            logit_scale=teacher_logit_scale, softcap=teacher_softcap, temperature=t_temp,
            exact=exact,
        )  # fmt: skip
        stats = _divergence_statistics(zs.log_softmax(-1), zt.log_softmax(-1), kind, beta)
        flat = _scatter_rows(stats, rows, lead.numel())
        up = {} if upstream is None else {"divergence": upstream.to(zs.dtype).reshape(-1)}
        leaves = {"grad_hidden": h, "grad_weight": w, "grad_bias": b}
        result = _autograd_result(flat, torch.Size([lead.numel()]), up, leaves)
    for name in DIVERGENCE_OUTPUTS:
        result[name] = result[name].reshape(lead)  # type: ignore[union-attr]
    return _hidden_shaped(result, hidden)


def reference_divergence(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    vocab_size: int | None = None,
    upstream: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """fp64 truth of ``linear_divergence`` (student head vs teacher head) and its gradients.

    Args:
        hidden: ``[*, H]`` student hidden states, any float dtype (upcast exactly).
        weight: ``[V_pad, H]`` the full student head (not a shard).
        teacher_hidden: ``[*, H_t]`` teacher hidden states (same leading shape).
        teacher_weight: ``[V_pad, H_t]`` the full teacher head (same rows as ``weight``).
        kind: ``"forward_kl"`` (KL(q || p)), ``"reverse_kl"`` (KL(p || q)) or ``"jsd"``.
        beta: jsd's mixture weight of the teacher, in (0, 1).
        temperature: the student's ``T``.
        teacher_temperature: the teacher's ``T_t``; None: ``temperature``.
        mask: ``[*]`` bool; False rows: every output 0, no gradient. None: every row.
        bias, teacher_bias: ``[V_pad]`` each head's bias, or None.
        softcap, teacher_softcap: each head's cap ``c`` (``c tanh(l / c)``), or None.
        logit_scale, teacher_logit_scale: each head's multiplier (before the cap), or None.
        vocab_size: real vocabulary V; rows ``>= V`` are padding. None: V_pad.
        upstream: ``[*]`` per-row upstream gradient of the divergence, or None (no grads).

    Returns:
        ``{"divergence", "student_entropy", "teacher_entropy"}``: ``[*]`` float64, 0 on
        masked rows; ``"grad_hidden"`` ``[*, H]``, ``"grad_weight"`` ``[V_pad, H]`` (0 on
        padding rows) and ``"grad_bias"`` ``[V_pad]`` (None without bias) float64: the
        gradients of ``sum(upstream * divergence)``; all None without ``upstream``.

    Raises:
        ValueError: a bad kind / beta / vocab_size / mask / upstream, or mismatched shapes.
    """
    return _linear_divergence(
        hidden, weight, teacher_hidden, teacher_weight, exact=True, kind=kind, beta=beta,
        temperature=temperature, teacher_temperature=teacher_temperature, mask=mask, bias=bias,
        teacher_bias=teacher_bias, softcap=softcap, teacher_softcap=teacher_softcap,
        logit_scale=logit_scale, teacher_logit_scale=teacher_logit_scale,
        vocab_size=vocab_size, upstream=upstream,
    )  # fmt: skip


def materialized_divergence_baseline(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    **options: object,
) -> dict[str, Tensor | None]:
    """The plain computation a user writes (the yardstick of ``linear_divergence``): each
    head's logits (bias, scale, cap, temperature) in its inputs' dtype over every weight
    row, cut to V columns, upcast to float32, ``log_softmax``, the divergence in float32.

    Arguments (keyword ``options`` included) as in :func:`reference_divergence`.

    Returns:
        The keys of :func:`reference_divergence`: outputs ``[*]`` float32; gradients in
        the dtypes of hidden, weight and bias.
    """
    return _linear_divergence(
        hidden, weight, teacher_hidden, teacher_weight, exact=False, **options  # type: ignore[arg-type]
    )


def _divergence_from_logits(
    logits: Tensor,
    teacher_logprobs: Tensor,
    *,
    exact: bool,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    vocab_size: int | None = None,
    upstream: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """:func:`reference_divergence_from_logits` (``exact``) or its materialized baseline."""
    lead = logits.shape[:-1]
    if teacher_logprobs.shape != logits.shape:
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)} must have logits' shape "
            f"{tuple(logits.shape)}"
        )
    v, rows = _divergence_rows(
        "logits", lead, logits.shape[-1], kind=kind, beta=beta, mask=mask,
        vocab_size=vocab_size, upstream=upstream,
    )  # fmt: skip
    cols = logits.shape[-1]
    x = logits.detach().reshape(-1, cols)
    x = (x.to(torch.float64) if exact else x.clone()).requires_grad_(upstream is not None)
    teacher = teacher_logprobs.detach().reshape(-1, cols)[:, :v]
    teacher = teacher.to(torch.float64 if exact else torch.float32)
    with torch.enable_grad():
        idx = rows.to(x.device)
        l = x[idx][:, :v] if exact else x[idx]
        if logit_scale is not None:
            l = l * logit_scale
        z = _softcapped(l, softcap)
        if temperature != 1.0:
            z = z / temperature
        z = z if exact else z[:, :v].float()
        logq = teacher[idx].log_softmax(-1)
        stats = _divergence_statistics(z.log_softmax(-1), logq, kind, beta)
        flat = _scatter_rows(stats, rows, lead.numel())
        up = {} if upstream is None else {"divergence": upstream.to(z.dtype).reshape(-1)}
        result = _autograd_result(flat, lead, up, {"grad_logits": x})
    if result["grad_logits"] is not None:
        result["grad_logits"] = result["grad_logits"].reshape(logits.shape)
    return result


def reference_divergence_from_logits(
    logits: Tensor, teacher_logprobs: Tensor, **options: object
) -> dict[str, Tensor | None]:
    """fp64 truth of ``vocab_parallel_divergence`` (student logits vs teacher log-probs).

    Args:
        logits: ``[*, V_pad]`` the full (gathered) student logits, any float dtype.
        teacher_logprobs: ``[*, V_pad]`` the teacher's log-probs, taken as logits and
            renormalized over the first V columns (``-inf`` columns: a top-k payload).
        **options: ``kind``, ``beta``, ``temperature``, ``mask``, ``softcap``,
            ``logit_scale``, ``vocab_size``, ``upstream`` as in :func:`reference_divergence`
            (the transform applies to the student only).

    Returns:
        ``{"divergence", "student_entropy", "teacher_entropy"}`` ``[*]`` float64 and
        ``"grad_logits"`` ``[*, V_pad]`` float64 (0 in padding columns and masked rows), or
        None without ``upstream``.
    """
    return _divergence_from_logits(logits, teacher_logprobs, exact=True, **options)  # type: ignore[arg-type]


def materialized_divergence_baseline_from_logits(
    logits: Tensor, teacher_logprobs: Tensor, **options: object
) -> dict[str, Tensor | None]:
    """The plain computation from low-precision logits: scale, cap and temperature in the
    logits' dtype, then float32 ``log_softmax`` of both sides over V columns.

    Arguments and keys as in :func:`reference_divergence_from_logits`; outputs float32,
    ``grad_logits`` in the logits' dtype.
    """
    return _divergence_from_logits(logits, teacher_logprobs, exact=False, **options)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# linear_topk_divergence: the student's logits materialized in fp64; every formula written
# out over the whole vocabulary (the truncate tail's outside terms summed over the columns
# outside the ids, the bucket tail's mass as 1 - sum), then autograd for the gradients.

TOPK_TAIL_MIN = 2.0**-24
"""The smallest tail mass of ``tail="bucket"`` (the op's clamp)."""


def _topk_student_logits(hidden, weight, bias, vocab, options) -> Tensor:
    """``z [N, V]``: ``c tanh(s (h W^T + b) / c) / T`` over the real vocabulary."""
    l = hidden @ weight[:vocab].T
    if bias is not None:
        l = l + bias[:vocab]
    if options.get("logit_scale") is not None:
        l = l * options["logit_scale"]
    cap = options.get("softcap")
    if cap is not None:
        l = cap * torch.tanh(l / cap)
    return l / options.get("temperature", 1.0)


def _topk_w(weight: Tensor, x: Tensor) -> Tensor:
    return torch.where(weight > 0, weight * x, torch.zeros_like(x)).sum(-1)


def _topk_kl_family(ls: Tensor, lt: Tensor, kind: str, beta: float) -> Tensor:
    """The divergence over the last dimension (bucket distributions or unnormalized sums)."""
    s, t = ls.exp(), lt.exp()
    fwd, rev = _topk_w(t, lt - ls), _topk_w(s, ls - lt)
    if kind == "jsd":
        lm = torch.log(beta * t + (1 - beta) * s)
        return beta * _topk_w(t, lt - lm) + (1 - beta) * _topk_w(s, ls - lm)
    return {"forward_kl": fwd, "reverse_kl": rev, "mixed_kl": beta * fwd + (1 - beta) * rev}[kind]


def _topk_tail(logp: Tensor) -> Tensor:
    mass = logp.exp().sum(-1, keepdim=True).clamp(max=1 - TOPK_TAIL_MIN)
    return torch.cat([logp, torch.log1p(-mass)], dim=-1)


def _topk_truncated(lp_all, ids, lq, kind, beta, c) -> Tensor:
    """NeMo-RL's ``zero_outside_topk``: the renormalized teacher (0 outside the ids) against
    the whole student, the outside columns summed explicitly."""
    lt = lq - torch.logsumexp(lq, -1, keepdim=True)
    t = lt.exp()
    lp = lp_all.gather(-1, ids)
    p_all = lp_all.exp()
    outside = torch.ones_like(lp_all, dtype=torch.bool).scatter(-1, ids, False)
    fwd = _topk_w(t, lt - lp)
    rev = _topk_w(lp.exp(), lp - lt) + torch.where(outside, p_all * (lp_all - c), 0.0).sum(-1)
    if kind == "jsd":
        lm = torch.log(beta * t + (1 - beta) * lp.exp())
        out = torch.where(outside, p_all * -math.log(1 - beta), 0.0).sum(-1)
        return beta * _topk_w(t, lt - lm) + (1 - beta) * (_topk_w(lp.exp(), lp - lm) + out)
    return {"forward_kl": fwd, "reverse_kl": rev, "mixed_kl": beta * fwd + (1 - beta) * rev}[kind]


def _topk_rows(z, ids, lq, kind, tail, beta, c) -> tuple[Tensor, Tensor]:
    """``(divergence, student_mass)`` per row from the materialized ``z``."""
    lp_all = torch.log_softmax(z, dim=-1)
    lp = lp_all.gather(-1, ids)
    mass = lp.exp().sum(-1)
    if tail == "renormalize":
        zs = z.gather(-1, ids)
        ls = zs - torch.logsumexp(zs, -1, keepdim=True)
        lt = lq - torch.logsumexp(lq, -1, keepdim=True)
        return _topk_kl_family(ls, lt, kind, beta), mass
    if tail == "bucket":
        return _topk_kl_family(_topk_tail(lp), _topk_tail(lq), kind, beta), mass
    if tail == "none":
        return _topk_kl_family(lp, lq, kind, beta), mass
    return _topk_truncated(lp_all, ids, lq, kind, beta, c), mass


def reference_topk_divergence(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    kind: str = "forward_kl",
    tail: str = "renormalize",
    beta: float = 0.5,
    outside_logprob: float = -100.0,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    vocab_size: int | None = None,
    upstream: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    **options,
) -> dict[str, Tensor | None]:
    """Outputs and gradients of ``linear_topk_divergence`` in ``dtype`` (default fp64).

    ``options``: ``softcap``, ``logit_scale``, ``temperature``. ``upstream``: ``[*]`` the
    gradient of the divergence (default ones). Masked rows are computed on zeros and their
    outputs set to 0. Returns ``divergence``, ``student_mass``, ``teacher_mass`` (``[*]``),
    ``grad_hidden``, ``grad_weight`` (``weight``'s rows, 0 on padding) and ``grad_bias``.
    """
    lead, k = teacher_ids.shape[:-1], teacher_ids.shape[-1]
    keep = torch.ones(lead.numel(), dtype=torch.bool) if mask is None else mask.reshape(-1)
    h = hidden.detach().reshape(-1, hidden.shape[-1]).to(dtype)
    h = torch.where(keep[:, None], h, 0.0).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    b = None if bias is None else bias.detach().to(dtype).requires_grad_()
    vocab = weight.shape[0] if vocab_size is None else vocab_size
    ids = torch.where(keep[:, None], teacher_ids.reshape(-1, k).long(), 0)
    lq = torch.where(keep[:, None], teacher_logprobs.reshape(-1, k).to(dtype), 0.0)
    z = _topk_student_logits(h, w, b, vocab, options)
    div, mass = _topk_rows(z, ids, lq, kind, tail, beta, outside_logprob)
    div = torch.where(keep, div, 0.0)
    g = torch.ones_like(div) if upstream is None else upstream.reshape(-1).to(dtype)
    (div * torch.where(keep, g, 0.0)).sum().backward()
    t_mass = torch.where(keep, lq.exp().sum(-1), 0.0)
    return {
        "divergence": div.detach().view(lead),
        "student_mass": torch.where(keep, mass, 0.0).detach().view(lead),
        "teacher_mass": t_mass.view(lead),
        "grad_hidden": h.grad.view(hidden.shape),
        "grad_weight": w.grad,
        "grad_bias": None if b is None else b.grad,
    }
