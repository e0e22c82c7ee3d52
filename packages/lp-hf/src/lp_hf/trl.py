"""lp as the kernel of TRL's fused LM head: ``use_lp(trainer)``.

TRL 1.16's trainers (GRPO, RLOO, DPO, KTO, SFT, async GRPO) never ask the model for
``[B, T, V]`` logits in training. Each one calls ``trl.trainer.utils.add_fused_lm_head`` on
its causal LM (and on its reference model), which binds a per-model ``forward``; a training
forward is ``model(..., labels=... | shift_labels=..., fused_lm_head=True)`` and returns a
``FusedCausalLMOutput``. Data flow of one such call, with lp in place::

    trainer: model(input_ids, attention_mask, labels | shift_labels, num_items_in_batch,
                   fused_lm_head=True)
      TRL's fused forward (TRL's own code object, unchanged):
        backbone -> hidden [B, T, H];  labels shifted ([:, 1:]) unless shift_labels
        mask = labels != -100;  FSDP2 DTensor head -> full tensor;  fp32 cast if asked
        kernel(hidden rows [M, H], weight [V, H], bias [V] | None, targets [M],
               temperature, TRL's vocabulary tile, softcap, logit_scale, outputs)
          = LpKernel.apply -> lp_kernels.linear_logprob(...)    <- the only change
        fields scattered back to [B, T'] (0 / False where masked), label_mask,
        loss = -sum(log_probs) / (num_items_in_batch or mask count), MoE aux_loss
      -> FusedCausalLMOutput

The seam. TRL's fused forward looks its kernel up by a module-level name
(``_ChunkedLogProbFunction`` of ``trl.trainer.utils``) at each call. Rebinding that name
would switch every model of the process, trainer or not, with no per-trainer options, and
leave global state behind. Subclassing the trainers' private log-prob methods would follow
their many parameters trainer by trainer. Instead ``use_lp`` rebuilds each model's fused
forward from TRL's own code object, closure and defaults, with a namespace in which that
name is an :class:`LpKernel` for this model, and binds it on the model in place of TRL's.
So the whole output contract (shapes, dtypes, shift conventions, ``label_mask``, the loss
reduction with ``num_items_in_batch``, the MoE ``aux_loss``, the FSDP2 gather, multimodal
inputs) stays TRL's own code, and lp answers exactly the kernel's narrow contract, checked
at each call. TRL's module is untouched; other models keep TRL's kernel. A forward without
``fused_lm_head=True`` (generation, a plain ``model(...)``) runs TRL's unfused branch, the
model's original forward: lp acts in the training forward only.

A trainer prepares its reference model at construction: under mixed precision accelerate
wraps the fused forward in its autocast forward (keeping ``_original_forward``). ``use_lp``
rebuilds that wrapper around lp's forward with accelerate's own helpers and the trainer's
accelerator settings (``train()`` wraps the policy model the same way). Any other wrapper is
refused. Call ``use_lp`` once, before ``train()``.

What is refused, with an error naming it: a TRL outside 1.16.x; a trainer without a fused
head; ``add_fused_lm_head`` not as lp-hf read it; a wrapped fused forward other than
accelerate's mixed-precision one; ``use_lp`` twice; a model whose final-logit softcap or scale
as TRL reads it differs from what the model's forward applies (:mod:`lp_hf.final_logits`);
a per-token field TRL asks for that lp-hf does not know (lp computes ``log_sum_sq_probs``,
``mean_logits`` and ``is_top1`` with ``linear_logprob(extras=...)``); DeepSpeed ZeRO-3,
whose partitioned head TRL's kernel re-gathers in its backward and lp's does not.

The fused loss (``use_lp(trainer, fused_loss=True)``, GRPOTrainer only). TRL computes its
loss from the head's log-probs: the head's forward, then TRL's loss, then a backward that
recomputes the logits (four GEMMs). With ``fused_loss`` the loss is computed in the head
pass by ``lp_kernels.linear_logprob_loss``, its gradients finished there (three GEMMs)::

    trainer.compute_loss -> GrpoFusedLoss (bound as trainer._compute_loss)
      per-token loss (GrpoTokenLoss: PolicyLoss's clipped surrogate, k3 KL) and its
        inputs [B, Tc]: advantages, old / ref log-probs, vLLM IS ratio, weights that
        realize the loss_type's reduction and the gradient-accumulation scale
      kernel.loss_pass(request): trainer._get_per_token_logps_and_entropies(...)
        -> TRL's fused forward -> LpKernel.loss: linear_logprob_loss on the head's rows
           (rows outside the loss mask ignored); log-probs and entropy come back with no
           gradient (the log-probs tied to the loss with weight 0: the model's outputs)
      loss (+ MoE aux loss, + 0 x the log-probs: FSDP2's backward hooks on the model's
        outputs run); TRL's metrics from the log-probs and entropy

The seam is the trainer's private ``_compute_loss``, replaced on this trainer only by an
instance attribute. ``use_lp`` checks that ``compute_loss`` calls it and that it names what
TRL 1.16.0's names (a digest of its identifiers: a TRL whose loss reads another option is
refused), then refuses each option whose loss is not elementwise in the head pass's outputs
or not mapped (:func:`check_grpo_options`, again at each call).

``DistillationTrainer`` has no fused head: its loss, ``_compute_loss``, runs both backbones
and calls the module-level ``_chunked_divergence_loss`` of ``trl.trainer.distillation_trainer``
(the FSDP2 gather, the mask, the reduction with ``num_items_in_batch``), which calls
``ChunkedDivergenceFunction.apply`` on the rows: ``(per-token divergence, student entropy)``.
``use_lp`` rebuilds both functions from TRL's code objects with a namespace in which that
name is an :class:`LpDivergenceKernel` (lp_kernels.linear_divergence, the teacher a
constant) and binds the rebuilt ``_compute_loss`` on this trainer only. TRL's beta maps to
lp's kind: 0.0 ``forward_kl``, 1.0 ``reverse_kl``, else ``jsd`` with that beta. Refused
besides: a subclass that overrides ``compute_loss`` or ``_compute_loss``
(``ServerDistillationTrainer``); seams not as lp-hf read them; a student or teacher softcap
or scale that TRL reads differently from the model's forward (checked at each call).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lp_hf.adapters import LossPasses, check_parameters, code_digest
from lp_hf.final_logits import FinalLogitTransform, model_logit_transform
from lp_kernels import LossOutput, linear_divergence, linear_logprob, linear_logprob_loss
from lp_kernels.losses import PolicyLoss, kl_k3, token_weights

__all__ = [
    "DIVERGENCE_ARGS",
    "EXTRAS",
    "FIELDS",
    "GRPO_LOSS_TYPES",
    "SUPPORTED_TRL",
    "GrpoFusedLoss",
    "GrpoTokenLoss",
    "LossRequest",
    "LpDivergenceKernel",
    "LpKernel",
    "TrlOptions",
    "check_grpo_options",
    "divergence_kind",
    "grpo_policy_loss",
    "grpo_weights",
    "use_lp",
]

SUPPORTED_TRL = "1.16"
"""The TRL release series whose fused head this module has read (``1.16.x``)."""
_KERNEL_NAME = "_ChunkedLogProbFunction"  # what TRL's fused forward calls, by global name
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's ``FusedCausalLMOutput`` that its fused kernel computes."""
EXTRAS = {
    "log_sum_sq_probs": "log_sum_sq_probs",
    "mean_logits": "mean_logit",
    "is_top1": "is_top1",
}
"""TRL's detached per-token fields -> the ``extras=`` name of lp_kernels.linear_logprob."""
_CLOSURE = ("final_logit_softcapping", "logit_scale", "outputs", "temperature")
"""What ``add_fused_lm_head`` captured that ``use_lp`` checks before the first call."""
_MARK = "_lp_hf_trl_kernel"
_DISTILL_MODULE = "trl.trainer.distillation_trainer"
_DIVERGENCE_NAME = "ChunkedDivergenceFunction"  # what TRL's distillation loss calls
_LOSS_NAME = "_chunked_divergence_loss"  # what DistillationTrainer._compute_loss calls
_LOSS_ARGS = (
    "student_hidden_states",
    "teacher_hidden_states",
    "student_lm_head_weight",
    "teacher_lm_head_weight",
    "completion_mask",
    "beta",
    "num_items_in_batch",
    "student_lm_head_bias",
    "teacher_lm_head_bias",
    "student_logit_scale",
    "teacher_logit_scale",
    "student_final_logit_softcapping",
    "teacher_final_logit_softcapping",
    "temperature",
)
"""The parameters of TRL's ``_chunked_divergence_loss`` that lp-hf read."""
DIVERGENCE_ARGS = (
    "student_hidden",
    "student_weight",
    "student_bias",
    "teacher_hidden",
    "teacher_weight",
    "teacher_bias",
    "beta",
    "temperature",
    "student_logit_scale",
    "student_final_logit_softcapping",
    "teacher_logit_scale",
    "teacher_final_logit_softcapping",
)
"""The arguments of TRL's ``ChunkedDivergenceFunction.apply`` (after ``ctx``), in order."""
Backend = Literal["auto", "torch", "triton"]
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""The ``loss_type`` values of TRL's GRPOTrainer that ``use_lp(fused_loss=True)`` computes."""
_GRPO_MODULE = "trl.trainer.grpo_trainer"
_GRPO_LOSS_DIGEST = "74daf26e3f97ec0f"
"""The first 16 hex digits of the sha256 of the identifiers (attributes, options, loss types,
keywords) that TRL 1.16.0's ``GRPOTrainer._compute_loss`` names, sorted and space-joined: a
TRL whose loss reads another option or branch gives another digest."""
_LOGPS_ARGS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)
"""The leading parameters of ``GRPOTrainer._get_per_token_logps_and_entropies``; the others
are model inputs that ``_compute_loss`` passes as ``inputs.get(name)``."""


