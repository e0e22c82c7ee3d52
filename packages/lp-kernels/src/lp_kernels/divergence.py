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
The formulas are in :mod:`lp_kernels.core.divergence`. Under ``torch.compile`` the first
three are the custom ops of :mod:`lp_kernels.library_divergence` (the same preparation,
``lp_kernels._prepare_divergence``, and host functions); ``linear_topk_divergence``, made of
``linear_logprob``'s backend, torch ops and a gather Function, runs behind a graph break.
"""

from __future__ import annotations

from typing import Any

import torch

from lp_kernels import library, library_divergence
from lp_kernels import topk_divergence as topk
from lp_kernels._prepare_divergence import prepared, prepared_logits, row_weights
from lp_kernels.backends.divergence import (
    LinearDivergence,
    LinearDivergenceLoss,
    VocabParallelDivergence,
)
from lp_kernels.backends.divergence_tiles import LinearDivergenceDeterministic
from lp_kernels.core import amp
from lp_kernels.core.compile import eager_under_compile
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import DivergenceLossOutput, DivergenceOutput, TopkDivergenceOutput


def _tensors(*xs: Any) -> bool:
    """Every argument is a plain tensor (``library.plain`` and not None)."""
    return all(x is not None for x in xs) and library.plain(*xs)


def _traced_arguments(heads: tuple, mask, bias, teacher_bias, tp_group, o: dict):
    """``(tensors, options)`` of ``library_divergence``'s ops for a linear divergence op's
    arguments, or None for arguments they do not carry (DTensors, options of other types,
    a teacher tensor that requires grad: the eager op behind a graph break raises)."""
    hidden, weight, teacher_hidden, teacher_weight = heads
    if not _tensors(*heads) or not library.plain(mask, bias, teacher_bias):
        return None
    if any(x is not None and x.requires_grad for x in (*heads[2:], teacher_bias)):
        return None
    args = library_divergence.op_options(_transform_values(o), tp_group, o)
    tensors = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask)
    return None if args is None else (tensors, args)


def _traced_linear_divergence(
    hidden, weight, teacher_hidden, teacher_weight, *, mask, bias, teacher_bias, tp_group, **o
):
    """``linear_divergence`` under ``torch.compile``: the ``lp::linear_divergence`` custom op
    (:mod:`lp_kernels.library_divergence`), or ``NotImplemented`` (:func:`_traced_arguments`)."""
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    traced = _traced_arguments(heads, mask, bias, teacher_bias, tp_group, o)
    return NotImplemented if traced is None else library_divergence.linear_divergence(*traced)


def _traced_linear_divergence_loss(
    hidden, weight, teacher_hidden, teacher_weight, *, weights, mask, bias, teacher_bias, **o
):
    """``linear_divergence_loss`` under ``torch.compile``: ``lp::linear_divergence_loss``, or
    ``NotImplemented`` (as :func:`_traced_linear_divergence`; also for ``deterministic=True``,
    whose composed path runs eagerly, and row weights that require grad)."""
    if o["deterministic"] is not False or not library.plain(weights):
        return NotImplemented
    if weights is not None and weights.requires_grad:
        return NotImplemented
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    traced = _traced_arguments(heads, mask, bias, teacher_bias, o.pop("tp_group"), o)
    if traced is None:
        return NotImplemented
    return library_divergence.linear_divergence_loss(traced[0], weights, traced[1])


def _traced_vocab_parallel_divergence(
    logits, teacher_logprobs, *, mask, temperature, softcap, logit_scale, tp_group, **o
):
    """``vocab_parallel_divergence`` under ``torch.compile``: its custom op, or
    ``NotImplemented`` (as :func:`_traced_linear_divergence`)."""
    if not _tensors(logits, teacher_logprobs) or not library.plain(mask):
        return NotImplemented
    if teacher_logprobs.requires_grad:
        return NotImplemented
    o |= {"reduce_grad_hidden": True, "deterministic": False, "deterministic_tile": None}
    transforms = ((temperature, softcap, logit_scale), (1.0, None, None))
    args = library_divergence.op_options(transforms, tp_group, o | {"backend": "torch"})
    if args is None:
        return NotImplemented
    return library_divergence.vocab_parallel_divergence(logits, teacher_logprobs, mask, args)


@eager_under_compile(traced=_traced_linear_divergence)
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
    ``linear_logprob``. Bitwise reproducible run to run. Under ``torch.compile`` it is the
    custom op ``lp::linear_divergence`` (:mod:`lp_kernels.library_divergence`), forward and
    backward, with eager mode's bits; a DTensor weight or a teacher tensor that requires
    grad makes a graph break (the eager op, which raises its error).

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
    o = locals()
    s, t, dp, ignored = prepared(heads, _transform_values(o), o, op="linear_divergence")
    function = LinearDivergenceDeterministic if s.params.deterministic else LinearDivergence
    with amp.autocast_off(s.inputs.device):  # lp's precision policy is its own
        out = function.apply(s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias, ignored, dp)
    return DivergenceOutput(*(x.view(s.lead) for x in out))


@eager_under_compile(traced=_traced_linear_divergence_loss)
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
    which scales them by the loss's upstream gradient. Under ``torch.compile`` it is the
    custom op ``lp::linear_divergence_loss`` (its gradients are outputs, scaled out of place
    by ``lp::linear_divergence_loss_backward``), with eager mode's bits; ``deterministic=True``
    runs eagerly behind a graph break.

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
        RuntimeError: a second backward through one call (``retain_graph=True``; eager
            mode only: compiled, the op's gradient outputs are scaled again).
    """
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    w = row_weights(weights, hidden)
    if deterministic:
        out = linear_divergence(*heads, **_op_arguments(locals()))
        loss = (out.divergence * w.view(out.divergence.shape)).sum()
        return DivergenceLossOutput(loss, *(x.detach() for x in out))
    o = locals()
    s, t, dp, ignored = prepared(heads, _transform_values(o), o, op="linear_divergence_loss")
    with amp.autocast_off(s.inputs.device):
        loss, *rows = LinearDivergenceLoss.apply(
            s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias, ignored, w.reshape(-1), dp
        )
    return DivergenceLossOutput(loss, *(x.view(s.lead) for x in rows))


