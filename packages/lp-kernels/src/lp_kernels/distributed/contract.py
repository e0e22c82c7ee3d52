"""The per-call rank contract: one tiny all-gather of each call's record under ``tp_group``.

Under tensor parallelism every rank must call lp with the same rows, targets and options,
each with its own vocabulary shard. Ranks that disagree would otherwise get a silently
mixed result (different targets or temperatures), or abort or hang inside a collective
whose size follows N (the statistics all-gather, the grad_hidden all-reduce). With
``validate=True`` and a group of more than one rank, :func:`exchange_call_record` runs
before any size-dependent collective::

    each rank:  record = layout key (LAYOUT_FIELDS: shard size, start, vocab_size, H,
                         dtype, deterministic, tile, alignment, weight-problem code)
                       + the call (N, op, flags, the logit transform's fields as
                         float64 bits, ignore_index, requires_grad of each input, whether a
                         bias is passed, grad mode, backend, device type)
                       + its targets, reduced on device: an order-sensitive checksum,
                         the smallest and the largest id that is not ignore_index
                  [len(CALL_FIELDS)] int64, the same size on every rank and every call
    all-gather -> [P, len(CALL_FIELDS)] -> .tolist()   (the call's one host sync)
    every rank checks the same table with the same code, so every rank raises the same
    ValueError, naming the field and the ranks, or the rank with a bad input and what

The checksum is exact integer arithmetic: ``sum_i (t_i mod q) * w_i mod q`` with ``q =
2^31 - 1`` and a weight ``w_i`` in ``[1, q)`` per position (every product fits in int64,
and so does the sum), so it does not depend on how the device reduces the sum, and
reordered targets change it. The target-range check (``validate=True`` without a group)
is folded in: its verdict is taken from the gathered smallest and largest ids, so a call
costs this one collective and one host sync. The table also validates the layout on
every call (:func:`lp_kernels.distributed.layout.check_table`), so a layout changed on
some ranks only is caught too, and the validated layout is cached for ``validate=False``
calls.

``validate=False`` makes no exchange: the caller guarantees that every rank passes the
same N, targets, temperature, ignore_index, flags and ``requires_grad``/grad mode, and
in-range targets, and changes a layout on every rank together. Which ``validate`` a rank
passes cannot itself be checked: pass the same on every rank.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist

from lp_kernels.core.extras import EXTRAS
from lp_kernels.core.transform import LogitTransform
from lp_kernels.distributed.layout import LAYOUT_FIELDS, ShardLayout, cache_layout, check_table

_Q = 2**31 - 1  # a prime: the checksum's modulus
_NO_TARGET = (2**62, -(2**62))  # (smallest, largest) when every target is ignore_index
_BACKENDS = ("auto", "torch", "triton")
_OPS = (
    "linear_logprob",
    "vocab_parallel_logprob",
    "linear_logprob_loss",
    "linear_divergence",
    "vocab_parallel_divergence",
    "linear_topk_divergence",
)
# The logit transform's fields (float64 bits; 0 for None: every field is > 0 when set).
TRANSFORM_FIELDS = tuple(name for name, _ in LogitTransform().record())

# The per-call fields after the layout key, in order, with how a message names each.
_CALL = (
    ("n", "the number of rows N"),
    ("op", "the op"),
    ("chunk_size", "chunk_size (the loss and divergence ops exchange statistics per block)"),
    ("return_entropy", "return_entropy"),
    ("return_lse", "return_lse"),
    ("reduce_grad_hidden", "reduce_grad_hidden"),
    ("extras", "extras"),
    *((name, name) for name in TRANSFORM_FIELDS),
    ("ignore_index", "ignore_index"),
    ("inputs_grad", "whether {inputs} requires grad"),
    ("weight_grad", "whether weight requires grad"),
    ("bias", "whether a bias is passed (and requires grad)"),
    ("grad_enabled", "grad mode (torch.is_grad_enabled())"),
    ("backend", "backend"),
    ("device", "device type"),
    ("divergence", "the divergence's options (kind, beta, the teacher's side)"),
)
_TARGETS = ("targets_checksum", "targets_min", "targets_max")
CALL_FIELDS = LAYOUT_FIELDS + tuple(name for name, _ in _CALL) + _TARGETS
"""Every field of the per-call record, in order (one int64 each)."""


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def targets_summary(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[checksum, smallest, largest]`` int64 on ``targets``' device (no host sync): an
    order-sensitive checksum of ``targets [N]`` and the extreme ids other than
    ``ignore_index`` (``(2^62, -2^62)`` when there are none)."""
    t = targets.reshape(-1).long()
    pos = torch.arange(t.numel(), dtype=torch.int64, device=t.device)
    weight = torch.remainder(pos * 48271, _Q - 1) + 1  # in [1, q): never 0 mod q
    terms = torch.remainder(torch.remainder(t, _Q) * weight, _Q)  # < 2^31 each
    checksum = torch.remainder(terms.sum(), _Q).reshape(1)
    real = t != ignore_index
    lo = torch.where(real, t, _NO_TARGET[0]).amin().reshape(1) if t.numel() else None
    hi = torch.where(real, t, _NO_TARGET[1]).amax().reshape(1) if t.numel() else None
    if lo is None:
        lo = torch.full((1,), _NO_TARGET[0], dtype=torch.int64, device=t.device)
        hi = torch.full((1,), _NO_TARGET[1], dtype=torch.int64, device=t.device)
    return torch.cat([checksum, lo, hi])


