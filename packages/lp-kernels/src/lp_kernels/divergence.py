"""lp's distillation ops: an exact full-vocabulary divergence between a student's and a
teacher's next-token distributions, without materialized ``[N, V]`` logits.

- :func:`linear_divergence` from both heads' hidden states and LM-head weights (shards);
- :func:`vocab_parallel_divergence` from the student's logits and the teacher's log-probs;
- :func:`linear_divergence_loss`: a weighted sum of the divergence with its gradients
  finished in the forward (four GEMMs per step instead of six).
- :func:`linear_topk_divergence` from the student's head and a teacher's top-k payload
  (ids and log-probs; its machinery in :mod:`lp_kernels.topk_divergence`).

Each builds the two :class:`~lp_kernels.core.transform.LogitTransform`, prepares the
arguments through the one preparation path of the other ops (``lp_kernels._prepare``:
checks, autocast, the tensor-parallel layout, the per-call rank record, which carries the
divergence's own options), and runs the backend (:mod:`lp_kernels.backends.divergence`: the
host loop; its engines in ``backends.torch.divergence`` and ``backends.triton.divergence``).
The formulas are in :mod:`lp_kernels.core.divergence`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lp_kernels import _checks
from lp_kernels import topk_divergence as topk
from lp_kernels._prepare import Prepared, prepare
from lp_kernels.backends.divergence import (
    LinearDivergence,
    LinearDivergenceLoss,
    VocabParallelDivergence,
)
from lp_kernels.backends.divergence_tiles import LinearDivergenceDeterministic
from lp_kernels.backends.resolve import concrete_backend
from lp_kernels.core import amp
from lp_kernels.core.chunks import default_chunk_rows
from lp_kernels.core.compile import eager_under_compile
from lp_kernels.core.divergence import DivergenceParams, check_kind
from lp_kernels.core.tiles import DETERMINISTIC_TILE
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import DivergenceLossOutput, DivergenceOutput, TopkDivergenceOutput

_MASKED = -1
"""The row code of a masked row (the other rows' code is 0): the ops pass ``mask`` to the
preparation path as targets with this ``ignore_index``, so that ranks disagreeing on the
mask raise like ranks disagreeing on targets."""

_BUFFERS = {"torch": 4, "triton": 1}
"""How many times fewer rows than ``linear_logprob``'s torch chunk (one fp32 ``[C, V_local]``
buffer of 1 GiB on CUDA) a divergence chunk takes. torch: both sides' softmax arguments and
the terms of their sums, about eight such buffers of a quarter of the rows; triton: both
heads' GEMM outputs and ``d l``, three buffers of the whole rows (about 3 GiB at a 152k
vocabulary), so that the gradient GEMMs see chunks of about a thousand rows."""


def _check_constant(x: Any, name: str) -> None:
    """A teacher tensor must not require grad: its gradient would be silently dropped."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        raise ValueError(
            f"{name} requires grad, but the teacher is a constant of the divergence (no "
            f"gradient reaches it): pass {name}.detach(), or compute it under torch.no_grad()"
        )


def _row_codes(mask: Any, lead: torch.Size, device: torch.device, first: str) -> torch.Tensor:
    """``[*]`` int64: 0 for the rows to compute, :data:`_MASKED` for the others."""
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
    return torch.where(mask, 0, _MASKED)