@dataclass(frozen=True)
class TrlOptions:
    """lp's options for TRL's fused head (keyword arguments of :func:`use_lp`).

    Example:
        >>> TrlOptions(deterministic=True).backend
        'auto'
    """

    deterministic: bool = False
    """lp's tensor-parallel-invariant mode (``linear_logprob(deterministic=True)``)."""
    backend: Backend = "auto"
    """lp_kernels backend: ``"auto"``, ``"torch"`` or ``"triton"``."""
    chunk_size: int | None = None
    """Token rows per step of lp's torch backend; None = its default."""
    validate: bool = True
    """Check the target ids against the vocabulary (one host sync per call)."""

    def __post_init__(self) -> None:
        for name in ("deterministic", "validate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {self.backend!r}")
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"chunk_size must be None or a positive int, got {size!r}")


def _check_transform(
    where: str,
    what: str,
    transform: FinalLogitTransform,
    softcap: float | None,
    logit_scale: float | None,
) -> None:
    """Raise unless the ``softcap`` and ``logit_scale`` TRL's ``what`` applies are the
    model's own (``transform``, from :mod:`lp_hf.final_logits`)."""
    mine = (transform.softcap, transform.logit_scale or 1.0)
    theirs = (softcap, 1.0 if logit_scale is None else logit_scale)
    if mine != theirs:
        raise ValueError(
            f"{where}: TRL's {what} applies softcap={theirs[0]!r}, "
            f"logit_scale={theirs[1]!r}, but the model's forward applies "
            f"softcap={mine[0]!r}, logit_scale={mine[1]!r} (lp_hf.final_logits); lp "
            "does not pick one of two answers: fix the config or use TRL's own head"
        )


def _missing_extras(outputs: tuple[str, ...], where: str) -> None:
    """Raise when ``outputs`` asks for a field that the installed lp_kernels cannot give."""
    unknown = [name for name in outputs if name not in FIELDS]
    if unknown:
        raise NotImplementedError(
            f"{where}: TRL asks its fused head for {unknown}, which lp-hf does not know "
            f"(it knows {list(FIELDS)})"
        )


@dataclass
class LossRequest:
    """The loss of one pass of the policy's fused head (``use_lp(fused_loss=True)``).

    :class:`GrpoFusedLoss` sets it on the policy's :class:`LpKernel` around the forward; the
    kernel then computes ``linear_logprob_loss(..., loss_fn, per_token=...)`` on the rows
    that TRL's head scores and keeps the result in ``output``. Per-token tensors are
    ``[B, Tc]`` over the completion columns of inputs of ``seq_len`` columns.

    Attributes:
        loss_fn: the per-token loss.
        per_token: its keyword tensors, each ``[B, Tc]`` (or broadcastable to it).
        completion_ids: ``[B, Tc]`` the sampled tokens (the head's targets).
        completion_mask: ``[B, Tc]`` the completion columns of the attention mask: the
            positions TRL's head selects when it scores only labelled rows.
        loss_mask: ``[B, Tc]`` the tokens whose loss counts; the others are ignored rows.
        seq_len: prompt plus completion columns.
        output: the result, once the head has run.
    """

    loss_fn: Callable[..., torch.Tensor]
    per_token: dict[str, torch.Tensor]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    seq_len: int
    output: LossOutput | None = field(default=None)