def call_fields(
    *,
    n: int,
    linear: bool,
    return_entropy: bool,
    return_lse: bool,
    reduce_grad_hidden: bool,
    transform: LogitTransform,
    ignore_index: int,
    inputs_grad: bool,
    weight_grad: bool,
    backend: str,
    device: torch.device,
    bias: torch.Tensor | None = None,
    loss: bool = False,
    chunk_size: int | None = None,
    extras: tuple[str, ...] = (),
    divergence: tuple = (),
) -> tuple[int, ...]:
    """The host part of the per-call record (the fields of ``_CALL``), as int64 values.
    ``loss``: the call is ``linear_logprob_loss``'s; ``divergence``: a divergence op's
    options (kind, beta, the teacher's side; empty for the other ops), recorded as a
    63-bit digest. Both exchange statistics per block of ``chunk_size`` rows (so it must
    agree; other ops record 0)."""
    op = 2 if loss else 0 if linear else 1
    if divergence:  # an op that names itself first, else a divergence op by its layout
        named = isinstance(divergence[0], str) and divergence[0] in _OPS
        op = _OPS.index(divergence[0]) if named else 3 if linear else 4
    return (
        n,
        op,
        (chunk_size or 0) if loss or divergence else 0,
        int(return_entropy),
        int(return_lse),
        int(reduce_grad_hidden),
        sum(1 << EXTRAS.index(name) for name in extras),
        *(0 if x is None else _float_bits(x) for _, x in transform.record()),
        ignore_index,
        int(inputs_grad),
        int(weight_grad),
        0 if bias is None else 1 + int(bias.requires_grad),
        int(torch.is_grad_enabled()),
        _BACKENDS.index(backend),
        0 if device.type == "cpu" else 1 if device.type == "cuda" else 2,
        _digest(divergence),
    )


