"""What both backends of ``linear_logprob_loss`` share: the caller's per-token tensors, the
loss evaluated on one block of rows, and the backward that scales finished gradients.

A loss known before the forward lets a backend finish the gradients block by block: once
a block's softmax statistics are merged (over the tensor-parallel group too), its rows'
``(logprob, entropy, lse)`` are final, ``loss_fn`` runs on them under autograd, and the
derivatives ``g_lp, g_ent, g_lse = d loss / d (logprob, entropy, lse)`` per row are the
upstream gradients of the logits gradient (``_stats.d_logits_``). The backends keep the
block's logits from the statistics pass to the gradient pass, so the logits GEMM runs once
(three GEMMs per step instead of four).

Ignored rows (``target == ignore_index``) and a block's padding rows are evaluated at
``logprob = entropy = lse = 0`` and zero per-token values, so a ``loss_fn`` sees finite
inputs there, and then masked out: their loss is exactly 0 and so is their gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lp_kernels.core.compile import backend_backward

RESERVED = ("logprob", "entropy", "lse")


@dataclass(frozen=True)
class LossSpec:
    """The loss of one call (internal; built by ``linear_logprob_loss``)."""

    loss_fn: Callable[..., torch.Tensor]
    """``loss_fn(logprob, entropy, lse, **per_token) -> [n]`` per-token loss."""
    per_token: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``loss_fn``: ``[N]`` tensors (cut per block) or constants."""
    needs: tuple[bool, bool, bool] = (False, False, False)
    """Whether hidden, weight and bias need gradients (grad mode on and requires_grad)."""
    block_rows: int | None = None
    """The caller's ``chunk_size`` (rows per block), or None: the backend's default."""

    @property
    def any_grad(self) -> bool:
        return any(self.needs)


def check_per_token(per_token: Any, lead: torch.Size, device: torch.device) -> dict[str, Any]:
    """``per_token`` with each tensor of the targets' shape flattened to ``[N]``.

    Values may be tensors of shape ``lead`` (one value per row), 0-d tensors and Python
    numbers (passed to every block unchanged). Nothing may require grad: the op finishes
    the gradients in its forward, with respect to hidden, weight and bias only.
    """
    if per_token is None:
        return {}
    if not isinstance(per_token, Mapping):
        raise TypeError(
            f"per_token must be a mapping of loss_fn keyword names to tensors, got "
            f"{type(per_token).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in per_token.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"per_token keys must be identifiers (loss_fn keywords), got {key!r}")
        if key in RESERVED:
            raise ValueError(
                f"per_token[{key!r}]: {key!r} is the op's own argument of loss_fn; rename it"
            )
        if isinstance(value, (bool, int, float)):
            out[key] = value
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"per_token[{key!r}] must be a torch.Tensor or a Python number, got "
                f"{type(value).__name__}"
            )
        if value.requires_grad:
            raise ValueError(
                f"per_token[{key!r}] requires grad; linear_logprob_loss differentiates with "
                f"respect to hidden, weight and bias only: pass per_token[{key!r}].detach()"
            )
        if value.device != device:
            raise ValueError(f"per_token[{key!r}] is on {value.device}, hidden is on {device}")
        if value.dim() == 0:
            out[key] = value
        elif value.shape == lead:
            out[key] = value.reshape(-1)
        else:
            raise ValueError(
                f"per_token[{key!r}] must have the targets' shape {tuple(lead)} (one value per "
                f"row) or be 0-d, got shape {tuple(value.shape)}"
            )
    return out


def resolve_entropy(return_entropy: bool | None, loss_fn: Any) -> bool:
    """``return_entropy``, or when None the loss's own ``needs_entropy`` (default False)."""
    if return_entropy is None:
        return bool(getattr(loss_fn, "needs_entropy", False))
    return bool(return_entropy)


def block_values(per_token: Mapping[str, Any], r0: int, r1: int, rows: int) -> dict[str, Any]:
    """Rows ``[r0, r1)`` of each ``[N]`` value, zero-padded to ``rows``; constants as they are."""
    out = {}
    for key, value in per_token.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            part = value[r0:r1]
            if r1 - r0 < rows:
                part = torch.cat([part, part.new_zeros(rows - (r1 - r0))])
            value = part
        out[key] = value
    return out


def zero_dead(values: Mapping[str, Any], dead: torch.Tensor) -> dict[str, Any]:
    """``values`` with each per-row tensor set to 0 on ``dead`` rows (constants unchanged)."""
    return {
        k: (
            torch.where(dead, torch.zeros((), dtype=v.dtype, device=v.device), v)
            if isinstance(v, torch.Tensor) and v.dim() == 1
            else v
        )
        for k, v in values.items()
    }


