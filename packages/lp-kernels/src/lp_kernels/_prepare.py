"""The one argument-preparation path of both public ops: checks -> autocast -> layout ->
:class:`~lp_kernels.core.types.LogprobParams`.

``linear_logprob`` passes ``hidden [*, H]`` and its weight shard, ``vocab_parallel_logprob``
its logits ``[*, V_local]`` (``weight=None``). Checks that depend only on arguments every
rank passes alike raise at once; those that involve a rank's own shard travel in the
cross-rank layout record (:mod:`lp_kernels.distributed.layout`), so they raise on every
rank. The data-dependent target check is the one host sync, skipped with
``validate=False``. Under a ``tp_group`` of several ranks with ``validate=True``, the
per-call rank contract (:mod:`lp_kernels.distributed.contract`) exchanges one record of
the call, which also carries the layout and the targets' verdict: every rank raises the
same error, and the call still has one host sync.

A DTensor weight (torch-native tensor parallel) is first turned into its local tensors and
tensor-parallel arguments (:mod:`lp_kernels.distributed.dtensor`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lp_kernels import _checks
from lp_kernels.core import amp as _amp
from lp_kernels.core.chunks import chunk_tiles, default_chunk_rows
from lp_kernels.core.matmul import common_operands
from lp_kernels.core.tiles import DETERMINISTIC_TILE, default_deterministic_tile
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogProbOutput, LogprobParams
from lp_kernels.distributed.contract import call_fields, exchange_call_record
from lp_kernels.distributed.dtensor import local_args
from lp_kernels.distributed.layout import layout_key, resolve_vocab


class Prepared(NamedTuple):
    """What a public op hands its autograd Function: 2-D inputs, 1-D targets, options."""

    inputs: torch.Tensor
    """``hidden [N, H]`` (``linear_logprob``) or ``logits [N, V_local]``."""
    weight: torch.Tensor | None
    """``[V_local, H]``, autocast-cast as ``F.linear`` would; None for logits."""
    targets: torch.Tensor
    """``[N]`` target ids."""
    params: LogprobParams
    lead: torch.Size
    """The leading shape of the outputs (``targets``' shape)."""
    bias: torch.Tensor | None = None
    """``[V_local]`` LM-head bias of ``linear_logprob`` (autocast-cast), or None."""


def prepare(
    inputs: torch.Tensor,
    weight: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform,
    *,
    ignore_index: Any = -100,
    return_entropy: bool = False,
    return_lse: bool = False,
    tp_group: Any = None,
    vocab_start: Any = None,
    vocab_size: Any = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: Any = None,
    backend: Any = "auto",
    chunk_size: Any = None,
    validate: bool = True,
    tile_config: Any = None,
    bias: Any = None,
    hint: str | None = None,
    loss: bool = False,
) -> Prepared:
    """Check and resolve one call's arguments (see the public ops for their meaning).

    ``weight=None``: ``inputs`` are logits (``deterministic_tile`` then must be an int).
    ``hint``: appended to the per-call rank contract's errors (``validate=True`` under a
    ``tp_group`` of several ranks; :func:`lp_kernels.distributed.contract.exchange_call_record`),
    for a caller that knows a likely cause of ranks disagreeing. ``loss``: the call is
    ``linear_logprob_loss``'s (the record then carries its op and ``chunk_size``).

    Raises:
        TypeError, ValueError: as documented by the public ops; layout errors on every rank.
    """
    linear = weight is not None
    local = local_args(  # None unless weight is a DTensor
        inputs,
        weight,
        targets,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        reduce_grad_hidden=reduce_grad_hidden,
        bias=bias,
    )
    if local is not None:  # a DTensor weight (torch-native TP): prepare its local tensors
        with local.explain():
            return prepare(
                local.hidden,
                local.weight,
                local.targets,
                transform,
                ignore_index=ignore_index,
                return_entropy=return_entropy,
                return_lse=return_lse,
                tp_group=local.tp_group,
                vocab_start=local.vocab_start,
                vocab_size=local.vocab_size,
                reduce_grad_hidden=reduce_grad_hidden,
                deterministic=deterministic,
                deterministic_tile=deterministic_tile,
                backend=backend,
                chunk_size=chunk_size,
                validate=validate,
                tile_config=tile_config,
                bias=local.bias,
                hint=hint,
                loss=loss,
            )
    name = "hidden" if linear else "logits"
    _checks.check_tensor(inputs, name)
    _checks.check_float_dtype(inputs, name)
    if linear:
        _checks.check_tensor(weight, "weight", min_dim=2)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
        inputs, weight = _amp.autocast_inputs(inputs, weight)  # as F.linear under autocast
        inputs, weight = common_operands(inputs, weight)  # mixed dtypes: the wider one
        if bias is not None:  # added in fp32 whatever its dtype; F.linear casts it too
            _checks.check_tensor(bias, "bias")
            (bias,) = _amp.autocast_inputs(bias)
    _checks.check_targets(targets, inputs.shape[:-1], inputs.device, name)
    _checks.check_options(
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        backend=backend,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=tp_group,
    )
    deterministic_tile = _checks.check_deterministic_tile(deterministic_tile, allow_none=linear)
    width = inputs.shape[-1]  # H, or V_local for logits
    if linear:
        if width == 0:
            raise ValueError("hidden must have a non-empty last dimension H")
        problem = _checks.weight_problem(weight, inputs) or _checks.bias_problem(bias, weight)
        if tp_group is None and problem:
            raise _checks.weight_error(problem, weight, inputs, bias)
        v_local = weight.shape[0]
        # 0: the default tile; tiles may cross shard bounds (see distributed.halo)
        tile = (deterministic_tile or 0) if deterministic else DETERMINISTIC_TILE
        align = DETERMINISTIC_TILE
    else:
        problem, v_local, align = 0, width, None
        tile = deterministic_tile if deterministic else DETERMINISTIC_TILE
    if tp_group is None and v_local == 0:
        what = "weight has no rows" if linear else "logits has an empty last dimension"
        raise ValueError(
            f"{what} (V_local = 0): without tp_group it must hold the whole vocabulary, "
            f"at least one entry (got shape {tuple((weight if linear else inputs).shape)})"
        )
    layout_args = {
        "v_local": v_local,
        "vocab_start": vocab_start,
        "vocab_size": vocab_size,
        "hidden": width if linear else 0,
        "dtype": inputs.dtype,
        "deterministic": bool(deterministic),
        "problem": problem,
        "tile": tile,
        "align": align,
    }
    # the per-call rank contract: one record per call, before any size-dependent collective
    exchange = validate and tp_group is not None and dist.get_world_size(tp_group) > 1
    if exchange:
        layout = exchange_call_record(
            tp_group,
            key=layout_key(**layout_args),
            fields=call_fields(
                n=targets.numel(),
                linear=linear,
                return_entropy=bool(return_entropy),
                return_lse=bool(return_lse),
                reduce_grad_hidden=bool(reduce_grad_hidden),
                transform=transform,
                ignore_index=ignore_index,
                inputs_grad=inputs.requires_grad,
                weight_grad=linear and weight.requires_grad,
                backend=backend,
                device=inputs.device,
                bias=bias,
                loss=loss,
                chunk_size=chunk_size,
            ),
            targets=targets,
            ignore_index=ignore_index,
            device=inputs.device,
            inputs=name,
            hint=hint,
        )
    else:
        layout = resolve_vocab(tp_group, device=inputs.device, **layout_args)
    vocab_start, vocab_size = layout.start, layout.vocab_size
    if deterministic_tile is None:  # from the global vocabulary: the same on every layout
        deterministic_tile = default_deterministic_tile(vocab_size)
    _checks.check_ignore_index(ignore_index)
    if validate and not exchange:  # the exchange has checked the targets' range
        _checks.validate_targets(targets, vocab_size, ignore_index)
    # the torch paths' token chunk: from this shard's width, or in deterministic mode from
    # a width every layout shares (the tile, or vocab_parallel_logprob's group of tiles),
    # so that its GEMMs and reductions have the same shapes on every layout
    chunk_width = max(0, min(v_local, vocab_size - vocab_start))
    if deterministic:
        chunk_width = deterministic_tile * (1 if linear else chunk_tiles(deterministic_tile))
    params = LogprobParams(
        transform=transform,
        ignore_index=ignore_index,
        return_entropy=bool(return_entropy),
        return_lse=bool(return_lse),
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        chunk_size=chunk_size or default_chunk_rows(chunk_width, inputs.device),
        tp_group=tp_group,
        tp_size=layout.world_size,
        max_v_local=max(layout.sizes),
        shard_starts=layout.starts,
        shard_sizes=layout.sizes,
        tp_rank=layout.rank,
        reduce_grad_hidden=bool(reduce_grad_hidden),
        deterministic=bool(deterministic),
        deterministic_tile=deterministic_tile,
        tile_config=tile_config,
    )
    lead = targets.shape
    return Prepared(inputs.reshape(-1, width), weight, targets.reshape(-1), params, lead, bias)


def shaped(out: tuple, lead: torch.Size):
    """``(logprob, entropy, lse)`` of a Function, viewed with the leading shape ``lead``."""
    logprob, entropy, lse = out
    return LogProbOutput(
        logprob.view(lead),
        entropy.view(lead) if entropy is not None else None,
        lse.view(lead) if lse is not None else None,
    )
