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
import sys
import types
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lp_hf.adapters import check_parameters
from lp_hf.final_logits import FinalLogitTransform, model_logit_transform
from lp_kernels import linear_divergence, linear_logprob

__all__ = [
    "DIVERGENCE_ARGS",
    "EXTRAS",
    "FIELDS",
    "SUPPORTED_TRL",
    "LpDivergenceKernel",
    "LpKernel",
    "TrlOptions",
    "divergence_kind",
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


class LpKernel:
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


def use_lp(
    trainer: Any,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
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

    Args:
        trainer: a TRL trainer (GRPO, RLOO, DPO, KTO, SFT, async GRPO, Distillation) of
            TRL 1.16.x.
        deterministic: lp's tensor-parallel-invariant mode.
        backend: lp_kernels backend (``"auto"``: triton on CUDA sm80+, else torch).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check target ids against the vocabulary (one host sync per call).

    Returns:
        ``trainer``, changed in place.

    Raises:
        RuntimeError: TRL is not 1.16.x; its fused head is not the one lp-hf has read; a
            model's fused forward is wrapped by something other than accelerate's
            mixed-precision forward, or already uses lp; the distillation loss is not the
            one lp-hf has read, or already uses lp.
        ValueError: the trainer has no fused head (a DistillationTrainer: no teacher); TRL's
            softcap or logit scale is not the model's; lp_hf.final_logits refuses the
            model's config.
        NotImplementedError: TRL asks for a per-token field the installed lp-kernels
            cannot compute; DeepSpeed ZeRO-3.
        TypeError: ``trainer`` has no ``.model`` module; a DistillationTrainer subclass
            that overrides its loss; bad options.

    Example:
        >>> trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
        ...                           train_dataset=data)  # doctest: +SKIP
        >>> use_lp(trainer).train()  # doctest: +SKIP
    """
    options = TrlOptions(deterministic, backend, chunk_size, validate)
    utils = _trl_utils()
    distillation = _distillation_class(trainer)
    if distillation is not None:
        return _use_lp_distillation(trainer, distillation, options)
    code = _fused_code(utils)
    _zero3_refused(type(trainer).__name__)
    heads = _fused_heads(trainer, code)
    # every check before any change: a refused trainer is left as it was
    kernels = [_kernel_for(where, module, fn, options) for where, module, fn, _ in heads]
    for (_, module, fn, wrapped), kernel in zip(heads, kernels, strict=True):
        _rebuild(module, fn, kernel, trainer.accelerator if wrapped else None)
    return trainer
