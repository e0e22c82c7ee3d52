"""lp's public ops: per-token log-probs, entropy and log-sum-exp of target tokens, without
materialized ``[N, V]`` logits.

- :func:`linear_logprob` from hidden states ``[*, H]`` and the LM-head weight (or its
  tensor-parallel vocabulary shard) ``[V_local, H]``;
- :func:`linear_logprob_loss`: a per-token loss of those outputs with its gradients
  finished in the forward (three GEMMs per step instead of four);
- :func:`vocab_parallel_logprob`: the same contract for callers that hold ``[*, V_local]``
  logits.

Each op builds its :class:`~lp_kernels.core.transform.LogitTransform`, prepares its
arguments (``lp_kernels._prepare``: checks, autocast, the tensor-parallel layout and the
per-call rank contract), picks a backend (``lp_kernels.backends.resolve``) and flattens the
leading dimensions. The numerics live in the backends and in ``lp_kernels.core``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from lp_kernels import library
from lp_kernels._prepare import Prepared, prepare, shaped
from lp_kernels.backends.resolve import resolve_backend, resolve_loss_backend
from lp_kernels.backends.torch.logits import VocabParallelLogprob
from lp_kernels.core import amp
from lp_kernels.core.chunks import default_chunk_rows
from lp_kernels.core.compile import eager_under_compile
from lp_kernels.core.loss import LossSpec, check_per_token, composed, resolve_entropy
from lp_kernels.core.stats import ignored_rows
from lp_kernels.core.tiles import DETERMINISTIC_TILE
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogProbOutput, LossOutput

Backend = Literal["auto", "torch", "triton"]


def _traced_linear_logprob(
    hidden, weight, targets, *, bias, temperature, softcap, logit_scale, extras, tp_group, **options
):
    """``linear_logprob`` under ``torch.compile``: the ``lp::linear_logprob`` custom op
    (:mod:`lp_kernels.library`), or ``NotImplemented`` for arguments it does not carry
    (DTensors, options of other types: the eager op behind a graph break)."""
    if not library.plain(hidden, weight, targets, bias):
        return NotImplemented
    transform = (temperature, softcap, logit_scale)  # checked by the op, at run time
    args = library.op_options(transform, extras, tp_group, **options)
    if args is None:
        return NotImplemented
    return library.linear_logprob(hidden, weight, targets, bias, args)


def _traced_vocab_parallel_logprob(
    logits, targets, *, temperature, softcap, logit_scale, extras, tp_group, **options
):
    """``vocab_parallel_logprob`` under ``torch.compile``: ``lp::vocab_parallel_logprob``,
    or ``NotImplemented`` (as :func:`_traced_linear_logprob`)."""
    if not library.plain(logits, targets):
        return NotImplemented
    transform = (temperature, softcap, logit_scale)  # checked by the op, at run time
    options.update(reduce_grad_hidden=True, backend="auto")
    args = library.op_options(transform, extras, tp_group, **options)
    if args is None:
        return NotImplemented
    return library.vocab_parallel_logprob(logits, targets, args)


@eager_under_compile(traced=_traced_linear_logprob)
def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_lse: bool = False,
    extras: Sequence[str] = (),
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: int | None = None,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> LogProbOutput:
    """Log-probabilities of ``targets`` under ``softmax(hidden @ weight.T / temperature)``.

    Never materializes the ``[N, V]`` logits: the vocabulary GEMM, the softmax
    statistics and, in backward, the logits gradient are computed chunk by chunk.
    All sums accumulate in fp32; outputs are fp32; gradients come back in the
    input dtypes. Every call is bitwise reproducible run to run. A row's outputs and
    its ``grad_hidden`` row do not depend on the other rows, on N or on
    ``chunk_size`` (batch invariance) with the triton backend, and with the torch
    backend on CPU; the torch backend on CUDA is not batch-invariant (cuBLAS).
    Under ``torch.compile`` it is the opaque custom op ``lp::linear_logprob`` (its backward
    ``lp::linear_logprob_backward``), so ``fullgraph=True`` captures it and a compiled step
    gets the same bits as an eager one (DTensor arguments: a graph break). Under
    ``torch.autocast`` ``hidden`` and ``weight`` are cast to the autocast dtype, as
    ``F.linear`` would be; lp's own math stays as above.

    Args:
        hidden: ``[*, H]`` float32, bfloat16 or float16 last hidden states.
        weight: ``[V_local, H]`` float32, bfloat16 or float16 on ``hidden``'s device:
            the whole LM head, or this rank's contiguous vocabulary shard under
            ``tp_group``. If its dtype differs from ``hidden``'s, the GEMMs run in the
            wider of the two (a bf16 ``hidden`` with an fp32 head: fp32, by an ``[N, H]``
            copy of ``hidden``); each gradient comes back in its input's dtype. Or a
            DTensor on a 1-D mesh (torch-native tensor parallel, e.g. ``ColwiseParallel``
            on ``lm_head``): ``Shard(0)`` is the vocabulary-parallel case with
            ``tp_group = mesh.get_group()``, each rank's rows and ``vocab_start`` from
            torch's chunking (uneven allowed; every rank needs a row) and ``vocab_size``
            defaulting to the global rows; ``Replicate`` is the plain case. Then pass
            neither ``tp_group`` nor ``vocab_start``; ``hidden`` and ``targets`` may be
            plain or Replicate DTensors on that mesh. ``weight.grad`` (and a DTensor
            ``hidden``'s grad) keeps its placements. Other placements (``Shard(1)``,
            ``Partial``, a 2-D mesh) raise. An FSDP2 parameter outside FSDP's forward is
            a ``Shard(0)`` DTensor on the data-parallel mesh, not vocabulary shards: call
            lp inside the FSDP-wrapped module's forward (``validate=True`` raises on every
            rank when the ranks' targets differ).
        targets: ``[*]`` int64 (or int32) global token ids, the leading shape of
            ``hidden``. Rows equal to ``ignore_index`` give 0 and no gradient.
        bias: ``[V_local]`` float32, bfloat16 or float16 LM-head bias (this rank's shard
            under ``tp_group``), or None. Its fp32 value is added to the logits inside
            the kernels, ``l = hidden @ weight.T + bias``, before the temperature; its
            gradient ``sum_n d loss / d l[n, v]`` is summed in fp32 in a fixed order and
            returned in its dtype (reproducible run to run, TP-invariant with
            ``deterministic``; a sum over rows, so not batch-invariant).
        temperature: logits are divided by it (> 0); applied in the computation,
            the weight is not copied.
        softcap: None, or a cap ``c > 0``: final-logit softcapping (Gemma 2 / 3's
            ``final_logit_softcapping``), ``z = c * tanh(l / c) / temperature`` on the raw
            logits ``l = hidden @ weight.T (+ bias)``: the cap first, then the sampler's
            temperature. In fp32 inside the kernels, in every output and both gradients
            (``dz / dl = (1 - tanh^2) / T``); non-finite logits stay non-finite.
        logit_scale: None, or a multiplier ``s > 0`` of the raw logits, bias included,
            before the softcap and the temperature: ``z = c tanh(s l / c) / T`` (Granite's
            ``1 / logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's
            ``lm_head_multiplier``, MiniCPM3's ``dim_model_base / hidden_size``). Applied
            in fp32 inside the kernels, the weight is not copied; 1 is no scale.
        ignore_index: target value of rows to skip (any int64; a real token id too:
            those rows are then ignored, e.g. a pad token masked by its id).
        return_entropy: also return the entropy of ``softmax(logits / T)`` per row
            (differentiable).
        return_lse: also return the log-sum-exp per row (differentiable; z-loss).
        extras: any of ``"log_sum_sq_probs"``, ``"mean_logit"``, ``"is_top1"``: per-row
            statistics of the same ``z`` (the whole transform: bias, ``logit_scale``,
            ``softcap``, temperature) over the real vocabulary, computed in the forward
            without gradient (detached) on both backends, under ``tp_group`` and with
            ``deterministic`` (then bitwise TP-invariant too). ``log_sum_sq_probs``: fp32
            ``log sum_v p_v^2`` (the collision log-probability; ``-log V`` for a flat row, 0
            for a one-hot one), from ``log sum e^(2 (z - max)) - 2 (lse - max)``;
            ``mean_logit``: fp32 ``sum_v z_v / vocab_size``; ``is_top1``: bool, the target
            is the first column of the row's largest ``z`` (``argmax(z) == target``; ties,
            across shards too, go to the lowest id). Ignored rows give 0, 0 and False,
            rows whose lse is not finite NaN, NaN and False. Default ``()``: none, and the
            kernels and bits of the call are those without this argument. A bad value
            raises ``TypeError`` / ``ValueError`` naming ``extras``.
        tp_group: ``torch.distributed`` group the vocabulary is sharded over. Every
            rank passes the same ``hidden`` and ``targets`` and its own shard;
            shards may be uneven. Every rank returns the same outputs. The backward's
            collectives follow which inputs need gradients, so ``hidden`` and the
            shards require grad alike on every rank (as in any TP layer).
        vocab_start: global id of this rank's weight row 0. Default 0, or
            ``rank * V_local`` under ``tp_group`` (even shards only).
        vocab_size: the real global vocabulary. Ids ``>= vocab_size`` are padding
            (Megatron pads the head) and never enter the softmax. Default: all rows.
        reduce_grad_hidden: under ``tp_group``, sum ``grad_hidden`` over the group
            (fp32). False returns this rank's partial for the caller to reduce
            (e.g. a sequence-parallel reduce-scatter).
        deterministic: tensor-parallel invariance: outputs and both gradients are
            bitwise identical for any TP degree and any layout whose shard bounds are
            multiples of 128 (else ``ValueError`` on every rank), on both backends
            (the torch backend with the same ``chunk_size`` on each layout; its
            default is). With
            ``reduce_grad_hidden=False`` the returned partial is exact per rank, but
            the caller's own reduction decides the bits of the sum.
        deterministic_tile: width of the global vocabulary tiles of
            ``deterministic=True`` (a multiple of 128; unused otherwise). None (the
            default): ``deterministic_tile_for(vocab_size, 8)``, about an eighth of the
            vocabulary (:func:`lp_kernels.default_deterministic_tile`). The bits are
            identical across every layout whose shard bounds are multiples of 128,
            whatever the tile; they depend on the tile, so compare runs made with the
            same one (the default is the same for one ``vocab_size`` everywhere). A tile
            that crosses a shard bound is computed whole by the rank where it starts,
            with the next ranks' weight rows sent to it (see docs/design.md). Wider
            tiles cost less (fewer partials to merge, fewer fixed-point roundings; the
            costs are in docs/history.md). The torch backend makes its calls tile by
            tile: on CUDA keep the default tile (it warns above 128 tiles per shard,
            where kernel launches bound the step).
        backend: ``"torch"`` (chunked torch ops, CPU and GPU), ``"triton"`` (the
            fused kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``), or ``"auto"``:
            triton on CUDA devices of compute capability >= 8.0, else torch.
        chunk_size: token rows per step of the torch backend (memory knob, at least
            16 are used; fewer N use N rounded up to a power of two, so the scratch
            follows ``min(N, chunk_size)``); None = a default from the shard width (with
            ``deterministic``: the tile width) and the device, never from N.
        validate: check target ids (one host sync). Under a ``tp_group`` of several
            ranks it also exchanges one small record of the call (one tiny
            all-gather), so that ranks disagreeing on N, targets, temperature,
            options, ``requires_grad`` or layout, or one rank with a bad target, all
            raise the same ``ValueError`` instead of mixing or hanging. False: no host
            sync and no such collective; the caller guarantees all of that (pass the
            same ``validate`` on every rank).

    Returns:
        ``LogProbOutput(logprob, entropy, lse)``, each ``[*]`` float32 (entropy and
        lse None unless requested); plain tensors, the same on every rank, also for
        DTensor inputs. It unpacks as that triple; the ``extras`` are its attributes
        ``log_sum_sq_probs``, ``mean_logit`` (``[*]`` float32) and ``is_top1`` (``[*]``
        bool), None unless asked.

    Raises:
        TypeError: wrong tensor types or dtypes; a DTensor weight placement other than
            ``Shard(0)`` or ``Replicate``.
        ValueError: shape mismatches, bad options (``extras`` included), targets out of range (with
            ``validate=True``), an inconsistent shard layout (on every rank), shard
            bounds off multiples of 128 with ``deterministic=True``, ranks that disagree
            within a call (``validate=True``, on every rank); a DTensor weight with
            ``tp_group`` or ``vocab_start``, on a 2-D mesh, or with a DTensor ``hidden`` /
            ``targets`` not Replicate on its mesh.
        RuntimeError: in backward, asked for a second derivative (``create_graph=True``
            or an upstream gradient that requires grad): lp's ops are differentiable
            once.

    Example:
        >>> import torch
        >>> from lp_kernels import linear_logprob
        >>> hidden = torch.randn(4, 6, 32, requires_grad=True)
        >>> weight = torch.randn(1000, 32, requires_grad=True)
        >>> targets = torch.randint(0, 1000, (4, 6))
        >>> out = linear_logprob(hidden, weight, targets, return_entropy=True)
        >>> (out.logprob * torch.randn(4, 6)).sum().backward()
        >>> out.logprob.shape, hidden.grad.shape
        (torch.Size([4, 6]), torch.Size([4, 6, 32]))
    """
    transform = LogitTransform.checked(
        temperature=temperature, softcap=softcap, logit_scale=logit_scale
    )
    prep = prepare(
        hidden,
        weight,
        targets,
        transform,
        bias=bias,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        return_lse=return_lse,
        extras=extras,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        reduce_grad_hidden=reduce_grad_hidden,
        deterministic=deterministic,
        deterministic_tile=deterministic_tile,
        backend=backend,
        chunk_size=chunk_size,
        validate=validate,
    )
    # after the layout check, so ranks that disagree on `deterministic` all raise there
    return _logprob(prep, backend)


def _logprob(prep: Prepared, backend: str) -> LogProbOutput:
    """``linear_logprob``'s outputs for prepared arguments."""
    function = resolve_backend(backend, prep.inputs.device, deterministic=prep.params.deterministic)
    with amp.autocast_off(prep.inputs.device):  # lp's precision policy is its own
        out = function.apply(prep.inputs, prep.weight, prep.bias, prep.targets, prep.params)
    return shaped(out, prep.lead)


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
    logit_scale: float | None = None,
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
    held from the forward until the backward. Under ``torch.compile`` it runs eagerly
    behind a graph break (``loss_fn`` is a Python callable, which no custom op takes; same
    bits as eager), so ``fullgraph=True`` raises Dynamo's error naming this op; compose
    ``linear_logprob`` with the loss to compile a step whole.

    Args:
        hidden, weight, targets, bias, temperature, softcap, logit_scale, ignore_index, tp_group,
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
    transform = LogitTransform.checked(
        temperature=temperature, softcap=softcap, logit_scale=logit_scale
    )
    options = {
        "bias": bias,
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
    prep = prepare(hidden, weight, targets, transform, loss=not deterministic, **options)
    if deterministic:  # the composed path: the loss on linear_logprob's outputs
        spec = LossSpec(loss_fn, check_per_token(per_token, prep.lead, prep.inputs.device))
        out = _logprob(prep, backend)
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
    return _loss(function, prep, loss_fn, per_token, chunk_size)


@eager_under_compile(traced=_traced_vocab_parallel_logprob)
def vocab_parallel_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_lse: bool = False,
    extras: Sequence[str] = (),
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
    deterministic: bool = False,
    deterministic_tile: int = DETERMINISTIC_TILE,
) -> LogProbOutput:
    """Log-probabilities of ``targets`` from (vocabulary-sharded) logits, in fp32.

    Same semantics as :func:`lp_kernels.linear_logprob` with ``z = logits / T``.
    Logits may be masked to ``-inf`` (top-k / top-p): masked entries have probability 0
    and every output and gradient stays exact and finite; a masked target has logprob
    ``-inf`` (with a finite gradient); a row with every entry ``-inf`` gives NaN.
    Works chunk by chunk in fp32 whatever the logits dtype; the backward writes
    each chunk's gradient into one preallocated buffer (the returned gradient).
    Under ``torch.compile`` it is the opaque custom op ``lp::vocab_parallel_logprob`` (same
    bits as eager; ``fullgraph=True`` captures it); ``torch.autocast`` changes nothing (the
    logits are taken in their own dtype).

    Args:
        logits: ``[*, V_local]`` float32, bfloat16 or float16: the whole vocabulary,
            or this rank's contiguous shard under ``tp_group``.
        targets: ``[*]`` int64 (or int32) global token ids, the leading shape of
            ``logits``; ``ignore_index`` rows give 0 and no gradient.
        temperature: logits are divided by it (> 0).
        softcap: None, or a cap ``c > 0``: ``z = c * tanh(logits / c) / temperature`` (the
            cap on the raw logits, then the temperature), in fp32; ``-inf`` (masked)
            logits stay ``-inf``.
        logit_scale: None, or a multiplier ``s > 0`` of the logits before the cap and the
            temperature, ``z = c tanh(s logits / c) / T``, as in
            :func:`lp_kernels.linear_logprob`.
        ignore_index: target value of rows to skip (any int64; a real token id too:
            those rows are then ignored, e.g. a pad token masked by its id).
        return_entropy: also return the entropy per row (differentiable).
        return_lse: also return the log-sum-exp per row (differentiable).
        extras: per-row statistics without gradient, as in
            :func:`lp_kernels.linear_logprob`: ``"log_sum_sq_probs"``, ``"mean_logit"`` (a
            masked ``-inf`` entry makes it ``-inf``) and ``"is_top1"``.
        tp_group: the group the vocabulary is sharded over (every rank passes the
            same targets); every rank returns the same outputs.
        vocab_start: global id of this rank's first column; default 0, or
            ``rank * V_local`` under ``tp_group`` (even shards only).
        vocab_size: the real global vocabulary; columns ``>= vocab_size`` are
            padding, excluded from the softmax, and get zero gradient.
        chunk_size: token rows per step (at least 16 are used; fewer N use N rounded
            up to a power of two); None = a default
            from the shard width (with ``deterministic``: from the width of its groups
            of tiles, the same on every layout) and device, never from N.
        validate: check target ids (one host sync), and under a ``tp_group`` of several
            ranks exchange one record of the call so that disagreeing ranks all raise
            (see :func:`lp_kernels.linear_logprob`); False = no host sync, no exchange.
        deterministic: tensor-parallel invariance: outputs and the logits gradient are
            bitwise identical for any TP degree and any layout whose shard bounds are
            multiples of 128 (else ``ValueError`` on every rank): partials of each
            global 128-column tile are merged in global tile order.
        deterministic_tile: the width of those tiles (a multiple of 128; unused
            otherwise), as in :func:`lp_kernels.linear_logprob`.

    Returns:
        ``LogProbOutput(logprob, entropy, lse)``, each ``[*]`` float32, with the ``extras``
        as attributes (None unless asked).

    Example:
        >>> import torch
        >>> from lp_kernels import vocab_parallel_logprob
        >>> logits = torch.randn(3, 5, 100, requires_grad=True)
        >>> out = vocab_parallel_logprob(logits, torch.randint(0, 100, (3, 5)))
        >>> out.logprob.sum().backward()
        >>> logits.grad.shape
        torch.Size([3, 5, 100])
    """
    transform = LogitTransform.checked(
        temperature=temperature, softcap=softcap, logit_scale=logit_scale
    )
    prep = prepare(
        logits,
        None,
        targets,
        transform,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        return_lse=return_lse,
        extras=extras,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        deterministic=deterministic,
        deterministic_tile=deterministic_tile,
        chunk_size=chunk_size,
        validate=validate,
    )
    # fp32 math whatever the logits dtype, autocast or not (log_softmax is fp32 there too)
    with amp.autocast_off(prep.inputs.device):
        out = VocabParallelLogprob.apply(prep.inputs, prep.targets, prep.params)
    return shaped(out, prep.lead)


def _loss(function, prep, loss_fn, per_token, chunk_size) -> LossOutput:
    """Run a fused loss Function (``function``) on prepared arguments ``prep``
    (``lp_kernels._prepare.Prepared``) and shape its outputs like the targets."""
    values = check_per_token(per_token, prep.lead, prep.inputs.device)
    p = prep.params
    if chunk_size is None:  # from a width every rank shares: the blocks' exchanges match
        width = max(0, min(p.max_v_local, p.vocab_size))
        p = dataclasses.replace(p, chunk_size=default_chunk_rows(width, prep.inputs.device))
    grad = torch.is_grad_enabled()
    needs = (
        grad and prep.inputs.requires_grad,
        grad and prep.weight.requires_grad,
        grad and prep.bias is not None and prep.bias.requires_grad,
    )
    spec = LossSpec(loss_fn, values, needs, chunk_size)
    with amp.autocast_off(prep.inputs.device):
        loss, token_loss, logprob, entropy, lse = function.apply(
            prep.inputs, prep.weight, prep.bias, prep.targets, p, spec
        )
    lead = prep.lead
    return LossOutput(
        loss,
        token_loss.view(lead),
        logprob.view(lead),
        None if entropy is None else entropy.view(lead),
        lse.view(lead),
    )
