"""``linear_logprob_loss``: a per-token loss of the log-probs, fused into the LM-head pass.

When the loss is known before the forward (a policy-gradient loss, a KL penalty, an
entropy bonus, a z-loss: every RL objective that is a function of each row's
``(logprob, entropy, lse)`` and tensors the trainer holds), the gradient of a block of
rows is known as soon as the block's statistics are. The backends keep the block's logits
from the statistics pass to the gradient pass, so the step needs three GEMMs (logits,
grad_hidden, grad_weight) instead of the four of ``linear_logprob`` + a loss + backward,
which recomputes the logits. See :mod:`lp_kernels._loss` for what the backends share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lp_kernels._compile import eager_under_compile
from lp_kernels._loss import LossSpec, apply_fused, check_per_token, composed, resolve_entropy
from lp_kernels._prepare import prepare
from lp_kernels._stats import ignored_rows
from lp_kernels._types import LossOutput
from lp_kernels.backends.resolve import resolve_loss_backend
from lp_kernels.linear_logprob import Backend, linear_logprob


@eager_under_compile
def linear_logprob_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor],
    *,
    per_token: Mapping[str, Any] | None = None,
    return_entropy: bool | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: int | None = None,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> LossOutput:
    """``sum_n loss_fn(logprob, entropy, lse, **per_token)[n]`` with its gradients finished
    in the forward, without materializing the ``[N, V]`` logits.

    The per-token outputs are those of :func:`lp_kernels.linear_logprob` (same options,
    same numerics, within its parity bounds); ``loss_fn`` maps them to a loss per row.
    Rows are processed in blocks: each block's logits are computed once (one GEMM), its
    statistics merged over the whole vocabulary (over ``tp_group`` too), ``loss_fn``
    evaluated on the block's rows (its derivatives by autograd, or by its
    ``value_and_grad``), and the block's logits gradient formed
    from the kept logits, then the two gradient GEMMs. The backward only multiplies the
    finished gradients by the loss's upstream gradient. So a step costs three GEMMs
    where ``linear_logprob`` + a loss + ``backward()`` costs four, and the gradients are
    held from the forward until the backward.

    Args:
        hidden, weight, targets, bias, temperature, softcap, ignore_index, tp_group,
        vocab_start, vocab_size, reduce_grad_hidden, deterministic_tile, backend,
        validate: as for :func:`lp_kernels.linear_logprob`.
        loss_fn: ``loss_fn(logprob, entropy, lse, **per_token) -> Tensor[n]``, the loss of
            each of ``n`` rows, elementwise: row i's loss depends on row i's inputs only
            (it is applied block by block and the rows are summed; put means over rows in
            per-token weights, e.g. :func:`lp_kernels.losses.token_weights`). ``logprob``,
            ``lse`` and ``entropy`` are fp32 ``[n]`` (``entropy`` None unless computed);
            any torch function of them that autograd differentiates. Ready-made losses
            (GRPO, DAPO, Dr. GRPO, PPO, KL estimators, entropy bonus, z-loss) are in
            :mod:`lp_kernels.losses`; a ``loss_fn`` with a ``value_and_grad`` method (as
            :class:`lp_kernels.losses.PolicyLoss` has) gives its per-row derivatives in
            closed form and is not differentiated by autograd. Ignored rows are
            evaluated at zeros (outputs and per-token values) and masked: keep
            ``loss_fn`` finite there.
        per_token: keyword arguments of ``loss_fn``: tensors of the targets' shape (one
            value per row: old log-probs, advantages, weights, ...; cut per block), 0-d
            tensors or numbers (passed as they are). None of them may require grad; under
            ``tp_group`` they are the same on every rank, as ``targets`` are.
        return_entropy: compute the entropy (passed to ``loss_fn`` and returned). None:
            ``loss_fn.needs_entropy`` if it has one, else False.
        deterministic: as for ``linear_logprob`` (outputs, loss and gradients bitwise
            identical across TP degrees and layouts). This mode takes the composed path,
            ``loss_fn`` on ``linear_logprob(..., deterministic=True)``, whose backward
            recomputes the logits (four GEMMs).
        chunk_size: rows per block (a memory knob: the backends keep one block's fp32
            logits, ``chunk_size x V_local x 4`` bytes, and with several blocks an fp32
            ``[V_local, H]`` grad_weight accumulator). None: a default from the vocabulary
            width and the device, never from N. Under ``tp_group`` pass the same value on
            every rank (the blocks' statistics are exchanged block by block; with
            ``validate=True`` the per-call rank record carries it, so ranks that
            disagree raise instead of hanging).

    Returns:
        ``LossOutput(loss, token_loss, logprob, entropy, lse)``: ``loss`` a differentiable
        fp32 scalar; the others ``[*]`` fp32 without gradient (``entropy`` None unless
        computed), 0 on ignored rows.

    Raises:
        TypeError, ValueError: as ``linear_logprob``; ``per_token`` values of another shape
            or device, or that require grad; a ``loss_fn`` result that is not one
            floating-point loss per row.
        RuntimeError: a second backward through one call (``retain_graph=True``), or a
            second derivative.

    Example:
        >>> import torch
        >>> from lp_kernels import linear_logprob_loss
        >>> from lp_kernels.losses import dapo, token_weights
        >>> hidden = torch.randn(2, 5, 32, requires_grad=True)
        >>> weight = torch.randn(1000, 32, requires_grad=True)
        >>> targets = torch.randint(0, 1000, (2, 5))
        >>> old = torch.randn(2, 5) - 7.0
        >>> per_token = {"old_logprob": old, "advantages": torch.randn(2, 5),
        ...              "weights": token_weights(torch.ones(2, 5), "token-mean")}
        >>> out = linear_logprob_loss(hidden, weight, targets, dapo(), per_token=per_token)
        >>> out.loss.backward()
        >>> out.token_loss.shape, hidden.grad.shape
        (torch.Size([2, 5]), torch.Size([2, 5, 32]))
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    entropy = resolve_entropy(return_entropy, loss_fn)
    options = {
        "bias": bias,
        "temperature": temperature,
        "softcap": softcap,
        "ignore_index": ignore_index,
        "return_entropy": entropy,
        "return_lse": True,
        "tp_group": tp_group,
        "vocab_start": vocab_start,
        "vocab_size": vocab_size,
        "reduce_grad_hidden": reduce_grad_hidden,
        "deterministic": deterministic,
        "deterministic_tile": deterministic_tile,
        "backend": backend,
        "chunk_size": chunk_size,
        "validate": validate,
    }
    prep = prepare(hidden, weight, targets, loss=not deterministic, **options)
    if deterministic:  # the composed path
        spec = LossSpec(loss_fn, check_per_token(per_token, prep.lead, prep.inputs.device))
        # prepare has checked the call (and exchanged its record): no second sync or exchange
        out = linear_logprob(hidden, weight, targets, **{**options, "validate": False})
        ignored = ignored_rows(prep.targets, prep.params.ignore_index)
        flat = type(out)(*(None if x is None else x.reshape(-1) for x in out))
        loss, token_loss = composed(flat, spec, ignored)
        lead = prep.lead
        return LossOutput(
            loss,
            token_loss.view(lead),
            out.logprob.detach(),
            None if out.entropy is None else out.entropy.detach(),
            out.lse.detach(),
        )
    function = resolve_loss_backend(backend, prep.inputs.device)
    return apply_fused(function, prep, loss_fn, per_token, chunk_size)
