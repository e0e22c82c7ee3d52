"""The argument preparation of the divergence ops, shared by their eager path
(:mod:`lp_kernels.divergence`) and their custom ops (:mod:`lp_kernels.library_divergence`),
so that both run the same checks and resolve the same :class:`DivergenceParams`.

Each side's logit transform comes in as the values of :class:`LogitTransform`'s fields, in
order (the student's, then the teacher's with its temperature resolved), and is checked
after ``kind`` and ``beta``. The mask reaches ``lp_kernels._prepare.prepare`` as targets
(:data:`MASKED` on masked rows), so that ranks disagreeing on it raise as on targets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lp_kernels import _checks
from lp_kernels._prepare import Prepared, prepare
from lp_kernels.backends.resolve import concrete_backend
from lp_kernels.core.chunks import default_chunk_rows
from lp_kernels.core.divergence import DivergenceParams, check_kind
from lp_kernels.core.tiles import DETERMINISTIC_TILE
from lp_kernels.core.transform import LogitTransform

MASKED = -1
"""The row code of a masked row (the other rows' code is 0): the ops pass ``mask`` to the
preparation path as targets with this ``ignore_index``, so that ranks disagreeing on the
mask raise like ranks disagreeing on targets."""

BUFFERS = {"torch": 4, "triton": 1}
"""How many times fewer rows than ``linear_logprob``'s torch chunk (one fp32 ``[C, V_local]``
buffer of 1 GiB on CUDA) a divergence chunk takes. torch: both sides' softmax arguments and
the terms of their sums, about eight such buffers of a quarter of the rows; triton: both
heads' GEMM outputs and ``d l``, three buffers of the whole rows (about 3 GiB at a 152k
vocabulary), so that the gradient GEMMs see chunks of about a thousand rows."""

FIELDS = tuple(LogitTransform.__dataclass_fields__)
"""The names of :class:`LogitTransform`'s fields, in order (the public ops' keywords)."""

LINEAR_OPTIONS = ("tp_group", "vocab_start", "vocab_size", "reduce_grad_hidden", "deterministic")
LINEAR_OPTIONS += ("deterministic_tile", "backend", "chunk_size", "validate")
"""The options ``linear_divergence`` hands the preparation path as they are."""


def transform_of(values: Sequence[Any]) -> LogitTransform:
    """The checked transform of :data:`FIELDS`' ``values`` (errors name the field)."""
    return LogitTransform.checked(**dict(zip(FIELDS, values, strict=True)))


def check_constant(x: Any, name: str) -> None:
    """A teacher tensor must not require grad: its gradient would be silently dropped."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        raise ValueError(
            f"{name} requires grad, but the teacher is a constant of the divergence (no "
            f"gradient reaches it): pass {name}.detach(), or compute it under torch.no_grad()"
        )


def row_codes(mask: Any, lead: torch.Size, device: torch.device, first: str) -> torch.Tensor:
    """``[*]`` int64: 0 for the rows to compute, :data:`MASKED` for the others."""
    if mask is None:
        return torch.zeros(lead, dtype=torch.int64, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype
        raise TypeError(f"mask must be None or a bool tensor, got {what}")
    if mask.shape != lead:
        raise ValueError(
            f"mask must have the leading shape of {first}, {tuple(lead)}, got "
            f"{tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"mask must be on {first}'s device {device}, got {mask.device}")
    return torch.where(mask, 0, MASKED)


def chunked(prep: Prepared, chunk_size: Any, backend: str) -> Prepared:
    """``prep`` with the divergence's default chunk unless ``chunk_size`` was given: from
    the widest shard, the same on every rank (each chunk makes collectives), or with
    ``deterministic`` from the tile, the same on every layout."""
    if chunk_size is not None:
        return prep
    p = prep.params
    width = p.deterministic_tile if p.deterministic else p.max_v_local
    budget = default_chunk_rows(width, prep.inputs.device)
    rows = max(16, budget // BUFFERS[backend])
    return prep._replace(params=dataclasses.replace(p, chunk_size=rows))


def row_weights(weights: Any, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 ``[*]`` row weights (ones for None), checked."""
    lead = hidden.shape[:-1] if isinstance(hidden, torch.Tensor) else None
    if weights is None:
        return torch.ones(lead, dtype=torch.float32, device=hidden.device)
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        what = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise TypeError(f"weights must be None or a float tensor, got {what}")
    if weights.shape != lead or weights.device != hidden.device:
        raise ValueError(
            f"weights must have hidden's leading shape {tuple(lead)} on {hidden.device}, got "
            f"{tuple(weights.shape)} on {weights.device}"
        )
    if weights.requires_grad:
        raise ValueError("weights requires grad; row weights are constants: pass .detach()")
    return weights.float()