def checked_token_loss(out: Any, dead: torch.Tensor) -> torch.Tensor:
    """``loss_fn``'s result as fp32 ``[n]``, exactly 0 on ``dead`` rows; a clear error if it
    is not one floating-point loss per row."""
    n = dead.shape[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        what = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(
            f"loss_fn must return a floating-point tensor of per-row losses, got {what}"
        )
    if out.shape != (n,):
        raise ValueError(
            f"loss_fn must return one loss per row, shape ({n},) for a block of {n} rows, got "
            f"shape {tuple(out.shape)}: the op applies it block by block and sums the rows, "
            f"so a mean over rows belongs in per-token weights (lp_kernels.losses.token_weights)"
        )
    return torch.where(dead, 0.0, out.float())


def checked_grads(g: Any, inputs: tuple[torch.Tensor | None, ...]) -> tuple:
    """``loss_fn.value_and_grad``'s derivatives: three entries, each None or a
    floating-point tensor of its input's shape (and None where the input is None)."""
    names = ("logprob", "entropy", "lse")
    if not isinstance(g, (tuple, list)) or len(g) != 3:
        raise TypeError(
            "loss_fn.value_and_grad must return (loss, (g_logprob, g_entropy, g_lse)), got "
            f"derivatives {type(g).__name__}"
        )
    for name, x, gx in zip(names, inputs, g, strict=True):
        if gx is None:
            continue
        if x is None:
            raise ValueError(f"loss_fn.value_and_grad: a derivative for {name}, which is None")
        if not isinstance(gx, torch.Tensor) or not gx.is_floating_point() or gx.shape != x.shape:
            what = f"shape {tuple(gx.shape)}" if isinstance(gx, torch.Tensor) else type(gx).__name__
            raise ValueError(
                f"loss_fn.value_and_grad: the derivative for {name} must be a floating-point "
                f"tensor of shape {tuple(x.shape)}, got {what}"
            )
    return tuple(g)


def block_loss(
    spec: LossSpec,
    logprob: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor,
    dead: torch.Tensor,
    values: Mapping[str, Any],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
    """One block's per-row loss (fp32, detached, 0 on ``dead`` rows) and, when the call needs
    gradients, ``(g_lp, g_ent, g_lse)``: its derivatives per row (fp32, 0 on dead rows;
    None for an output the loss does not use).

    ``logprob``, ``entropy`` and ``lse`` are the block's outputs (0 on dead rows: ignored
    and padding rows); ``values`` its per-token values, zeroed on dead rows here. A
    ``loss_fn`` with a ``value_and_grad`` method (:class:`lp_kernels.losses.PolicyLoss`)
    gives its derivatives in closed form; any other is differentiated by autograd.
    """
    grad = spec.any_grad
    closed_form = getattr(spec.loss_fn, "value_and_grad", None)
    if grad and callable(closed_form):
        out, g = closed_form(logprob, entropy, lse, **zero_dead(values, dead))
        out = checked_token_loss(out, dead)
        g = checked_grads(g, (logprob, entropy, lse))
        return out, tuple(None if x is None else torch.where(dead, 0.0, x.float()) for x in g)
    leaves = [
        None if x is None else x.detach().requires_grad_(grad) for x in (logprob, entropy, lse)
    ]
    with torch.enable_grad() if grad else contextlib.nullcontext():
        out = checked_token_loss(spec.loss_fn(*leaves, **zero_dead(values, dead)), dead)
        if not grad:
            return out, None
        if not out.requires_grad:  # the loss does not depend on lp's outputs
            return out.detach(), (None, None, None)
        used = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad(out.sum(), used, allow_unused=True))
    g = [None if x is None else next(grads) for x in leaves]
    return out.detach(), tuple(None if x is None else torch.where(dead, 0.0, x) for x in g)


def scale_(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``grad * g`` in place (``g`` a 0-d upstream gradient)."""
    return grad.mul_(g.to(grad.dtype))


class FinishedGradients(torch.autograd.Function):
    """Base of the loss Functions: ``forward`` saves the finished gradients of the loss
    (``ctx.grads = (grad_hidden, grad_weight, grad_bias)``, for the Function's first three
    inputs); ``backward`` scales them in place by the loss's upstream gradient, with
    ``ctx.scale(grad, g)`` if the forward set one (the triton backend's skips the pass on the
    device when g is 1: no host sync), else :func:`scale_`. Outputs after the loss are
    metrics without gradient. A forward may set ``ctx.op`` (the op its errors name; default
    ``linear_logprob_loss``) and ``ctx.constants`` (the inputs after the three; default 3)."""

    @staticmethod
    def forward(ctx, *args):  # pragma: no cover - subclasses define it
        raise NotImplementedError

    @staticmethod
    @backend_backward
    def backward(ctx, g_loss, *_):
        grads = ctx.grads
        constants = (None,) * getattr(ctx, "constants", 3)
        if grads is None:
            raise RuntimeError(
                f"{getattr(ctx, 'op', 'linear_logprob_loss')}: backward ran twice through one "
                "call (retain_graph=True); its forward finished the gradients and the first "
                "backward handed them out. Call the op again for a second backward"
            )
        ctx.grads = None
        if g_loss is None:
            return (None, None, None, *constants)
        scale = getattr(ctx, "scale", scale_)
        grad_h, grad_w, grad_b = (None if x is None else scale(x, g_loss) for x in grads)
        return grad_h, grad_w, grad_b, *constants


def finish(ctx, outputs, grads, spec: LossSpec):
    """Save ``grads`` on ``ctx`` (only those the call needs) and return the Function's
    outputs ``(loss, token_loss, logprob, entropy, lse)`` with the metrics marked
    non-differentiable."""
    token_loss, logprob, entropy, lse = outputs
    ctx.grads = tuple(g if need else None for g, need in zip(grads, spec.needs, strict=True))
    loss = token_loss.sum()
    metrics = [x for x in (token_loss, logprob, entropy, lse) if x is not None]
    ctx.mark_non_differentiable(*metrics)
    return loss, token_loss, logprob, entropy, lse


def composed(out, spec: LossSpec, ignored: torch.Tensor):
    """The loss on ``linear_logprob``'s outputs ``out`` through autograd (the
    ``deterministic=True`` path): ``(loss, token_loss)``, ``loss`` differentiable."""
    values = zero_dead(spec.per_token, ignored)
    token_loss = checked_token_loss(
        spec.loss_fn(out.logprob, out.entropy, out.lse, **values), ignored
    )
    return token_loss.sum(), token_loss.detach()
