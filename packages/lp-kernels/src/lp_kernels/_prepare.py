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

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lp_kernels import _checks
from lp_kernels.core import amp
from lp_kernels.core.chunks import chunk_tiles, default_chunk_rows
from lp_kernels.core.extras import EXTRAS, check_extras
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


@dataclass(frozen=True)
class CallOptions:
    """One call's options as the public op received them (checked by :func:`prepare`)."""

    ignore_index: Any = -100
    return_entropy: bool = False
    return_lse: bool = False
    tp_group: Any = None
    vocab_start: Any = None
    vocab_size: Any = None
    reduce_grad_hidden: bool = True
    deterministic: bool = False
    deterministic_tile: Any = None
    backend: Any = "auto"
    chunk_size: Any = None
    validate: bool = True
    hint: str | None = None
    """Appended to the per-call rank contract's errors, for a caller that knows a likely
    cause of ranks disagreeing."""
    extras: Any = ()
    """The ``extras=`` statistics (checked by :func:`lp_kernels.core.extras.check_extras`)."""
    loss: bool = False
    """The call is ``linear_logprob_loss``'s (the record then carries its ``chunk_size``)."""
    divergence: tuple = ()
    """A divergence op's options beyond these (kind, beta, the teacher's side), for the
    per-call record (which then carries ``chunk_size`` too); empty for the other ops."""


def prepare(
    inputs: torch.Tensor,
    weight: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform,
    *,
    bias: Any = None,
    **options: Any,
) -> Prepared:
    """Check and resolve one call's arguments (see the public ops for their meaning and
    :class:`CallOptions` for ``options``). ``weight=None``: ``inputs`` are logits
    (``deterministic_tile`` then must be an int). A DTensor weight (torch-native tensor
    parallel) is turned into its local tensors and tensor-parallel arguments first.

    Raises:
        TypeError, ValueError: as documented by the public ops; layout errors on every rank.
    """
    o = CallOptions(**options)
    local = local_args(  # None unless weight is a DTensor
        inputs,
        weight,
        targets,
        tp_group=o.tp_group,
        vocab_start=o.vocab_start,
        vocab_size=o.vocab_size,
        reduce_grad_hidden=o.reduce_grad_hidden,
        bias=bias,
    )
    if local is None:
        return _prepare(inputs, weight, targets, transform, bias, o)
    with local.explain():  # a DTensor weight: prepare its local tensors
        o = dataclasses.replace(
            o, tp_group=local.tp_group, vocab_start=local.vocab_start, vocab_size=local.vocab_size
        )
        return _prepare(local.hidden, local.weight, local.targets, transform, local.bias, o)


def _prepare(inputs, weight, targets, transform, bias, o: CallOptions) -> Prepared:
    linear = weight is not None
    o = dataclasses.replace(o, extras=check_extras(o.extras))
    name = "hidden" if linear else "logits"
    inputs, weight, bias = _checked_tensors(inputs, weight, bias, name)
    _checks.check_targets(targets, inputs.shape[:-1], inputs.device, name)
    _checks.check_options(
        ignore_index=o.ignore_index,
        chunk_size=o.chunk_size,
        backend=o.backend,
        vocab_start=o.vocab_start,
        vocab_size=o.vocab_size,
        tp_group=o.tp_group,
    )
    tile = _checks.check_deterministic_tile(o.deterministic_tile, allow_none=linear)
    layout_args = _layout_args(inputs, weight, bias, tile, o)
    # the per-call rank contract: one record per call, before any size-dependent collective
    exchange = o.validate and o.tp_group is not None and dist.get_world_size(o.tp_group) > 1
    if exchange:
        layout = _exchange(inputs, weight, targets, transform, bias, layout_args, name, o)
    else:
        layout = resolve_vocab(o.tp_group, device=inputs.device, **layout_args)
    if tile is None:  # from the global vocabulary: the same on every layout
        tile = default_deterministic_tile(layout.vocab_size)
    _checks.check_ignore_index(o.ignore_index)
    if o.validate and not exchange:  # the exchange has checked the targets' range
        _checks.validate_targets(targets, layout.vocab_size, o.ignore_index)
    params = _params(transform, layout, layout_args["v_local"], tile, linear, inputs.device, o)
    width = inputs.shape[-1]
    flat = (inputs.reshape(-1, width), weight, targets.reshape(-1))
    return Prepared(*flat, params, targets.shape, bias)


def _checked_tensors(inputs, weight, bias, name: str):
    """``(inputs, weight, bias)`` checked and, under autocast, cast as ``F.linear`` would (a
    weight of another dtype than ``hidden``: both in the wider one)."""
    _checks.check_tensor(inputs, name)
    _checks.check_float_dtype(inputs, name)
    if weight is None:
        return inputs, weight, bias
    _checks.check_tensor(weight, "weight", min_dim=2)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    inputs, weight = amp.autocast_inputs(inputs, weight)  # as F.linear under autocast
    inputs, weight = common_operands(inputs, weight)  # mixed dtypes: the wider one
    if bias is not None:  # added in fp32 whatever its dtype; F.linear casts it too
        _checks.check_tensor(bias, "bias")
        (bias,) = amp.autocast_inputs(bias)
    return inputs, weight, bias


