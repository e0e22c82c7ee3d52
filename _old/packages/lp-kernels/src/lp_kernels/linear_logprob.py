"""``linear_logprob``: per-token log-probs from hidden states and the LM-head weight.

The public entry point prepares its arguments (``lp_kernels._prepare``: checks,
autocast, the tensor-parallel layout validated once per group and layout then cached,
target ids checked with one host sync unless ``validate=False``), picks a backend
(``lp_kernels.backends.resolve.resolve_backend``) and flattens the leading dimensions. The
numerics live in the backends and in ``lp_kernels._stats``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lp_kernels import _amp
from lp_kernels._compile import eager_under_compile
from lp_kernels._prepare import prepare, shaped
from lp_kernels._types import LogProbOutput
from lp_kernels.backends.resolve import resolve_backend

Backend = Literal["auto", "torch", "triton"]


@eager_under_compile
def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_lse: bool = False,
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
    Under ``torch.compile`` it runs eagerly behind a graph break, so a compiled step
    gets the same bits as an eager one (``fullgraph=True`` raises). Under
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
        ignore_index: target value of rows to skip (any int64; a real token id too:
            those rows are then ignored, e.g. a pad token masked by its id).
        return_entropy: also return the entropy of ``softmax(logits / T)`` per row
            (differentiable).
        return_lse: also return the log-sum-exp per row (differentiable; z-loss).
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
            costs are in docs/benchmarks.md). The torch backend makes its calls tile by
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
        DTensor inputs.

    Raises:
        TypeError: wrong tensor types or dtypes; a DTensor weight placement other than
            ``Shard(0)`` or ``Replicate``.
        ValueError: shape mismatches, bad options, targets out of range (with
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
    prep = prepare(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        return_lse=return_lse,
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
    function = resolve_backend(backend, prep.inputs.device, deterministic=bool(deterministic))
    with _amp.autocast_off(prep.inputs.device):  # lp's precision policy is its own
        out = function.apply(prep.inputs, prep.weight, prep.bias, prep.targets, prep.params)
    return shaped(out, prep.lead)