def _digest(record: tuple) -> int:
    """A 63-bit digest of a tuple of Python scalars and strings (0 for the empty tuple),
    the same in every process."""
    if not record:
        return 0
    raw = hashlib.blake2b(repr(record).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def _shown(field: str, value: int) -> str:
    if field in TRANSFORM_FIELDS:
        return "None" if value == 0 else repr(_bits_float(value))
    if field == "chunk_size":
        return "None" if value == 0 else str(value)
    if field == "bias":
        return ("no bias", "a bias", "a bias that requires grad")[value]
    if field == "backend":
        return repr(_BACKENDS[value])
    if field == "op":
        return _OPS[value]
    if field == "device":
        return ("cpu", "cuda", "other")[value]
    if field in ("inputs_grad", "weight_grad", "grad_enabled") or field.startswith("return_"):
        return str(bool(value))
    if field == "extras":
        return repr(tuple(name for j, name in enumerate(EXTRAS) if value >> j & 1))
    if field == "reduce_grad_hidden":
        return str(bool(value))
    if field == "divergence":
        return "none" if value == 0 else f"digest {value:#x}"
    if field == "targets_checksum":
        return f"{value:#010x}"
    return str(value)


def check_call_table(rows: list[tuple[int, ...]], rank: int, *, inputs: str) -> ShardLayout:
    """Check the gathered per-call records (every rank runs this on the same rows) and
    return the validated layout. ``inputs``: how messages name the first input."""
    n_layout = len(LAYOUT_FIELDS)
    layout = check_table([r[:n_layout] for r in rows], rank)
    recs = [dict(zip(CALL_FIELDS, r, strict=True)) for r in rows]

    def values(field: str) -> str:
        return ", ".join(f"rank {i}: {_shown(field, r[field])}" for i, r in enumerate(recs))

    for field, what in _CALL:
        if len({r[field] for r in recs}) > 1:
            raise ValueError(
                f"tensor-parallel ranks disagree on {what.format(inputs=inputs)} in this "
                f"call ({values(field)}); every rank of tp_group must make the same call "
                "with its own vocabulary shard"
            )
    vocab_size, ignore_index = layout.vocab_size, recs[0]["ignore_index"]
    bad = [
        i
        for i, r in enumerate(recs)
        if r["targets_min"] <= r["targets_max"]
        and (r["targets_min"] < 0 or r["targets_max"] >= vocab_size)
    ]
    if bad:
        detail = "; ".join(
            f"rank {i}: smallest {recs[i]['targets_min']}, largest {recs[i]['targets_max']}"
            for i in bad
        )
        raise ValueError(
            f"targets outside [0, {vocab_size}) and not ignore_index={ignore_index} on "
            f"rank(s) {bad} ({detail})"
        )
    if len({r["targets_checksum"] for r in recs}) > 1:
        raise ValueError(
            "tensor-parallel ranks disagree on the targets in this call (an order-sensitive "
            f"checksum of their values: {values('targets_checksum')}); every rank of "
            "tp_group must pass the same targets (and the same hidden rows)"
        )
    return layout


def exchange_call_record(
    group: Any,
    *,
    key: tuple[int, ...],
    fields: tuple[int, ...],
    targets: torch.Tensor,
    ignore_index: int,
    device: torch.device,
    inputs: str,
    hint: str | None = None,
) -> ShardLayout:
    """All-gather this call's record over ``group`` and check it on every rank.

    Args:
        group: the ``tp_group`` (more than one rank).
        key: this rank's layout record (``layout.layout_key``).
        fields: the host part of the call's record (:func:`call_fields`).
        targets: ``[N]`` target ids (reduced on device by :func:`targets_summary`).
        ignore_index: the call's ``ignore_index``.
        device: where the record is exchanged (the inputs' device).
        inputs: how messages name the first input (``"hidden"`` or ``"logits"``).
        hint: appended to every error message (a caller that knows a likely cause, e.g.
            a data-parallel shard passed as a vocabulary shard, says so here).

    Returns:
        The validated layout (also cached for later ``validate=False`` calls).

    Raises:
        ValueError: on every rank alike, naming the field and the ranks that differ, or
            the rank with a bad input and what is wrong with it.
    """
    host = torch.tensor(key + fields, dtype=torch.int64, device=device)
    mine = torch.cat([host, targets_summary(targets, ignore_index).to(device)])
    world = dist.get_world_size(group)
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, mine, group=group)
    rows = [tuple(r) for r in table.view(world, mine.numel()).tolist()]  # the host sync
    try:
        layout = check_call_table(rows, dist.get_rank(group), inputs=inputs)
    except ValueError as exc:
        if hint:
            raise ValueError(f"{exc}. {hint}") from None
        raise
    cache_layout(group, key, layout)
    return layout