def _row_layout(
    request: LossRequest, rows: int, where: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[B, Tc] -> [rows]``: the rows of TRL's kernel call for per-token values. TRL's head
    passes either every position of the shifted ``[B, seq_len - 1]`` labels (row-major) or
    only the labelled ones, the completion tokens (``completion_mask``); when both counts
    agree the two layouts are the same rows."""
    batch, width = request.completion_mask.shape
    prompt = request.seq_len - 1 - width
    if rows == batch * (request.seq_len - 1):

        def every(x: torch.Tensor) -> torch.Tensor:
            x = x.expand(batch, width)
            return torch.cat([x.new_zeros(batch, prompt), x], 1).reshape(-1)

        return every
    labelled = request.completion_mask.bool()
    if rows != int(labelled.sum()):
        raise RuntimeError(
            f"{where}: TRL's fused head passed {rows} rows, neither every position "
            f"({batch * (request.seq_len - 1)}) nor the completion tokens; TRL changed"
        )
    return lambda x: x.expand(batch, width)[labelled]


class LpKernel(LossPasses):
    """What one model's fused forward calls in place of TRL's chunked kernel.

    ``apply`` has the kernel's contract: rows ``hidden [M, H]`` with ``targets [M]`` (no
    ignored rows: TRL selects or clamps them), the head ``weight [V, H]`` and ``bias [V]``,
    and returns ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each
    ``[M]`` (fp32; ``is_top1`` bool) or None when not in ``outputs``. The softcap and scale
    TRL passes must be the model's (``transform``), else the call raises.

    Attributes:
        transform: the model's final-logit transform, from :mod:`lp_hf.final_logits`.
        options: :class:`TrlOptions`.
        name: the model's class name, for messages.
    """

    def __init__(self, transform: FinalLogitTransform, options: TrlOptions, name: str) -> None:
        self.transform = transform
        self.options = options
        self.name = name
        self.request: LossRequest | None = None

    def check(self, softcap: float | None, logit_scale: float | None) -> None:
        """Raise unless TRL's ``softcap`` and ``logit_scale`` are the model's own."""
        _check_transform(self.name, "fused head", self.transform, softcap, logit_scale)

    def apply(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None,
        logit_scale: float,
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        """lp's answer to one call of TRL's kernel (arguments as TRL passes them)."""
        del chunk_size  # TRL's vocabulary tile width; lp tiles by its own rules
        _zero3_refused(self.name)
        self.check(final_logit_softcapping, logit_scale)
        _missing_extras(tuple(outputs), self.name)
        if self.request is not None:
            return self.loss(hidden, weight, bias, targets, temperature, tuple(outputs))
        extras = tuple(EXTRAS[name] for name in FIELDS[2:] if name in outputs)
        opts = self.options
        out = linear_logprob(
            hidden,
            weight,
            targets,
            bias=bias,
            temperature=temperature,
            softcap=self.transform.softcap,
            logit_scale=self.transform.logit_scale,
            return_entropy="entropy" in outputs,
            deterministic=opts.deterministic,
            backend=opts.backend,
            chunk_size=opts.chunk_size,
            validate=opts.validate,
            extras=extras,
        )
        fields = [getattr(out, EXTRAS[name]) if name in outputs else None for name in FIELDS[2:]]
        return (out.logprob, out.entropy, *fields)

    def loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        outputs: tuple[str, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        """:meth:`apply` within :meth:`loss_pass`: ``linear_logprob_loss`` on the rows, the
        rows outside ``request.loss_mask`` ignored; the result goes to ``request.output``
        and the kernel returns its ``log_probs`` and ``entropy`` (0 on ignored rows), which
        carry no gradient: the log-probs are ``logprob + 0.0 * loss``, the same values tied
        to the loss's graph so that the model's outputs carry it (FSDP2's backward hooks)."""
        request = self.request
        if request.output is not None:
            raise RuntimeError(f"{self.name}: the fused head ran twice in one loss pass")
        if set(outputs) - {"log_probs", "entropy"}:
            raise NotImplementedError(
                f"{self.name}: the fused loss gives log_probs and entropy, TRL asks {outputs}"
            )
        to_rows = _row_layout(request, targets.shape[0], self.name)
        keep = to_rows(request.loss_mask.to(targets.device) != 0)
        opts = self.options
        if opts.validate:
            ids = to_rows(request.completion_ids.to(targets.device))
            if not torch.equal(targets[keep], ids[keep]):
                raise RuntimeError(
                    f"{self.name}: TRL's fused head passed targets that are not the "
                    "completion tokens in the order lp-hf read; TRL changed"
                )
        per_token = {k: to_rows(v.to(targets.device)) for k, v in request.per_token.items()}
        request.output = linear_logprob_loss(
            hidden,
            weight,
            targets.masked_fill(~keep, -100),
            request.loss_fn,
            per_token=per_token,
            return_entropy="entropy" in outputs,
            bias=bias,
            temperature=temperature,
            softcap=self.transform.softcap,
            logit_scale=self.transform.logit_scale,
            deterministic=opts.deterministic,
            backend=opts.backend,
            chunk_size=opts.chunk_size,
            validate=opts.validate,
        )
        out = request.output
        # the log-probs carry the loss's graph with weight 0 (the same values, no gradient
        # added): they become the model's outputs, on which FSDP2 hooks its backward
        tied = out.logprob + 0.0 * out.loss
        return (tied, out.entropy if "entropy" in outputs else None, None, None, None)


def divergence_kind(beta: float) -> tuple[str, float]:
    """lp's ``(kind, beta)`` for the ``beta`` of TRL's DistillationTrainer: 0.0 the forward
    KL(teacher || student), 1.0 the reverse KL(student || teacher), else the generalized
    JSD whose mixture is ``(1 - beta) p_student + beta p_teacher``.

    Example:
        >>> divergence_kind(0.0), divergence_kind(0.25)
        (('forward_kl', 0.5), ('jsd', 0.25))
    """
    number = isinstance(beta, (int, float)) and not isinstance(beta, bool)
    if not (number and 0.0 <= beta <= 1.0):
        raise ValueError(f"TRL's distillation beta must be a float in [0, 1], got {beta!r}")
    if beta == 0.0:
        return "forward_kl", 0.5
    if beta == 1.0:
        return "reverse_kl", 0.5
    return "jsd", float(beta)


class LpDivergenceKernel:
    """What one DistillationTrainer's loss calls in place of TRL's ``ChunkedDivergenceFunction``.

    ``apply`` has that kernel's contract (:data:`DIVERGENCE_ARGS`): the student's rows
    ``[N, H_s]`` and head, the teacher's rows ``[N, H_t]`` and head (the same vocabulary),
    TRL's beta, the temperature of both sides and each side's scale and softcap; it returns
    ``(divergence, student_entropy)``, each ``[N]`` fp32, the divergence differentiable into
    the student only (the teacher is a constant, as in TRL). The scales and softcaps TRL
    passes must be the models' own (``student``, ``teacher``), else the call raises.

    Attributes:
        student, teacher: each model's final-logit transform (:mod:`lp_hf.final_logits`).
        options: :class:`TrlOptions`.
        name: the trainer's class name, for messages.
    """

    def __init__(
        self,
        student: FinalLogitTransform,
        teacher: FinalLogitTransform,
        options: TrlOptions,
        name: str,
    ) -> None:
        self.student = student
        self.teacher = teacher
        self.options = options
        self.name = name

    def apply(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        student_bias: torch.Tensor | None,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        teacher_bias: torch.Tensor | None,
        beta: float,
        temperature: float = 1.0,
        student_logit_scale: float = 1.0,
        student_final_logit_softcapping: float | None = None,
        teacher_logit_scale: float = 1.0,
        teacher_final_logit_softcapping: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """lp's answer to one call of TRL's divergence kernel (arguments as TRL passes them)."""
        _zero3_refused(self.name)
        what = "distillation loss"
        _check_transform(
            f"{self.name} (student)",
            what,
            self.student,
            student_final_logit_softcapping,
            student_logit_scale,
        )
        _check_transform(
            f"{self.name} (teacher)",
            what,
            self.teacher,
            teacher_final_logit_softcapping,
            teacher_logit_scale,
        )
        kind, lp_beta = divergence_kind(beta)
        opts = self.options
        out = linear_divergence(
            student_hidden,
            student_weight,
            teacher_hidden.detach(),
            teacher_weight.detach(),
            kind=kind,
            beta=lp_beta,
            temperature=temperature,
            bias=student_bias,
            teacher_bias=None if teacher_bias is None else teacher_bias.detach(),
            softcap=self.student.softcap,
            logit_scale=self.student.logit_scale,
            teacher_softcap=self.teacher.softcap,
            teacher_logit_scale=self.teacher.logit_scale,
            deterministic=opts.deterministic,
            backend=opts.backend,
            chunk_size=opts.chunk_size,
            validate=opts.validate,
        )
        return out.divergence, out.student_entropy


def _zero3_refused(where: str) -> None:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise NotImplementedError(
            f"{where}: DeepSpeed ZeRO-3 partitions the LM head, and TRL's kernel re-gathers it "
            "in its backward, which lp's does not; use_lp does not support ZeRO-3"
        )


def _trl_utils() -> types.ModuleType:
    """``trl.trainer.utils``, after checking that TRL's version is one lp-hf has read."""
    trl = importlib.import_module("trl")
    version = str(getattr(trl, "__version__", "unknown"))
    parts = version.split(".")
    if parts[:2] != SUPPORTED_TRL.split(".") or len(parts) < 3:
        raise RuntimeError(
            f"lp_hf.trl supports TRL {SUPPORTED_TRL}.x (its fused LM head was read from that "
            f"series), but TRL {version} is installed; pin trl>={SUPPORTED_TRL},<1.17"
        )
    return importlib.import_module("trl.trainer.utils")


def _fused_code(utils: types.ModuleType) -> types.CodeType:
    """The code object of the forward that ``add_fused_lm_head`` binds on a model."""
    maker = getattr(utils, "add_fused_lm_head", None)
    codes = [
        const
        for const in getattr(getattr(maker, "__code__", None), "co_consts", ())
        if isinstance(const, types.CodeType) and _KERNEL_NAME in const.co_names
    ]
    if len(codes) != 1 or not set(_CLOSURE) <= set(codes[0].co_freevars):
        raise RuntimeError(
            "trl.trainer.utils.add_fused_lm_head is not the one lp-hf has read (one nested "
            f"forward calling {_KERNEL_NAME}, capturing {list(_CLOSURE)}); TRL changed"
        )
    return codes[0]


def _trl_function(forward: Any, code: types.CodeType) -> tuple[str, Any]:
    """How ``forward`` (a module's instance ``forward``) relates to TRL's fused forward:
    ``("trl", fn)`` it is one, ``("lp", fn)`` ``use_lp`` already rebuilt it, ``("wrapped",
    fn)`` another forward wraps one, ``("", None)`` none."""
    fn = getattr(forward, "__func__", forward)
    if getattr(fn, "__code__", None) is code:
        return ("lp" if hasattr(fn, _MARK) else "trl"), fn
    for _ in range(16):  # accelerate's AMP forward: wrappers chained through __wrapped__
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
        if getattr(fn, "__code__", None) is code:
            return ("lp" if hasattr(fn, _MARK) else "wrapped"), fn
    return "", None


def _fused_heads(
    trainer: Any, code: types.CodeType
) -> list[tuple[str, torch.nn.Module, Any, bool]]:
    """``(where, module, TRL's fused forward function, wrapped by accelerate's AMP forward)``
    for each model of the trainer that carries TRL's fused head; raises for one that
    cannot be rebuilt."""
    roots = [("model", getattr(trainer, "model", None))]
    roots.append(("ref_model", getattr(trainer, "ref_model", None)))
    if not isinstance(roots[0][1], torch.nn.Module):
        raise TypeError(
            f"use_lp expects a TRL trainer (with a .model torch.nn.Module), got "
            f"{type(trainer).__name__}"
        )
    found, seen = [], set()
    for attr, root in roots:
        if not isinstance(root, torch.nn.Module):
            continue
        for path, module in root.named_modules():
            state, fn = _trl_function(module.__dict__.get("forward"), code)
            if not state or id(module) in seen:
                continue
            seen.add(id(module))
            where = f"trainer.{attr}{'.' + path if path else ''} ({type(module).__name__})"
            if state == "lp":
                raise RuntimeError(f"{where}: use_lp was already applied to this model")
            if state == "wrapped":
                _check_amp_wrapper(where, module, fn, trainer)
            found.append((where, module, fn, state == "wrapped"))
    if not found:
        raise ValueError(
            f"{type(trainer).__name__} has no TRL fused LM head on trainer.model or "
            "trainer.ref_model: use_lp replaces the head that trl.trainer.utils."
            "add_fused_lm_head adds (GRPO, RLOO, DPO, KTO, SFT, async GRPO in TRL "
            f"{SUPPORTED_TRL}); without one, lp would not be used"
        )
    return found


def _check_amp_wrapper(where: str, module: torch.nn.Module, fn: Any, trainer: Any) -> None:
    """Raise unless ``module``'s forward is accelerate's mixed-precision forward around
    TRL's ``fn``, as ``Accelerator.prepare_model`` leaves it (``_original_forward`` kept)."""
    original = module.__dict__.get("_original_forward")
    accelerator = getattr(trainer, "accelerator", None)
    if (
        getattr(original, "__func__", None) is fn
        and getattr(original, "__self__", None) is module
        and getattr(accelerator, "native_amp", False)
    ):
        return
    raise RuntimeError(
        f"{where}: its fused forward is wrapped by another forward that is not accelerate's "
        "mixed-precision forward of trainer.accelerator; use_lp rebuilds only TRL's forward "
        "or that wrapper around it (call use_lp before train())"
    )


def _kernel_for(where: str, module: torch.nn.Module, fn: Any, options: TrlOptions) -> LpKernel:
    """The :class:`LpKernel` of one model, after checking what TRL captured for it."""
    captured = dict(
        zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True)
    )
    _missing_extras(tuple(captured["outputs"]), where)
    temperature = captured["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{where}: TRL's fused head has temperature={temperature!r}")
    kernel = LpKernel(model_logit_transform(module), options, where)
    kernel.check(captured["final_logit_softcapping"], captured["logit_scale"])
    return kernel


def _rebuild(module: torch.nn.Module, fn: Any, kernel: LpKernel, amp: Any) -> None:
    """Bind on ``module`` TRL's fused forward ``fn`` rebuilt with ``kernel`` as its kernel;
    ``amp``: None, or the accelerator whose mixed-precision forward wrapped ``fn``."""
    namespace = dict(fn.__globals__)  # a copy: TRL's module keeps its own kernel
    namespace[_KERNEL_NAME] = kernel
    # name, docstring and __wrapped__: generate() checks its kwargs against the signature
    rebuilt = _copy_function(fn, namespace)
    setattr(rebuilt, _MARK, kernel)
    module.forward = types.MethodType(rebuilt, module)
    if amp is None:
        return
    # the wrapper Accelerator.prepare_model put around TRL's forward, put around lp's,
    # with accelerate's own helpers and this accelerator's autocast settings
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(amp.native_amp, amp.autocast_handler)
    module._original_forward = module.forward
    module.forward = types.MethodType(convert_outputs_to_fp32(autocast(rebuilt)), module)


def _copy_function(fn: Any, namespace: dict[str, Any]) -> types.FunctionType:
    """``fn`` rebuilt from its code object, closure and defaults with ``namespace`` as its
    globals (name, docstring and ``__wrapped__`` kept)."""
    code, name = fn.__code__, fn.__name__
    rebuilt = types.FunctionType(code, namespace, name, fn.__defaults__, fn.__closure__)
    rebuilt.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    functools.update_wrapper(rebuilt, fn)
    return rebuilt


def _distillation_class(trainer: Any) -> type | None:
    """TRL's ``DistillationTrainer`` when ``trainer`` is one, else None (without importing
    TRL's module: a trainer can be one only once it is imported)."""
    module = sys.modules.get(_DISTILL_MODULE)
    cls = getattr(module, "DistillationTrainer", None)
    return cls if isinstance(cls, type) and isinstance(trainer, cls) else None


def _distillation_seam(cls: type) -> tuple[Any, Any]:
    """``(DistillationTrainer._compute_loss, _chunked_divergence_loss)``, after checking
    that they and ``ChunkedDivergenceFunction`` are as lp-hf read them in TRL 1.16."""
    module = sys.modules[cls.__module__]
    loss = getattr(module, _LOSS_NAME, None)
    compute = cls.__dict__.get("_compute_loss")
    kernel = getattr(module, _DIVERGENCE_NAME, None)
    where = f"{_DISTILL_MODULE}."
    check_parameters("lp_hf.trl", where + _LOSS_NAME, loss, _LOSS_ARGS)
    forward = getattr(kernel, "forward", None)
    what = f"{where}{_DIVERGENCE_NAME}.forward"
    check_parameters("lp_hf.trl", what, forward, ("ctx", *DIVERGENCE_ARGS))
    for fn, name, calls in (
        (loss, _LOSS_NAME, _DIVERGENCE_NAME),
        (compute, "DistillationTrainer._compute_loss", _LOSS_NAME),
    ):
        code = getattr(fn, "__code__", None)
        if (
            not isinstance(fn, types.FunctionType)
            or calls not in code.co_names
            or fn.__globals__ is not module.__dict__
        ):
            raise RuntimeError(
                f"{where}{name} is not the one lp-hf has read (a function of that module "
                f"calling {calls} by its global name); TRL changed"
            )
    return compute, loss


def _check_distillation_trainer(trainer: Any, cls: type) -> None:
    """Raise unless ``trainer`` runs DistillationTrainer's own loss, once, with a teacher."""
    name = type(trainer).__name__
    for method in ("compute_loss", "_compute_loss"):
        if getattr(type(trainer), method, None) is not getattr(cls, method):
            raise TypeError(
                f"{name} overrides DistillationTrainer.{method}; lp_hf.trl reproduces "
                "DistillationTrainer's own loss only (ServerDistillationTrainer is not covered)"
            )
    current = trainer.__dict__.get("_compute_loss")
    if current is not None:
        if hasattr(getattr(current, "__func__", None), _MARK):
            raise RuntimeError(f"{name}: use_lp was already applied to this trainer")
        raise RuntimeError(f"{name}: _compute_loss is already replaced by an instance attribute")
    if not isinstance(getattr(trainer, "teacher_model", None), torch.nn.Module):
        raise ValueError(
            f"{name} has no teacher_model module: use_lp replaces the divergence between "
            "its student's and its teacher's LM heads"
        )


def _use_lp_distillation(trainer: Any, cls: type, options: TrlOptions) -> Any:
    """:func:`use_lp` for a TRL ``DistillationTrainer`` (see the module docstring)."""
    name = type(trainer).__name__
    _zero3_refused(name)
    compute, loss = _distillation_seam(cls)
    _check_distillation_trainer(trainer, cls)
    unwrap = trainer.accelerator.unwrap_model
    student = model_logit_transform(unwrap(trainer.model))
    teacher = model_logit_transform(unwrap(trainer.teacher_model))
    kernel = LpDivergenceKernel(student, teacher, options, name)
    # one copy of TRL's module namespace for both functions: TRL's module keeps its own
    namespace = dict(loss.__globals__)
    namespace[_DIVERGENCE_NAME] = kernel
    namespace[_LOSS_NAME] = _copy_function(loss, namespace)
    rebuilt = _copy_function(compute, namespace)
    setattr(rebuilt, _MARK, kernel)
    trainer._compute_loss = types.MethodType(rebuilt, trainer)
    return trainer


def check_grpo_options(trainer: Any) -> None:
    """Raise ``ValueError`` naming each option of a GRPOTrainer whose loss
    ``use_lp(fused_loss=True)`` does not reproduce exactly (see :func:`use_lp`)."""
    args = trainer.args
    eps_low, eps_high, delta = trainer.epsilon_low, trainer.epsilon_high, args.delta
    refused = []
    if trainer.loss_type not in GRPO_LOSS_TYPES:
        refused.append(f"loss_type={trainer.loss_type!r} (covered: {', '.join(GRPO_LOSS_TYPES)})")
    if trainer.importance_sampling_level != "token":
        refused.append(f"importance_sampling_level={trainer.importance_sampling_level!r}")
    if trainer.top_entropy_quantile < 1.0:
        refused.append(f"top_entropy_quantile={trainer.top_entropy_quantile!r}")
    if trainer.off_policy_mask_threshold is not None:
        refused.append(f"off_policy_mask_threshold={trainer.off_policy_mask_threshold!r}")
    if trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy:
        refused.append("an entropy bonus (entropy_coef != 0 or use_adaptive_entropy)")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        refused.append(
            f"epsilon={eps_low!r}, epsilon_high={eps_high!r} (need 0 <= epsilon < 1, "
            "epsilon_high >= 0)"
        )
    if delta is not None and not delta > 1.0 + eps_high:
        refused.append(f"delta={delta!r} (need delta > 1 + epsilon_high)")
    if refused:
        raise ValueError(
            f"{type(trainer).__name__}: use_lp(fused_loss=True) does not reproduce TRL's loss "
            f"with {'; '.join(refused)}; use fused_loss=False (TRL's loss on lp's log-probs)"
        )


@dataclass(frozen=True)
class GrpoTokenLoss:
    """GRPOTrainer's per-token loss, a ``loss_fn`` of ``linear_logprob_loss``:

    ``weights * (surrogate * is_ratio + kl_coef * k3 * (r if kl_ratio else 1))``

    with ``surrogate`` :class:`lp_kernels.losses.PolicyLoss`'s clipped surrogate (its KL
    off), ``k3`` :func:`lp_kernels.losses.kl_k3` unclamped, ``r = exp(logprob -
    old_logprob)`` (``old_logprob`` None: ``logprob.detach()``), ``is_ratio`` vLLM's
    importance-sampling ratio (None: 1). Its derivatives come in closed form
    (:meth:`value_and_grad`), equal to autograd's through ``__call__`` up to rounding.

    Example:
        >>> fn = GrpoTokenLoss(PolicyLoss(max_log_ratio=None), kl_coef=0.04, kl_ratio=True)
        >>> lp = torch.tensor([-1.0, -2.0])
        >>> fn(lp, None, None, advantages=torch.ones(2), weights=torch.ones(2),
        ...    ref_logprob=lp).tolist()
        [-1.0, -1.0]
    """

    surrogate: PolicyLoss
    """The clipped surrogate (``kl_coef`` 0)."""
    kl_coef: float = 0.0
    """TRL's ``beta``: the coefficient of k3 against ``ref_logprob``."""
    kl_ratio: bool = False
    """TRL's ``use_bias_correction_kl``: the KL term times the (differentiable) ratio ``r``."""
    needs_entropy = False

    def __call__(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        lse: torch.Tensor | None,
        *,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        old_logprob: torch.Tensor | None = None,
        ref_logprob: torch.Tensor | None = None,
        is_ratio: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss ``[n]`` (arguments ``[n]``, as :class:`PolicyLoss` takes them)."""
        loss = self.surrogate(logprob, entropy, lse, old_logprob=old_logprob, advantages=advantages)
        if is_ratio is not None:
            loss = loss * is_ratio
        if self.kl_coef != 0.0:
            kl = kl_k3(logprob, ref_logprob, max_log_ratio=None, max_kl=None)
            if self.kl_ratio:
                old = logprob.detach() if old_logprob is None else old_logprob
                kl = kl * torch.exp(logprob - old)
            loss = loss + self.kl_coef * kl
        return weights * loss

    def value_and_grad(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        lse: torch.Tensor | None,
        *,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        old_logprob: torch.Tensor | None = None,
        ref_logprob: torch.Tensor | None = None,
        is_ratio: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """``(loss, (d loss / d logprob, None, None))`` per row in closed form, as
        ``linear_logprob_loss`` takes it: the surrogate's from
        :meth:`PolicyLoss.value_and_grad`, k3's ``-expm1(ref_logprob - logprob)``, and
        with ``kl_ratio`` the product rule (``d r / d logprob = r``)."""
        loss, (grad, _, _) = self.surrogate.value_and_grad(
            logprob, entropy, lse, old_logprob=old_logprob, advantages=advantages
        )
        with torch.no_grad():
            if is_ratio is not None:
                loss, grad = loss * is_ratio, grad * is_ratio
            if self.kl_coef != 0.0:
                kl = kl_k3(logprob, ref_logprob, max_log_ratio=None, max_kl=None)
                slope = -torch.expm1(ref_logprob - logprob)
                if self.kl_ratio:
                    old = logprob if old_logprob is None else old_logprob
                    ratio = torch.exp(logprob - old)
                    kl, slope = kl * ratio, ratio * (slope + kl)
                loss = loss + self.kl_coef * kl
                grad = grad + self.kl_coef * slope
            return weights * loss, (weights * grad, None, None)


def grpo_policy_loss(trainer: Any) -> GrpoTokenLoss:
    """The per-token loss of a GRPOTrainer: the clipped surrogate (``epsilon``,
    ``epsilon_high``; ``delta`` as the dual clip; no log-ratio clamp, as TRL's) plus
    ``beta`` times k3, times the ratio under ``use_bias_correction_kl``."""
    surrogate = PolicyLoss(
        clip_low=trainer.epsilon_low,
        clip_high=trainer.epsilon_high,
        dual_clip=trainer.args.delta,
        max_log_ratio=None,
    )
    kl_ratio = bool(trainer.args.use_bias_correction_kl)
    return GrpoTokenLoss(surrogate, kl_coef=float(trainer.beta), kl_ratio=kl_ratio)


def grpo_weights(trainer: Any, mask: torch.Tensor, inputs: dict, mode: str) -> torch.Tensor:
    """``[B, Tc]`` fp32 per-token weights whose sum against the per-token losses is the
    reduction of the trainer's ``loss_type``, gradient accumulation included ("train")."""
    loss_type = trainer.loss_type
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if loss_type == "dapo":  # num_items_in_batch counts the generation batch on every rank
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            items = items * accumulation / trainer.args.steps_per_generation
        return (mask != 0).float() / items
    rows = mask.shape[0]  # TRL's seq-means divide by every row, empty ones included
    if loss_type == "grpo":
        weights = token_weights(mask, "seq-mean-token-mean", global_sequences=rows)
    elif loss_type == "bnpo":
        weights = token_weights(mask, "token-mean")
    else:  # dr_grpo
        norm = {"max_tokens": trainer.max_completion_length, "global_sequences": rows}
        weights = token_weights(mask, "seq-mean-token-sum-norm", **norm)
    return weights / accumulation


class GrpoFusedLoss:
    """GRPOTrainer's ``_compute_loss`` with the loss computed in the policy's head pass.

    It builds the per-token loss (:func:`grpo_policy_loss`), its inputs and weights
    (:func:`grpo_weights`, times vLLM's importance-sampling ratio when TRL applies it), runs
    the trainer's own ``_get_per_token_logps_and_entropies`` with a :class:`LossRequest` on
    the policy's kernel, and returns the loss of that pass (plus the MoE aux loss), after
    logging TRL's metrics (``aux_loss``, ``kl``, ``entropy``, ``clip_ratio/*``).

    Attributes:
        trainer: the GRPOTrainer.
        kernel: the :class:`LpKernel` of its policy model.
        utils: ``trl.trainer.utils`` (its ``nanmin`` and ``nanmax``).
        input_names: the model inputs ``_get_per_token_logps_and_entropies`` takes from
            ``inputs`` (pixel values ...).
    """

    def __init__(self, trainer: Any, kernel: LpKernel, utils: types.ModuleType) -> None:
        self.trainer = trainer
        self.kernel = kernel
        self.utils = utils
        method = type(trainer)._get_per_token_logps_and_entropies
        self.input_names = tuple(inspect.signature(method).parameters)[len(_LOGPS_ARGS) :]

    def __call__(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        trainer = self.trainer
        check_grpo_options(trainer)
        mode = "train" if trainer.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask
        if "tool_mask" in inputs:
            mask = completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        per_token = {
            "advantages": advantages.float(),
            "weights": grpo_weights(trainer, mask, inputs, mode),
        }
        if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
            per_token["is_ratio"] = inputs["importance_sampling_ratio"]
        if old is not None:
            per_token["old_logprob"] = old
        if trainer.beta != 0.0:
            per_token["ref_logprob"] = inputs["ref_per_token_logps"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], 1)
        attention = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        request = LossRequest(
            grpo_policy_loss(trainer),
            per_token,
            completion_ids,
            completion_mask,
            mask,
            input_ids.shape[1],
        )
        extra = {name: inputs.get(name) for name in self.input_names}
        with self.kernel.loss_pass(request):
            logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention,
                completion_ids.shape[1],
                compute_entropy=True,
                compute_aux_loss=trainer.aux_loss_enabled,
                **extra,
            )
        if request.output is None:
            raise RuntimeError(f"{self.kernel.name}: the policy's fused head did not run")
        # through the model's output (weight 0, the value unchanged): FSDP2's backward
        # hooks on it run before the loss's backward reaches the parameters
        loss = request.output.loss + 0.0 * logps.sum()
        logps = logps.detach()  # the metrics' inputs
        if trainer.aux_loss_enabled:  # scaled for accumulation, as the policy term
            scale = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + trainer.router_aux_loss_coef * aux_loss / scale
            gathered = trainer.accelerator.gather_for_metrics(aux_loss)
            trainer._metrics[mode]["aux_loss"].append(gathered.mean().item())
        ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
        ref = inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None
        self.log_metrics(mode, mask, logps, entropies, ratio, advantages, ref)
        return loss

    def log_metrics(
        self,
        mode: str,
        mask: torch.Tensor,
        logps: torch.Tensor,
        entropies: torch.Tensor,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> None:
        """TRL's loss metrics: masked means over every rank of the KL (k3), the entropy and
        the clipped fractions, and the extreme per-sequence clipped fractions."""
        trainer, accelerator = self.trainer, self.trainer.accelerator
        metrics = trainer._metrics[mode]
        count = mask.sum().float()

        def mean(x: torch.Tensor) -> float:
            totals = accelerator.reduce(torch.stack([(x * mask).sum(), count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def per_sequence(x: torch.Tensor) -> torch.Tensor:
            return accelerator.gather((x * mask).sum(-1) / mask.sum(-1))

        if ref is not None:
            kl = kl_k3(logps, ref, max_log_ratio=None, max_kl=None)
            if trainer.args.use_bias_correction_kl:
                kl = kl * ratio
            metrics["kl"].append(mean(kl))
        metrics["entropy"].append(mean(entropies))
        low = (ratio < 1 - trainer.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + trainer.epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"].append(mean(low.float()))
        metrics["clip_ratio/high_mean"].append(mean(high.float()))
        metrics["clip_ratio/region_mean"].append(mean((low | high).float()))
        metrics["clip_ratio/low_min"].append(self.utils.nanmin(per_sequence(low.float())).item())
        metrics["clip_ratio/high_max"].append(self.utils.nanmax(per_sequence(high.float())).item())


def _grpo_seam(trainer: Any, utils: types.ModuleType) -> None:
    """Raise unless ``trainer`` is a GRPOTrainer running TRL 1.16's own loss as lp-hf read
    it: ``compute_loss`` calls ``_compute_loss``, which names what it named there and gets
    the log-probs from ``_get_per_token_logps_and_entropies`` of the parameters read."""
    name = type(trainer).__name__
    cls = getattr(sys.modules.get(_GRPO_MODULE), "GRPOTrainer", None)
    if not (isinstance(cls, type) and isinstance(trainer, cls)):
        raise ValueError(
            f"use_lp(fused_loss=True) computes TRL's GRPOTrainer loss; {name} is not a "
            "GRPOTrainer (RLOO's loss is per sequence, the others' not a policy loss); "
            "use fused_loss=False"
        )
    for method in ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies"):
        if getattr(type(trainer), method) is not getattr(cls, method):
            raise TypeError(f"{name} overrides GRPOTrainer.{method}; fused_loss reproduces TRL's")
    if "_compute_loss" in trainer.__dict__:
        raise RuntimeError(f"{name}: _compute_loss is already replaced by an instance attribute")
    compute = inspect.unwrap(cls.compute_loss).__code__
    digest = code_digest(cls._compute_loss)
    method = cls._get_per_token_logps_and_entropies
    params = inspect.signature(method).parameters
    if (
        "_compute_loss" not in compute.co_names
        or digest != _GRPO_LOSS_DIGEST
        or tuple(params)[: len(_LOGPS_ARGS)] != _LOGPS_ARGS
        or any(p.default is not None for p in list(params.values())[len(_LOGPS_ARGS) :])
        or not callable(getattr(utils, "nanmin", None))
        or not callable(getattr(utils, "nanmax", None))
    ):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.GRPOTrainer's loss is not the one lp-hf has read "
            f"(TRL 1.16.0's _compute_loss: digest {_GRPO_LOSS_DIGEST}, got {digest}); TRL "
            "changed: use fused_loss=False"
        )


def _fused_grpo_loss(
    trainer: Any, heads: list, kernels: list[LpKernel], utils: types.ModuleType
) -> GrpoFusedLoss:
    """The :class:`GrpoFusedLoss` of ``trainer``, after every check (nothing changed yet)."""
    _grpo_seam(trainer, utils)
    check_grpo_options(trainer)
    policy = {id(module) for module in trainer.model.modules()}
    mine = [k for (_, module, _, _), k in zip(heads, kernels, strict=True) if id(module) in policy]
    if len(mine) != 1:
        raise RuntimeError(
            f"{type(trainer).__name__}: {len(mine)} fused heads on trainer.model; the fused "
            "loss needs exactly one"
        )
    return GrpoFusedLoss(trainer, mine[0], utils)


def use_lp(
    trainer: Any,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
    fused_loss: bool = False,
) -> Any:
    """Make the fused LM head of a TRL 1.16 trainer compute with lp.

    Call it after building the trainer and before ``trainer.train()``. Every model of the
    trainer that carries TRL's fused head (``trainer.model``, under PEFT its base model,
    and ``trainer.ref_model``) then runs lp_kernels.linear_logprob in its training forward
    (``fused_lm_head=True``), with the model's final-logit softcap and scale
    (:mod:`lp_hf.final_logits`) and the head's bias; TRL's output contract is unchanged.
    Generation and other unfused forwards are untouched. A ``DistillationTrainer``'s loss
    runs lp_kernels.linear_divergence instead of TRL's chunked divergence, on this trainer
    only. See the module docstring.

    With ``fused_loss=True`` (a GRPOTrainer only) the policy's loss itself is computed in
    its head pass by ``lp_kernels.linear_logprob_loss`` (three GEMMs where TRL's loss on
    the head's log-probs takes four): the same loss and gradients as TRL's within fp32
    rounding, and TRL's loss metrics (``kl``, ``entropy``, ``clip_ratio/*``, ``aux_loss``).
    Covered: ``loss_type`` grpo, bnpo, dr_grpo, dapo; ``epsilon``, ``epsilon_high``,
    ``delta``; ``beta`` with or without ``use_bias_correction_kl``; token-level importance
    sampling; old log-probs (``num_iterations > 1``); vLLM's importance-sampling correction;
    tool masks; gradient accumulation and ``num_items_in_batch``; MoE aux loss.

    Args:
        trainer: a TRL trainer (GRPO, RLOO, DPO, KTO, SFT, async GRPO, Distillation) of
            TRL 1.16.x.
        deterministic: lp's tensor-parallel-invariant mode.
        backend: lp_kernels backend (``"auto"``: triton on CUDA sm80+, else torch).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check target ids against the vocabulary (one host sync per call).
        fused_loss: compute a GRPOTrainer's loss in the head pass (above).

    Returns:
        ``trainer``, changed in place.

    Raises:
        RuntimeError: TRL is not 1.16.x; its fused head is not the one lp-hf has read; a
            model's fused forward is wrapped by something other than accelerate's
            mixed-precision forward, or already uses lp; the distillation loss, or with
            ``fused_loss`` GRPOTrainer's loss, is not the one lp-hf has read.
        ValueError: the trainer has no fused head (a DistillationTrainer: no teacher); TRL's
            softcap or logit scale is not the model's; lp_hf.final_logits refuses the
            model's config; ``fused_loss`` with a trainer that is not a GRPOTrainer or with
            an option it does not reproduce (another ``loss_type``, sequence-level
            importance sampling, ``top_entropy_quantile < 1``, ``off_policy_mask_threshold``,
            an entropy bonus, ``delta <= 1 + epsilon_high``, ``epsilon`` outside [0, 1)).
        NotImplementedError: TRL asks for a per-token field the installed lp-kernels
            cannot compute; DeepSpeed ZeRO-3.
        TypeError: ``trainer`` has no ``.model`` module; a DistillationTrainer subclass
            that overrides its loss (with ``fused_loss``: a GRPOTrainer subclass); bad
            options.

    Example:
        >>> trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
        ...                           train_dataset=data)  # doctest: +SKIP
        >>> use_lp(trainer, fused_loss=True).train()  # doctest: +SKIP
    """
    options = TrlOptions(deterministic, backend, chunk_size, validate)
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {fused_loss!r}")
    utils = _trl_utils()
    distillation = _distillation_class(trainer)
    if distillation is not None:
        if fused_loss:
            raise ValueError(
                "fused_loss=True computes GRPOTrainer's loss; a DistillationTrainer's "
                "divergence is lp's linear_divergence already: use fused_loss=False"
            )
        return _use_lp_distillation(trainer, distillation, options)
    code = _fused_code(utils)
    _zero3_refused(type(trainer).__name__)
    heads = _fused_heads(trainer, code)
    # every check before any change: a refused trainer is left as it was
    kernels = [_kernel_for(where, module, fn, options) for where, module, fn, _ in heads]
    loss = _fused_grpo_loss(trainer, heads, kernels, utils) if fused_loss else None
    for (_, module, fn, wrapped), kernel in zip(heads, kernels, strict=True):
        _rebuild(module, fn, kernel, trainer.accelerator if wrapped else None)
    if loss is not None:
        trainer._compute_loss = loss  # GRPOTrainer.compute_loss calls it
    return trainer