def _chunked(prep: Prepared, chunk_size: Any, backend: str) -> Prepared:
    """``prep`` with the divergence's default chunk unless ``chunk_size`` was given: from
    the widest shard, the same on every rank (each chunk makes collectives), or with
    ``deterministic`` from the tile, the same on every layout."""
    if chunk_size is not None:
        return prep
    p = prep.params
    width = p.deterministic_tile if p.deterministic else p.max_v_local
    budget = default_chunk_rows(width, prep.inputs.device)
    rows = max(16, budget // _BUFFERS[backend])
    return prep._replace(params=dataclasses.replace(p, chunk_size=rows))


def _check_teacher_layout(student: Prepared, teacher: Prepared) -> None:
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


@eager_under_compile
def linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: int | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> DivergenceOutput:
    """The divergence between a student's and a teacher's next-token distributions per row,
    over the whole vocabulary, without materializing either ``[N, V]`` logits.

    With ``p = softmax(z_s)`` and ``q = softmax(z_t)``, each side's ``z`` its raw logits
    ``h W^T + b`` through its own transform (``logit_scale``, ``softcap``, temperature; as
    :func:`lp_kernels.linear_logprob`) over the real vocabulary:

    ============== ====================================================================
    ``forward_kl`` ``KL(q || p) = sum q (log q - log p)``
    ``reverse_kl`` ``KL(p || q) = sum p (log p - log q)``
    ``jsd``        ``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = beta q + (1 - beta) p``
    ============== ====================================================================

    (``jsd`` is TRL's and Liger's generalized Jensen-Shannon divergence.) The teacher is a
    constant; the divergence is differentiable into ``hidden``, ``weight`` and ``bias`` with
    any per-row upstream gradient. All statistics and sums are fp32; gradients come back in
    the input dtypes, the logits gradient rounded once to the GEMM dtype as in
    ``linear_logprob``. Bitwise reproducible run to run.

    Args:
        hidden: ``[*, H]`` the student's last hidden states (float32, bfloat16, float16).
        weight: ``[V_local, H]`` the student's LM head, or its vocabulary shard under
            ``tp_group`` (a DTensor as for ``linear_logprob``).
        teacher_hidden: ``[*, H_t]`` the teacher's last hidden states for the same rows
            (``H_t`` may differ from ``H``); must not require grad.
        teacher_weight: ``[V_local, H_t]`` the teacher's LM head: the student's vocabulary
            rows (the same shard under ``tp_group``); must not require grad.
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: the ``jsd`` mixture weight of the teacher, in ``(0, 1)`` (unused otherwise).
        temperature: the student's softmax temperature (> 0).
        teacher_temperature: the teacher's; None: ``temperature``.
        mask: None or bool ``[*]``: rows where it is False give 0 in every output and no
            gradient (their hidden states may be anything, NaN included).
        bias, softcap, logit_scale: the student's logit transform, as for
            ``linear_logprob``.
        teacher_bias, teacher_softcap, teacher_logit_scale: the teacher's (a bias must
            not require grad).
        tp_group, vocab_start, vocab_size, reduce_grad_hidden, validate: as for
            ``linear_logprob``; both heads are sharded alike. The per-call rank record also
            carries ``kind``, ``beta``, the teacher's transform, width and dtype, the mask
            (as the targets are) and ``chunk_size``.
        deterministic, deterministic_tile: tensor-parallel invariance, as for
            ``linear_logprob``: outputs and gradients bitwise identical for any TP degree
            and any layout whose shard bounds are multiples of 128, on both backends (the
            same backend and ``chunk_size`` on each layout; the default chunk is). It
            computes on global vocabulary tiles and takes the logits twice in the forward.
        backend: ``"torch"`` (chunked torch ops, every device), ``"triton"`` (cuBLAS
            GEMMs of both heads, then Triton kernels for the transforms, statistics and
            ``d l``; CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"auto"``: triton on
            CUDA devices of compute capability >= 8.0, else torch.
        chunk_size: rows per chunk (a memory knob: a chunk holds a few fp32 ``[C,
            V_local]`` buffers). None: a default from the widest shard, the device and the
            backend.
            Under ``tp_group`` every rank must pass the same (each chunk exchanges its
            rows' statistics).

    Returns:
        ``DivergenceOutput(divergence, student_entropy, teacher_entropy)``, each ``[*]``
        float32, the same on every rank; the entropies are detached.

    Raises:
        TypeError, ValueError: as ``linear_logprob``, and: a teacher tensor that requires
            grad, a ``teacher_hidden`` of another leading shape, a ``teacher_weight`` with
            other vocabulary rows, a bad ``kind``, ``beta`` or ``mask``.
        RuntimeError: a second derivative (lp's ops are differentiable once).

    Example:
        >>> import torch
        >>> from lp_kernels import linear_divergence
        >>> hidden = torch.randn(3, 5, 32, requires_grad=True)
        >>> weight = torch.randn(1000, 32, requires_grad=True)
        >>> teacher_hidden, teacher_weight = torch.randn(3, 5, 64), torch.randn(1000, 64)
        >>> out = linear_divergence(hidden, weight, teacher_hidden, teacher_weight)
        >>> out.divergence.mean().backward()
        >>> out.divergence.shape, bool((out.divergence >= 0).all())
        (torch.Size([3, 5]), True)
    """
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    s, t, dp, ignored = _prepared(heads, locals(), op="linear_divergence")
    function = LinearDivergenceDeterministic if s.params.deterministic else LinearDivergence
    with amp.autocast_off(s.inputs.device):  # lp's precision policy is its own
        out = function.apply(s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias, ignored, dp)
    return DivergenceOutput(*(x.view(s.lead) for x in out))


@eager_under_compile
def linear_divergence_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: int | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> DivergenceLossOutput:
    """``sum_n weights[n] D_n`` of :func:`linear_divergence`'s per-row divergence ``D``, with
    its gradients finished in the forward.

    Each chunk's logits are computed once: its statistics, its divergence and its logits
    gradient for the rows' weights come from them, then the two gradient GEMMs. A step
    costs four GEMMs where ``linear_divergence`` and ``backward()`` cost six; the gradients
    (fp32 ``grad_weight`` accumulator included) are held from the forward to the backward,
    which scales them by the loss's upstream gradient.

    Args:
        hidden, weight, teacher_hidden, teacher_weight, kind, beta, temperature,
            teacher_temperature, mask, bias, teacher_bias, softcap, teacher_softcap,
            logit_scale, teacher_logit_scale, tp_group, vocab_start, vocab_size,
            reduce_grad_hidden, deterministic_tile, backend, chunk_size, validate: as for
            :func:`linear_divergence`.
        weights: None (every row 1: the sum) or a float tensor of the rows' leading shape,
            constant (no grad), the same on every rank under ``tp_group``: the token mean
            over a mask is ``mask / mask.sum()``, a gradient-accumulation mean ``mask /
            num_items_in_batch`` (:func:`lp_kernels.losses.distill_loss` reduces the same
            way after the unfused op).
        deterministic: as for ``linear_divergence``; this mode takes the composed path (the
            op with ``deterministic=True``, then the weighted sum through autograd), six
            GEMMs.

    Returns:
        ``DivergenceLossOutput(loss, divergence, student_entropy, teacher_entropy)``:
        ``loss`` a differentiable fp32 scalar, the others ``[*]`` fp32 without gradient.

    Raises:
        TypeError, ValueError: as ``linear_divergence``; ``weights`` not a float tensor of
            the rows' shape on their device, or one that requires grad.
        RuntimeError: a second backward through one call (``retain_graph=True``).
    """
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    w = _row_weights(weights, hidden)
    if deterministic:
        out = linear_divergence(*heads, **_op_arguments(locals()))
        loss = (out.divergence * w.view(out.divergence.shape)).sum()
        return DivergenceLossOutput(loss, *(x.detach() for x in out))
    s, t, dp, ignored = _prepared(heads, locals(), op="linear_divergence_loss")
    with amp.autocast_off(s.inputs.device):
        loss, *rows = LinearDivergenceLoss.apply(
            s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias, ignored, w.reshape(-1), dp
        )
    return DivergenceLossOutput(loss, *(x.view(s.lead) for x in rows))


def _op_arguments(o: dict) -> dict:
    """``linear_divergence``'s keyword arguments from ``linear_divergence_loss``'s locals."""
    skip = {"hidden", "weight", "teacher_hidden", "teacher_weight", "weights", "heads", "w"}
    return {k: v for k, v in o.items() if k not in skip}


def _row_weights(weights: Any, hidden: torch.Tensor) -> torch.Tensor:
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


def _transforms(o: dict) -> tuple[LogitTransform, LogitTransform]:
    """The student's and the teacher's logit transforms from the op's arguments."""
    student = LogitTransform.checked(
        temperature=o["temperature"], softcap=o["softcap"], logit_scale=o["logit_scale"]
    )
    t_temperature = (
        o["temperature"] if o["teacher_temperature"] is None else o["teacher_temperature"]
    )
    teacher = LogitTransform.checked(
        temperature=t_temperature,
        softcap=o["teacher_softcap"],
        logit_scale=o["teacher_logit_scale"],
    )
    return student, teacher


def _check_teacher(hidden, teacher_hidden, teacher_weight, teacher_bias) -> None:
    for x, name in ((teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
        _checks.check_tensor(x, name)
        _check_constant(x, name)
    _check_constant(teacher_bias, "teacher_bias")
    _checks.check_tensor(hidden, "hidden")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got shape {tuple(teacher_hidden.shape)}"
        )


def _prepared(heads: tuple, o: dict, *, op: str):
    """``(student Prepared, teacher Prepared, DivergenceParams, ignored [N])`` of a call to
    ``op`` with the heads ``(hidden, weight, teacher_hidden, teacher_weight)`` and the op's
    other arguments ``o`` (its ``locals()``)."""
    hidden, weight, teacher_hidden, teacher_weight = heads
    beta = check_kind(o["kind"], o["beta"])
    student_t, teacher_t = _transforms(o)
    _check_teacher(hidden, teacher_hidden, teacher_weight, o["teacher_bias"])
    codes = _row_codes(o["mask"], hidden.shape[:-1], hidden.device, "hidden")
    record = (op, o["kind"], beta, teacher_t.record(), teacher_hidden.shape[-1])
    record += (str(teacher_hidden.dtype), str(teacher_weight.dtype), o["teacher_bias"] is not None)
    names = ("tp_group", "vocab_start", "vocab_size", "reduce_grad_hidden", "deterministic")
    names += ("deterministic_tile", "backend", "chunk_size", "validate")
    common = {name: o[name] for name in names}
    common |= {"ignore_index": _MASKED, "divergence": record}
    s = prepare(hidden, weight, codes, student_t, bias=o["bias"], **common)
    t = prepare(teacher_hidden, teacher_weight, codes, teacher_t, bias=o["teacher_bias"], **common)
    _check_teacher_layout(s, t)
    engine = concrete_backend(o["backend"], s.inputs.device)
    s = _chunked(s, o["chunk_size"], engine)
    dp = DivergenceParams(s.params, teacher_t, o["kind"], beta, engine)
    return s, t, dp, s.targets == _MASKED


@eager_under_compile
def vocab_parallel_divergence(
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
) -> DivergenceOutput:
    """:func:`linear_divergence` for a student that holds its logits and a teacher that
    ships log-probs (a teacher server, a cached teacher pass).

    The teacher's distribution is ``q = softmax(teacher_logprobs)`` over the real
    vocabulary: log-probs are taken as logits and renormalized, so normalized log-probs
    give themselves, and a top-k payload scattered into ``-inf`` elsewhere gives the
    renormalized top-k distribution (its ``-inf`` entries have ``q = 0``: ``forward_kl``
    and ``jsd`` stay finite; ``reverse_kl`` is ``+inf`` wherever the student puts mass
    there). ``temperature``, ``softcap`` and ``logit_scale`` apply to the student's logits
    only. The divergence is differentiable into ``logits`` (fp32 math, the gradient in
    ``logits``' dtype, zero on padding columns and masked rows).

    Args:
        logits: ``[*, V_local]`` the student's logits (or this rank's vocabulary shard).
        teacher_logprobs: ``[*, V_local]`` float tensor of the same shape and device, the
            same shard; must not require grad.
        kind, beta, temperature, mask, softcap, logit_scale, tp_group, vocab_start,
            vocab_size, chunk_size, validate: as for :func:`linear_divergence`.

    Returns:
        ``DivergenceOutput(divergence, student_entropy, teacher_entropy)`` ``[*]`` float32.
    """
    beta = check_kind(kind, beta)
    transform = LogitTransform.checked(
        temperature=temperature, softcap=softcap, logit_scale=logit_scale
    )
    _checks.check_tensor(logits, "logits")
    _checks.check_tensor(teacher_logprobs, "teacher_logprobs")
    _checks.check_float_dtype(teacher_logprobs, "teacher_logprobs")
    _check_constant(teacher_logprobs, "teacher_logprobs")
    if teacher_logprobs.shape != logits.shape or teacher_logprobs.device != logits.device:
        raise ValueError(
            f"teacher_logprobs must have logits' shape {tuple(logits.shape)} and device "
            f"{logits.device}, got {tuple(teacher_logprobs.shape)} on {teacher_logprobs.device}"
        )
    codes = _row_codes(mask, logits.shape[:-1], logits.device, "logits")
    prep = prepare(
        logits,
        None,
        codes,
        transform,
        ignore_index=_MASKED,
        tp_group=tp_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        deterministic_tile=DETERMINISTIC_TILE,
        chunk_size=chunk_size,
        validate=validate,
        divergence=(kind, beta, str(teacher_logprobs.dtype)),
    )
    prep = _chunked(prep, chunk_size, "torch")
    dp = DivergenceParams(prep.params, LogitTransform(), kind, beta)
    teacher = teacher_logprobs.reshape(prep.inputs.shape)
    with amp.autocast_off(prep.inputs.device):
        out = VocabParallelDivergence.apply(prep.inputs, teacher, prep.targets == _MASKED, dp)
    return DivergenceOutput(*(x.view(prep.lead) for x in out))


@eager_under_compile
def linear_topk_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    kind: str = "forward_kl",
    tail: str = "renormalize",
    beta: float = 0.5,
    outside_logprob: float = -100.0,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    temperature: float = 1.0,
    tp_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_grad_hidden: bool = True,
    deterministic: bool = False,
    deterministic_tile: int | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> TopkDivergenceOutput:
    """A divergence between a student head and a teacher's top-k payload (ids and log-probs,
    as a sampler or a teacher server returns them), per row, without ``[N, V]`` logits.

    With ``S`` a row's ``k`` ids, ``z`` the student's softmax arguments (``h W^T + b``
    through ``logit_scale``, ``softcap`` and ``temperature``, as :func:`linear_logprob`),
    ``lp = z - lse(z)`` its full-vocabulary log-probs and ``lq`` the teacher's log-probs
    at ``S``, ``tail`` picks the two distributions ``s`` (student) and ``t`` (teacher):

    =============== ==================================================================
    ``renormalize`` over ``S``: ``ls = z - lse_S(z)``, ``lt = lq - lse_S(lq)`` (NeMo-RL
                    ``zero_outside_topk=False``; SDPO without its tail). No vocabulary
                    pass: the cost is the ``N k H`` gather.
    ``bucket``      over ``S`` and one tail bucket on each side: ``(lp, log(1 - sum_S
                    e^lp))``, ``(lq, log(1 - sum_S e^lq))``, each log top-k mass clamped
                    at ``log(1 - 2^-24)`` (SDPO's ``distillation_add_tail``).
    ``none``        over ``S``, unnormalized: ``ls = lp``, ``lt = lq`` (verl's
                    ``*_kl_topk`` without its ``log 1e-8`` clamp and its clamp at 0: the
                    sums may be negative).
    ``truncate``    the teacher renormalized over ``S`` and 0 outside, ``lt = lq -
                    lse_S(lq)``; the student's whole distribution (NeMo-RL
                    ``zero_outside_topk=True``): the terms outside ``S`` are added exactly
                    from ``P_out = 1 - sum_S p`` and the entropy ``E`` of ``p``.
    =============== ==================================================================

    and ``kind`` the divergence (``s = e^ls``, ``t = e^lt``; sums over the buckets; a term
    whose weight is 0 is 0, so ``-inf`` teacher log-probs drop out of the teacher's terms,
    while their ids stay in ``S`` for the student's renormalization and tail):

    ============== ===================================================================
    ``forward_kl`` ``sum t (lt - ls)``
    ``reverse_kl`` ``sum s (ls - lt)``; ``truncate`` adds ``sum_out p (lp - c) = -E -
                   sum_S p lp - c P_out`` with ``c = outside_logprob`` (NeMo-RL's
                   ``log_infinitesimal``, -100: the exact value is ``+inf``)
    ``jsd``        ``beta sum t (lt - lm) + (1 - beta) sum s (ls - lm)``, ``lm = log(beta
                   t + (1 - beta) s)`` (``linear_divergence``'s, verl's and SDPO's
                   ``beta``); ``truncate`` adds ``-(1 - beta) log(1 - beta) P_out``, exact
    ``mixed_kl``   ``beta forward_kl + (1 - beta) reverse_kl`` (NeMo-RL's ``mixed``,
                   ``beta = mixed_kl_weight``)
    ============== ===================================================================

    The teacher is a constant. The divergence is differentiable into ``hidden``, ``weight``
    and ``bias``: through ``lse`` (and ``E``) by :func:`linear_logprob`'s exact full-vocabulary
    gradient, through the gathered ``z`` by the gather's. All of it in fp32.

    Args:
        hidden: ``[*, H]`` the student's last hidden states (float32, bfloat16, float16).
        weight: ``[V_local, H]`` the student's LM head or its vocabulary shard under
            ``tp_group`` (a DTensor as for ``linear_logprob``).
        teacher_ids: ``[*, k]`` int64 (or int32) global vocabulary ids, ``k >= 1``, distinct
            within a row, in ``[0, vocab_size)`` (checked with ``validate``; masked rows'
            ids are not read). The same on every rank.
        teacher_logprobs: ``[*, k]`` float log-probs of those ids (taken in fp32; ``-inf``
            allowed, NaN and ``+inf`` refused with ``validate``); must not require grad.
        kind: ``"forward_kl"``, ``"reverse_kl"``, ``"jsd"`` or ``"mixed_kl"``.
        tail: ``"renormalize"``, ``"bucket"``, ``"none"`` or ``"truncate"``.
        beta: ``jsd``'s teacher weight in ``(0, 1)``; ``mixed_kl``'s forward weight in
            ``[0, 1]``; unused otherwise.
        outside_logprob: ``c`` of ``tail="truncate"`` with ``reverse_kl`` / ``mixed_kl``
            (finite, <= 0).
        mask: None or bool ``[*]``: rows where it is False give 0 in every output and no
            gradient (their hidden states, ids and log-probs may be anything).
        bias, softcap, logit_scale, temperature: the student's logit transform, as for
            :func:`linear_logprob`.
        tp_group, vocab_start, vocab_size, reduce_grad_hidden, validate: as for
            ``linear_logprob``. Each rank gathers the ids it owns (one all-reduce of
            ``[N, k]`` fp32). With ``validate`` the per-call rank record carries ``kind``,
            ``tail``, ``beta``, ``k`` and each row's extreme ids (as targets): ids out of
            range, a repeated id and ranks that disagree raise on every rank.
        deterministic, deterministic_tile: outputs and gradients bitwise identical for
            any TP degree and any layout whose shard bounds are multiples of 128, as for
            ``linear_logprob`` (the gather's gradients are summed in int64 fixed point).
        backend, chunk_size: ``linear_logprob``'s, for the log-sum-exp pass (unused by
            ``tail="renormalize"``); the gather is torch ops.

    Returns:
        ``TopkDivergenceOutput(divergence, student_mass, teacher_mass)``, ``[*]`` float32
        each, the same on every rank: the divergence (differentiable), ``sum_S p`` (None for
        ``renormalize``) and ``sum_S e^lq`` (detached).

    Raises:
        TypeError, ValueError: as ``linear_logprob``, and naming the argument: a teacher
            tensor that requires grad or of another shape or device, ids out of range or
            repeated, a bad ``kind``, ``tail``, ``beta``, ``outside_logprob`` or ``mask``.

    Example:
        >>> import torch
        >>> from lp_kernels import linear_topk_divergence
        >>> hidden = torch.randn(3, 5, 32, requires_grad=True)
        >>> weight = torch.randn(1000, 32, requires_grad=True)
        >>> ids = torch.randperm(1000)[:60].view(3, 5, 4)
        >>> logprobs = torch.randn(3, 5, 4).log_softmax(-1) - 0.1
        >>> out = linear_topk_divergence(hidden, weight, ids, logprobs, tail="bucket")
        >>> out.divergence.mean().backward()
        >>> out.divergence.shape, hidden.grad.shape
        (torch.Size([3, 5]), torch.Size([3, 5, 32]))
    """
    o = topk.check_options(kind, beta, tail, outside_logprob)
    transform = LogitTransform.checked(
        temperature=temperature, softcap=softcap, logit_scale=logit_scale
    )
    args = {
        "mask": mask,
        "bias": bias,
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
    return topk.topk_divergence(hidden, weight, teacher_ids, teacher_logprobs, transform, o, args)