def _layout_args(inputs, weight, bias, tile: int | None, o: CallOptions) -> dict:
    """This rank's layout record (``distributed.layout.layout_key``'s arguments); a weight
    that does not fit ``hidden`` raises here without a group, else travels in the record so
    that every rank raises."""
    linear = weight is not None
    width = inputs.shape[-1]  # H, or V_local for logits
    if linear:
        if width == 0:
            raise ValueError("hidden must have a non-empty last dimension H")
        problem = _checks.weight_problem(weight, inputs) or _checks.bias_problem(bias, weight)
        if o.tp_group is None and problem:
            raise _checks.weight_error(problem, weight, inputs, bias)
        v_local = weight.shape[0]
        # 0: the default tile; tiles may cross shard bounds (see distributed.halo)
        tile = (tile or 0) if o.deterministic else DETERMINISTIC_TILE
        align = DETERMINISTIC_TILE
    else:
        problem, v_local, align = 0, width, None
        tile = tile if o.deterministic else DETERMINISTIC_TILE
    if o.tp_group is None and v_local == 0:
        what = "weight has no rows" if linear else "logits has an empty last dimension"
        raise ValueError(
            f"{what} (V_local = 0): without tp_group it must hold the whole vocabulary, "
            f"at least one entry (got shape {tuple((weight if linear else inputs).shape)})"
        )
    return {
        "v_local": v_local,
        "vocab_start": o.vocab_start,
        "vocab_size": o.vocab_size,
        "hidden": width if linear else 0,
        "dtype": inputs.dtype,
        "deterministic": bool(o.deterministic),
        "problem": problem,
        "tile": tile,
        "align": align,
    }


def _exchange(inputs, weight, targets, transform, bias, layout_args, name, o: CallOptions):
    """The validated layout from the per-call rank record (one all-gather, one host sync)."""
    linear = weight is not None
    fields = call_fields(
        n=targets.numel(),
        linear=linear,
        return_entropy=bool(o.return_entropy),
        return_lse=bool(o.return_lse),
        reduce_grad_hidden=bool(o.reduce_grad_hidden),
        transform=transform,
        ignore_index=o.ignore_index,
        inputs_grad=inputs.requires_grad,
        weight_grad=linear and weight.requires_grad,
        backend=o.backend,
        device=inputs.device,
        bias=bias,
        loss=o.loss,
        chunk_size=o.chunk_size,
        extras=o.extras,
        divergence=o.divergence,
    )
    return exchange_call_record(
        o.tp_group,
        key=layout_key(**layout_args),
        fields=fields,
        targets=targets,
        ignore_index=o.ignore_index,
        device=inputs.device,
        inputs=name,
        hint=o.hint,
    )


def _params(transform, layout, v_local: int, tile: int, linear: bool, device, o: CallOptions):
    """The :class:`LogprobParams` of a call on the validated ``layout``."""
    # the torch paths' token chunk: from this shard's width, or in deterministic mode from
    # a width every layout shares (the tile, or vocab_parallel_logprob's chunk of tiles),
    # so that its GEMMs and reductions have the same shapes on every layout
    chunk_width = max(0, min(v_local, layout.vocab_size - layout.start))
    if o.deterministic:
        chunk_width = tile * (1 if linear else chunk_tiles(tile))
    return LogprobParams(
        transform=transform,
        ignore_index=o.ignore_index,
        return_entropy=bool(o.return_entropy),
        return_lse=bool(o.return_lse),
        vocab_start=layout.start,
        vocab_size=layout.vocab_size,
        chunk_size=o.chunk_size or default_chunk_rows(chunk_width, device),
        tp_group=o.tp_group,
        tp_size=layout.world_size,
        max_v_local=max(layout.sizes),
        shard_starts=layout.starts,
        shard_sizes=layout.sizes,
        tp_rank=layout.rank,
        reduce_grad_hidden=bool(o.reduce_grad_hidden),
        deterministic=bool(o.deterministic),
        deterministic_tile=tile,
        extras=o.extras,
    )


def shaped(out: tuple, lead: torch.Size) -> LogProbOutput:
    """``(logprob, entropy, lse, log_sum_sq_probs, mean_logit, is_top1)`` of a Function
    (None where not asked), viewed with the leading shape ``lead``."""
    views = [None if x is None else x.view(lead) for x in out]
    logprob, entropy, lse, *extras = views
    return LogProbOutput(logprob, entropy, lse, **dict(zip(EXTRAS, extras, strict=True)))
