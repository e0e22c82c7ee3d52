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
"""

from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lp_hf.final_logits import FinalLogitTransform, model_logit_transform
from lp_kernels import linear_logprob

__all__ = ["EXTRAS", "FIELDS", "SUPPORTED_TRL", "LpKernel", "TrlOptions", "use_lp"]

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
        mine = (self.transform.softcap, self.transform.logit_scale or 1.0)
        theirs = (softcap, 1.0 if logit_scale is None else logit_scale)
        if mine != theirs:
            raise ValueError(
                f"{self.name}: TRL's fused head applies softcap={theirs[0]!r}, "
                f"logit_scale={theirs[1]!r}, but the model's forward applies "
                f"softcap={mine[0]!r}, logit_scale={mine[1]!r} (lp_hf.final_logits); lp "
                "does not pick one of two answers: fix the config or use TRL's own head"
            )

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
    code, name = fn.__code__, fn.__name__
    rebuilt = types.FunctionType(code, namespace, name, fn.__defaults__, fn.__closure__)
    rebuilt.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    # name, docstring and __wrapped__: generate() checks its kwargs against the signature
    functools.update_wrapper(rebuilt, fn)
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
    Generation and other unfused forwards are untouched. See the module docstring.

    Args:
        trainer: a TRL trainer (GRPO, RLOO, DPO, KTO, SFT, async GRPO) of TRL 1.16.x.
        deterministic: lp's tensor-parallel-invariant mode.
        backend: lp_kernels backend (``"auto"``: triton on CUDA sm80+, else torch).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check target ids against the vocabulary (one host sync per call).

    Returns:
        ``trainer``, changed in place.

    Raises:
        RuntimeError: TRL is not 1.16.x; its fused head is not the one lp-hf has read; a
            model's fused forward is wrapped by something other than accelerate's
            mixed-precision forward, or already uses lp.
        ValueError: the trainer has no fused head; TRL's softcap or logit scale is not the
            model's; lp_hf.final_logits refuses the model's config.
        NotImplementedError: TRL asks for a per-token field the installed lp-kernels
            cannot compute; DeepSpeed ZeRO-3.
        TypeError: ``trainer`` has no ``.model`` module; bad options.

    Example:
        >>> trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
        ...                           train_dataset=data)  # doctest: +SKIP
        >>> use_lp(trainer).train()  # doctest: +SKIP
    """
    options = TrlOptions(deterministic, backend, chunk_size, validate)
    code = _fused_code(_trl_utils())
    _zero3_refused(type(trainer).__name__)
    heads = _fused_heads(trainer, code)
    # every check before any change: a refused trainer is left as it was
    kernels = [_kernel_for(where, module, fn, options) for where, module, fn, _ in heads]
    for (_, module, fn, wrapped), kernel in zip(heads, kernels, strict=True):
        _rebuild(module, fn, kernel, trainer.accelerator if wrapped else None)
    return trainer