def check_teacher_layout(student: Prepared, teacher: Prepared) -> None:
    """Both heads must cover the same vocabulary rows (on every rank alike: the layouts
    compared are the gathered ones)."""
    s, t = student.params, teacher.params
    layouts = [(x.vocab_size, x.shard_starts, x.shard_sizes) for x in (s, t)]
    if layouts[0] != layouts[1]:
        raise ValueError(
            "teacher_weight must hold the student's vocabulary rows (the same V_local and "
            f"vocab_start on every rank): weight has {student.weight.shape[0]} rows here "
            f"(shards {s.shard_sizes}, vocab_size {s.vocab_size}), teacher_weight "
            f"{teacher.weight.shape[0]} (shards {t.shard_sizes}, vocab_size {t.vocab_size})"
        )


def check_teacher(hidden, teacher_hidden, teacher_weight, teacher_bias) -> None:
    for x, name in ((teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
        _checks.check_tensor(x, name)
        check_constant(x, name)
    check_constant(teacher_bias, "teacher_bias")
    _checks.check_tensor(hidden, "hidden")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got shape {tuple(teacher_hidden.shape)}"
        )


def prepared(heads: tuple, transforms: tuple, o: Mapping[str, Any], *, op: str):
    """``(student Prepared, teacher Prepared, DivergenceParams, ignored [N])`` of a call to
    ``op`` with the heads ``(hidden, weight, teacher_hidden, teacher_weight)``, the values
    of both transforms (student's, teacher's; :data:`FIELDS` order) and the op's other
    arguments ``o`` by name (``kind``, ``beta``, ``mask``, ``bias``, ``teacher_bias`` and
    :data:`LINEAR_OPTIONS`)."""
    hidden, weight, teacher_hidden, teacher_weight = heads
    beta = check_kind(o["kind"], o["beta"])
    student_t, teacher_t = (transform_of(values) for values in transforms)
    check_teacher(hidden, teacher_hidden, teacher_weight, o["teacher_bias"])
    codes = row_codes(o["mask"], hidden.shape[:-1], hidden.device, "hidden")
    record = (op, o["kind"], beta, teacher_t.record(), teacher_hidden.shape[-1])
    record += (str(teacher_hidden.dtype), str(teacher_weight.dtype), o["teacher_bias"] is not None)
    common = {name: o[name] for name in LINEAR_OPTIONS}
    common |= {"ignore_index": MASKED, "divergence": record}
    s = prepare(hidden, weight, codes, student_t, bias=o["bias"], **common)
    t = prepare(teacher_hidden, teacher_weight, codes, teacher_t, bias=o["teacher_bias"], **common)
    check_teacher_layout(s, t)
    engine = concrete_backend(o["backend"], s.inputs.device)
    s = chunked(s, o["chunk_size"], engine)
    dp = DivergenceParams(s.params, teacher_t, o["kind"], beta, engine)
    return s, t, dp, s.targets == MASKED


def prepared_logits(logits, teacher_logprobs, transform: Sequence[Any], o: Mapping[str, Any]):
    """``(Prepared, teacher [N, V_local], DivergenceParams, ignored [N])`` of a call to
    ``vocab_parallel_divergence`` (``transform``: the student's values, :data:`FIELDS`
    order; ``o``: its other arguments by name)."""
    kind = o["kind"]
    beta = check_kind(kind, o["beta"])
    student_t = transform_of(transform)
    _checks.check_tensor(logits, "logits")
    _checks.check_tensor(teacher_logprobs, "teacher_logprobs")
    _checks.check_float_dtype(teacher_logprobs, "teacher_logprobs")
    check_constant(teacher_logprobs, "teacher_logprobs")
    if teacher_logprobs.shape != logits.shape or teacher_logprobs.device != logits.device:
        raise ValueError(
            f"teacher_logprobs must have logits' shape {tuple(logits.shape)} and device "
            f"{logits.device}, got {tuple(teacher_logprobs.shape)} on {teacher_logprobs.device}"
        )
    codes = row_codes(o["mask"], logits.shape[:-1], logits.device, "logits")
    names = ("tp_group", "vocab_start", "vocab_size", "chunk_size", "validate")
    prep = prepare(
        logits,
        None,
        codes,
        student_t,
        ignore_index=MASKED,
        deterministic_tile=DETERMINISTIC_TILE,
        divergence=(kind, beta, str(teacher_logprobs.dtype)),
        **{name: o[name] for name in names},
    )
    prep = chunked(prep, o["chunk_size"], "torch")
    dp = DivergenceParams(prep.params, LogitTransform(), kind, beta)
    teacher = teacher_logprobs.reshape(prep.inputs.shape)
    return prep, teacher, dp, prep.targets == MASKED
