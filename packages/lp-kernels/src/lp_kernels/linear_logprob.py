"""``linear_logprob``: per-token log-probs from hidden states and the LM-head weight.

The public entry point checks arguments, resolves the tensor-parallel layout
(validated once per group and layout, then cached), checks target ids (one host
sync, skipped with ``validate=False``), picks a backend and flattens the leading
dimensions. The numerics live in the backends (``lp_kernels.backends``) and in
``lp_kernels._stats``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Literal

import torch

from lp_kernels import _amp, _checks
from lp_kernels._compile import eager_under_compile
from lp_kernels._dist import DETERMINISTIC_TILE, default_deterministic_tile, resolve_vocab
from lp_kernels._types import LogProbOutput, LogprobParams
from lp_kernels.backends.torch_linear import LinearLogprobTorch, default_chunk_rows

Backend = Literal["auto", "torch", "triton"]


def _triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (the one place lp reads TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _resolve_backend(
    backend: str, device: torch.device, *, deterministic: bool = False
) -> type[torch.autograd.Function]:
    """The autograd Function for ``backend``. Errors inside a backend propagate; no fallback."""
    if backend == "auto":
        use_triton = (
            device.type == "cuda"
            and _triton_importable()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
        backend = "triton" if use_triton else "torch"
    if backend == "torch":
        if not deterministic:
            return LinearLogprobTorch
        from lp_kernels.backends.torch_deterministic import LinearLogprobTorchDeterministic

        return LinearLogprobTorchDeterministic
    if not _triton_importable():
        raise RuntimeError("backend='triton' needs the triton package (it ships with CUDA torch)")
    if device.type == "cuda" or (device.type == "cpu" and _triton_interpreting()):
        pass
    else:
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}); on CPU it runs only under "
            "TRITON_INTERPRET=1 (tests). Use backend='torch' or 'auto'"
        )
    if deterministic:
        from lp_kernels.backends.triton_deterministic import LinearLogprobTritonDeterministic

        return LinearLogprobTritonDeterministic
    from lp_kernels.backends.triton_linear import LinearLogprobTriton

    return LinearLogprobTriton


@eager_under_compile
def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
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
        weight: ``[V_local, H]``, same dtype and device as ``hidden``: the whole LM
            head, or this rank's contiguous vocabulary shard under ``tp_group``.
        targets: ``[*]`` int64 (or int32) global token ids, the leading shape of
            ``hidden``. Rows equal to ``ignore_index`` give 0 and no gradient.
        temperature: logits are divided by it (> 0); applied in the computation,
            the weight is not copied.
        ignore_index: target value of rows to skip; must not be a real token id.
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
            tiles cost less (fewer partials to merge, fewer fixed-point roundings):
            128-column tiles cost about 1.4 x the default path on H200, the default
            tile a few percent. The torch backend makes its calls tile by tile: on CUDA
            keep the default tile (128-column tiles take 2.3 s at S4 on H200; it warns
            above 128 tiles per shard).
        backend: ``"torch"`` (chunked torch ops, CPU and GPU), ``"triton"`` (the
            fused kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``), or ``"auto"``:
            triton on CUDA devices of compute capability >= 8.0, else torch.
        chunk_size: token rows per step of the torch backend (memory knob, at least
            16 are used); None = a default from the shard width (with
            ``deterministic``: the tile width) and the device, never from N.
        validate: check target ids (one host sync). False: no host sync at all.

    Returns:
        ``LogProbOutput(logprob, entropy, lse)``, each ``[*]`` float32 (entropy and
        lse None unless requested).

    Raises:
        TypeError: wrong tensor types or dtypes.
        ValueError: shape mismatches, bad options, targets out of range (with
            ``validate=True``), an inconsistent shard layout (on every rank), shard
            bounds off multiples of 128 with ``deterministic=True``.

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
    _checks.check_tensor(hidden, "hidden")
    _checks.check_float_dtype(hidden, "hidden")
    _checks.check_tensor(weight, "weight", min_dim=2)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    hidden, weight = _amp.autocast_inputs(hidden, weight)  # as F.linear under autocast
    _checks.check_targets(targets, hidden.shape[:-1], hidden.device, "hidden")
    temperature = _checks.check_options(
        temperature=temperature,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        backend=backend,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=tp_group,
    )
    deterministic_tile = _checks.check_deterministic_tile(deterministic_tile, allow_none=True)
    h_dim = hidden.shape[-1]
    if h_dim == 0:
        raise ValueError("hidden must have a non-empty last dimension H")
    problem = _checks.weight_problem(weight, hidden)
    if tp_group is None and problem:
        raise _checks.weight_error(problem, weight, hidden)
    layout = resolve_vocab(
        tp_group,
        v_local=weight.shape[0],
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        hidden=h_dim,
        dtype=hidden.dtype,
        deterministic=deterministic,
        device=hidden.device,
        problem=problem,
        tile=(deterministic_tile or 0) if deterministic else DETERMINISTIC_TILE,  # 0: default
        align=DETERMINISTIC_TILE,  # tiles may cross shard bounds (see _dist.tile_ownership)
    )
    vocab_start, vocab_size = layout.start, layout.vocab_size
    if deterministic_tile is None:  # from the global vocabulary: the same on every layout
        deterministic_tile = default_deterministic_tile(vocab_size)
    _checks.check_ignore_index(ignore_index, vocab_size)
    if validate:
        _checks.validate_targets(targets, vocab_size, ignore_index)
    # after the layout check, so ranks that disagree on `deterministic` all raise there
    function = _resolve_backend(backend, hidden.device, deterministic=bool(deterministic))
    # the torch backend's token chunk: from this shard's width, or in deterministic mode
    # from the tile's, which every layout shares (its GEMMs must have the same shapes)
    chunk_width = max(0, min(weight.shape[0], vocab_size - vocab_start))
    if deterministic:
        chunk_width = deterministic_tile
    params = LogprobParams(
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=bool(return_entropy),
        return_lse=bool(return_lse),
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        chunk_size=chunk_size or default_chunk_rows(chunk_width, hidden.device),
        tp_group=tp_group,
        tp_size=layout.world_size,
        max_v_local=max(layout.sizes),
        shard_starts=layout.starts,
        shard_sizes=layout.sizes,
        tp_rank=layout.rank,
        reduce_grad_hidden=bool(reduce_grad_hidden),
        deterministic=bool(deterministic),
        deterministic_tile=deterministic_tile,
    )
    lead = targets.shape
    with _amp.autocast_off(hidden.device):  # lp's precision policy is its own
        logprob, entropy, lse = function.apply(
            hidden.reshape(-1, h_dim), weight, targets.reshape(-1), params
        )
    return LogProbOutput(
        logprob.view(lead),
        entropy.view(lead) if entropy is not None else None,
        lse.view(lead) if lse is not None else None,
    )