def _op_arguments(o: dict) -> dict:
    """``linear_divergence``'s keyword arguments from ``linear_divergence_loss``'s locals."""
    skip = {"hidden", "weight", "teacher_hidden", "teacher_weight", "weights", "heads", "w"}
    return {k: v for k, v in o.items() if k not in skip}


def _transform_values(o: dict) -> tuple[tuple, tuple]:
    """The values of the student's and the teacher's logit transforms (``LogitTransform``'s
    fields, in order) from the op's arguments."""
    t_temperature = (
        o["temperature"] if o["teacher_temperature"] is None else o["teacher_temperature"]
    )
    student = (o["temperature"], o["softcap"], o["logit_scale"])
    return student, (t_temperature, o["teacher_softcap"], o["teacher_logit_scale"])


@eager_under_compile(traced=_traced_vocab_parallel_divergence)
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
    ``logits``' dtype, zero on padding columns and masked rows). Under ``torch.compile`` it is
    the custom op ``lp::vocab_parallel_divergence``, with eager mode's bits (as
    :func:`linear_divergence`).

    Args:
        logits: ``[*, V_local]`` the student's logits (or this rank's vocabulary shard).
        teacher_logprobs: ``[*, V_local]`` float tensor of the same shape and device, the
            same shard; must not require grad.
        kind, beta, temperature, mask, softcap, logit_scale, tp_group, vocab_start,
            vocab_size, chunk_size, validate: as for :func:`linear_divergence`.

    Returns:
        ``DivergenceOutput(divergence, student_entropy, teacher_entropy)`` ``[*]`` float32.
    """
    prep, teacher, dp, ignored = prepared_logits(
        logits, teacher_logprobs, (temperature, softcap, logit_scale), locals()
    )
    with amp.autocast_off(prep.inputs.device):
        out = VocabParallelDivergence.apply(prep.inputs, teacher, ignored, dp)
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
