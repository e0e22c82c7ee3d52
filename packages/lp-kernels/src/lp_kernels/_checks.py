"""Argument checks shared by the public ops. Each error names the argument and what it expects.

Checks that depend only on arguments every rank passes identically (hidden,
targets, scalar options) raise at once. Checks that involve a rank's own shard go
through the cross-rank layout table (``distributed.layout.resolve_vocab``) so they raise on every
rank. The data-dependent target check costs exactly one host sync and no
collective, and is skipped with ``validate=False``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from lp_kernels.core.tiles import DETERMINISTIC_TILE
from lp_kernels.distributed.layout import WEIGHT_PROBLEMS

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
BACKENDS = ("auto", "torch", "triton")


def _dtensor_type() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` is loaded (else no tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def check_tensor(x: Any, name: str, *, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(x, dtensor):
        # linear_logprob takes a DTensor weight (distributed.dtensor) and then a Replicate
        # hidden / targets on its mesh; any other DTensor reaching here is refused.
        if name == "logits":
            what = (
                "Pass logits.to_local() with tp_group=<the mesh dimension's group> and "
                "vocab_start=<the global id of its first vocabulary entry>"
            )
        else:
            what = (
                f"lp takes {name} as a DTensor only with a DTensor weight on the same mesh; "
                f"with a plain weight pass {name}.to_local()"
            )
        raise TypeError(
            f"{name} is a DTensor (placements {tuple(x.placements)}); lp takes local "
            f"tensors here. {what}"
        )
    if x.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
            f"pass {name}.to_dense()"
        )
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device (shapes only, no data); lp computes on real "
            "tensors: materialize it on cpu or cuda first (e.g. module.to_empty(...) and load "
            "the weights)"
        )
    if x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}"
        )
    return x


def check_tp_group(tp_group: Any) -> None:
    """``tp_group``: None or a ``torch.distributed.ProcessGroup``."""
    if tp_group is None:
        return
    group_type = getattr(torch.distributed, "ProcessGroup", None)
    if group_type is None or not isinstance(tp_group, group_type):
        raise TypeError(
            "tp_group must be None or a torch.distributed.ProcessGroup (e.g. "
            "torch.distributed.new_group(...), or torch.distributed.group.WORLD once the "
            f"default group is initialized), got {type(tp_group).__name__} {tp_group!r}"
        )


def check_float_dtype(x: torch.Tensor, name: str) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_targets(
    targets: Any, lead_shape: torch.Size, device: torch.device, lead_name: str
) -> None:
    check_tensor(targets, "targets", min_dim=0)
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"targets must be an int64 (or int32) tensor of token ids, got {targets.dtype}"
        )
    if targets.shape != lead_shape:
        raise ValueError(
            f"targets must have the leading shape of {lead_name}, {tuple(lead_shape)}; "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != device:
        raise ValueError(f"targets is on {targets.device} but {lead_name} is on {device}")


def check_options(
    *,
    ignore_index: Any,
    chunk_size: Any,
    backend: Any,
    vocab_start: Any,
    vocab_size: Any,
    tp_group: Any,
) -> None:
    """Check scalar options (the logit transform's are checked by
    ``LogitTransform.checked``)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(
            f"ignore_index must fit in int64 (targets are compared with it as int64), got "
            f"{ignore_index}; use a negative value such as -100"
        )
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, val in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 0):
            raise ValueError(f"{name} must be None or a non-negative int, got {val!r}")
    if vocab_size == 0:
        raise ValueError("vocab_size must be >= 1")
    check_tp_group(tp_group)
    if tp_group is None and vocab_start not in (None, 0):
        raise ValueError(
            f"vocab_start={vocab_start} needs tp_group: without it the weight is the whole "
            "vocabulary and starts at id 0"
        )


def check_deterministic_tile(tile: Any, *, allow_none: bool = False) -> int | None:
    """``deterministic_tile``: a positive multiple of 128 (the kernels' column tiles), or
    None where the function picks one (``allow_none``)."""
    if tile is None and allow_none:
        return None
    if isinstance(tile, bool) or not isinstance(tile, int):
        what = "an int or None" if allow_none else "an int"
        raise TypeError(f"deterministic_tile must be {what}, got {type(tile).__name__}")
    if tile < DETERMINISTIC_TILE or tile % DETERMINISTIC_TILE:
        raise ValueError(
            f"deterministic_tile must be a positive multiple of {DETERMINISTIC_TILE}, got {tile}"
        )
    return tile


def check_ignore_index(ignore_index: int) -> None:
    """Any int64 value: rows whose target equals it are ignored, a real token id included."""
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")


def validate_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise if a target is neither ``ignore_index`` nor in ``[0, vocab_size)``. One host sync."""
    if targets.numel() == 0:
        return
    targets = targets.long()  # int32 targets: compare in int64 (torch would wrap ignore_index)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    n_bad = int(bad.sum().item())
    if n_bad:
        where = bad.reshape(-1).nonzero()[:5].squeeze(1)
        examples = ", ".join(
            f"[{i}]={v}"
            for i, v in zip(where.tolist(), targets.reshape(-1)[where].tolist(), strict=True)
        )
        raise ValueError(
            f"{n_bad} target(s) are outside [0, {vocab_size}) and not ignore_index={ignore_index} "
            f"(flat index=value: {examples})"
        )


def bias_problem(bias: torch.Tensor | None, weight: torch.Tensor) -> int:
    """0 if ``bias`` (None, or ``[V_local]``) fits ``weight``, else a key of
    ``WEIGHT_PROBLEMS``."""
    if bias is None:
        return 0
    if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
        return 5
    if bias.dtype not in SUPPORTED_DTYPES or bias.device != weight.device:
        return 6
    return 0


def weight_problem(weight: torch.Tensor, hidden: torch.Tensor) -> int:
    """0 if ``weight`` fits ``hidden``, else a key of ``WEIGHT_PROBLEMS``."""
    if weight.dtype not in SUPPORTED_DTYPES:
        return 1
    if weight.device != hidden.device:
        return 3
    if weight.shape[1] != hidden.shape[-1]:
        return 4
    return 0


def weight_error(
    code: int, weight: torch.Tensor, hidden: torch.Tensor, bias: torch.Tensor | None = None
) -> Exception:
    detail = (
        f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device}, "
        f"hidden {tuple(hidden.shape)} {hidden.dtype} on {hidden.device}"
    )
    if bias is not None:
        detail += f", bias {tuple(bias.shape)} {bias.dtype} on {bias.device}"
    exc = TypeError if code in (1, 6) else ValueError
    return exc(f"weight does not fit hidden: {WEIGHT_PROBLEMS[code]} ({detail})")
