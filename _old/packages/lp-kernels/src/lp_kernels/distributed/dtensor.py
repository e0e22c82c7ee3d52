"""DTensor arguments of ``linear_logprob`` (torch-native tensor parallel) -> lp's local case.

What is accepted, and what it is read as::

    weight                          hidden / targets            lp computes
    ------------------------------  --------------------------  -------------------------------
    Replicate, 1-D mesh             plain, or Replicate on the  the plain case (whole head)
                                    weight's mesh
    Shard(0), 1-D mesh of P ranks   plain, or Replicate on the  vocabulary parallel:
      (ColwiseParallel's lm_head)   weight's mesh               tp_group = mesh.get_group(),
                                                                this rank's rows of the chunk
                                                                rule below, vocab_size = the
                                                                DTensor's global rows
    anything else (Shard(1), Partial, a 2-D mesh, _StridedShard, hidden or targets sharded or
    on another mesh): TypeError / ValueError naming the placement and what lp accepts.

The rows of rank ``r`` are torch's ``Shard(0)`` chunk rule (``torch.chunk``): every rank but
the last ones holds ``ceil(V / P)`` rows, the last may hold fewer or none; rank ``r`` starts at
``min(r * ceil(V / P), V)``. Every rank derives the whole table from the global shape alone, so
a table lp cannot run (a rank without rows) raises the same error on every rank with no
collective. A local tensor whose rows differ from the rule (a ``DTensor.from_local`` with an
inconsistent ``shape=``) is caught by the cross-rank layout check, on every rank.

Gradients keep the placements: lp runs on ``weight.to_local()`` (and ``hidden.to_local()``),
which autograd maps back, so ``weight.grad`` is a DTensor with the weight's placements holding
this rank's rows of the gradient. ``hidden``'s gradient is the full sum (Replicate), or with
``reduce_grad_hidden=False`` this rank's partial, declared ``Partial()``.

The trap: an FSDP2 (``fully_shard``) parameter seen outside FSDP's forward is also a
``Shard(0)`` DTensor on a 1-D mesh, but that mesh is data parallel and its ranks hold different
tokens. Nothing in the DTensor tells the two apart. With ``validate=True`` the per-call rank
record sees the ranks' targets differ and raises on every rank; :meth:`LocalArgs.explain`
adds to such errors that an FSDP2 weight must be used through the FSDP-wrapped module.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LocalArgs", "chunk_rows", "local_args"]


def chunk_rows(rows: int, ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(starts, sizes)`` of ``rows`` over ``ranks`` by torch's ``Shard(0)`` (``torch.chunk``).

    Example:
        >>> chunk_rows(5, 4)
        ((0, 2, 4, 5), (2, 2, 1, 0))
    """
    chunk = -(-rows // ranks)  # ceil
    starts = tuple(min(r * chunk, rows) for r in range(ranks))
    sizes = tuple(max(0, min(chunk, rows - r * chunk)) for r in range(ranks))
    return starts, sizes


@dataclass(frozen=True)
class LocalArgs:
    """Local tensors and the tensor-parallel arguments that a DTensor ``weight`` stands for."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    tp_group: Any
    """``mesh.get_group()`` for a ``Shard(0)`` weight, None for a Replicate one."""
    vocab_start: int | None
    vocab_size: int | None
    placement: str
    """The weight's placements and mesh in words, for messages."""
    bias: torch.Tensor | None = None
    """The bias's local tensor (a DTensor with the weight's mesh and placements), or None."""

    @contextlib.contextmanager
    def explain(self) -> Iterator[None]:
        """Add to a ``ValueError`` of the tensor-parallel path what a ``Shard(0)`` DTensor weight
        was read as, and the FSDP2 remedy (the per-call record raises when ranks differ)."""
        try:
            yield
        except ValueError as exc:
            if self.tp_group is None:
                raise
            raise ValueError(
                f"{exc} [weight is a DTensor, {self.placement}, read as tensor-parallel "
                "vocabulary shards: every rank of its mesh must pass the same hidden and "
                "targets. An FSDP2 (fully_shard) parameter outside FSDP's forward is such a "
                "DTensor on the data-parallel mesh, where ranks hold different tokens: call lp "
                "through the FSDP-wrapped module (inside its forward, where FSDP has unsharded "
                "the weight), not on module.weight directly.]"
            ) from exc


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _describe(x: Any) -> str:
    mesh = x.device_mesh
    names = f", dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return f"placements {tuple(x.placements)} on a mesh of shape {tuple(mesh.shape)}{names}"


_ACCEPTED = (
    "lp accepts a weight DTensor on a 1-D mesh with placements (Shard(dim=0),) (vocabulary "
    "parallel, e.g. ColwiseParallel on lm_head) or (Replicate(),)"
)


def _local_companion(x: Any, name: str, weight: Any, dtensor: type, **to_local: Any) -> Any:
    """``hidden`` or ``targets``: a plain tensor as is, a Replicate DTensor on the weight's mesh
    as its local tensor; anything else raises."""
    if not isinstance(x, dtensor):
        return x
    from torch.distributed.tensor import Replicate

    if x.device_mesh != weight.device_mesh:
        raise ValueError(
            f"{name} is a DTensor on another mesh than weight ({name}: {_describe(x)}; weight: "
            f"{_describe(weight)}); pass it plain or Replicate on the weight's mesh"
        )
    if not all(isinstance(p, Replicate) for p in x.placements):
        raise ValueError(
            f"{name} is a DTensor with {_describe(x)}; lp takes {name} plain or Replicate on "
            "the weight's mesh (every rank the same rows). Redistribute it to Replicate() "
            "first (a sequence-parallel input: ColwiseParallel's input_layouts does that)"
        )
    return x.to_local(**to_local)


def _local_bias(bias: Any, weight: Any, dtensor: type, sharded: bool) -> Any:
    """The bias beside a DTensor weight: a DTensor on the weight's mesh with the weight's
    placements (what ``ColwiseParallel`` makes of an ``nn.Linear`` bias) as its local tensor,
    a plain tensor only beside a Replicate weight (with a ``Shard(0)`` weight it would be
    ambiguous: the whole bias or this rank's shard?)."""
    if bias is None:
        return None
    if not isinstance(bias, dtensor):
        if sharded:
            raise ValueError(
                f"bias is a plain tensor beside a DTensor weight ({_describe(weight)}); pass "
                "the bias as a DTensor with the weight's mesh and placements (as "
                "ColwiseParallel shards an nn.Linear's bias), or both as local tensors with "
                "tp_group and vocab_start"
            )
        return bias
    if bias.device_mesh != weight.device_mesh or tuple(bias.placements) != tuple(weight.placements):
        raise ValueError(
            f"bias is a DTensor with {_describe(bias)}; beside weight ({_describe(weight)}) it "
            "must have the weight's mesh and placements"
        )
    return bias.to_local()


def local_args(
    hidden: Any,
    weight: Any,
    targets: Any,
    *,
    tp_group: Any,
    vocab_start: Any,
    vocab_size: Any,
    reduce_grad_hidden: bool,
    bias: Any = None,
) -> LocalArgs | None:
    """The local arguments a DTensor ``weight`` stands for; None when ``weight`` is no DTensor.

    Raises:
        ValueError: ``tp_group`` or ``vocab_start`` given with a DTensor weight (ambiguous); a
            weight mesh that is not 1-D; a rank of the chunk rule without rows; ``hidden`` or
            ``targets`` a DTensor not Replicate on the weight's mesh; a ``bias`` that is not
            a DTensor with the weight's mesh and placements (plain: beside Replicate only).
        TypeError: a weight placement other than ``Shard(0)`` and ``Replicate``.
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(weight, dtensor):
        return None  # a DTensor hidden / targets with a plain weight: refused by the checks
    from torch.distributed.tensor import Partial, Replicate, Shard

    if tp_group is not None or vocab_start is not None:
        raise ValueError(
            f"weight is a DTensor ({_describe(weight)}): its mesh gives the group and its "
            "chunking the vocabulary offsets; pass neither tp_group nor vocab_start (or pass "
            "weight.to_local() with both)"
        )
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.dim() != 2:
        raise ValueError(
            f"weight is a DTensor with {_describe(weight)} and shape {tuple(weight.shape)}; "
            f"{_ACCEPTED}. A 2-D mesh (HSDP, FSDP2 with TP) is not supported: call lp inside "
            "the FSDP-wrapped module's forward, where only the TP dimension is left"
        )
    (placement,) = weight.placements
    # exact types: _StridedShard (FSDP2 over TP) is no plain vocabulary split
    sharded = type(placement) is Shard and placement.dim in (0, -2)
    if not (sharded or type(placement) is Replicate):
        what = "partial sums" if isinstance(placement, Partial) else "not the vocabulary rows"
        raise TypeError(f"weight is a DTensor with {_describe(weight)} ({what}); {_ACCEPTED}")
    grad_hidden = [Replicate() if reduce_grad_hidden or not sharded else Partial()]
    hidden = _local_companion(hidden, "hidden", weight, dtensor, grad_placements=grad_hidden)
    targets = _local_companion(targets, "targets", weight, dtensor)
    bias = _local_bias(bias, weight, dtensor, sharded)
    if not sharded:  # Replicate: every rank holds the whole head
        return LocalArgs(
            hidden, weight.to_local(), targets, None, None, vocab_size, _describe(weight), bias
        )
    rows, ranks = weight.shape[0], mesh.size()
    starts, sizes = chunk_rows(rows, ranks)
    if 0 in sizes:
        empty = [r for r, s in enumerate(sizes) if s == 0]
        raise ValueError(
            f"weight is a DTensor Shard(0) of {rows} rows over {ranks} ranks: torch's chunking "
            f"(ceil({rows}/{ranks}) rows each) leaves ranks {empty} without rows (sizes "
            f"{list(sizes)}); lp needs at least one vocabulary row per rank: pad the vocabulary "
            "or use fewer ranks"
        )
    return LocalArgs(
        hidden,
        weight.to_local(),
        targets,
        mesh.get_group(),
        starts[mesh.get_local_rank()],
        rows if vocab_size is None else vocab_size,
        _describe(weight),
        bias,
    )
