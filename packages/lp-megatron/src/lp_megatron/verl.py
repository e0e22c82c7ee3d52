"""lp as the output step of verl's Megatron fused path: :func:`use_lp`, once per worker.

verl 0.9 (Megatron engine, ``actor_rollout_ref.model.use_fused_kernels=True``) computes
per-token log-probs and entropy at megatron-core's output-processor hook (megatron-core
>= 0.18): ``verl.models.mcore.model_forward_fused`` calls the model with
``output_processor=fused_output_processor``, a module global looked up at each call::

    engine forward step -> fused_forward_model_engine (or fused_forward_model_gen)
      -> packs the batch to THD: input_ids [1, T], labels [1, T] (rolled), b = 1
      -> model(..., labels=labels, output_processor=fused_output_processor,
               output_processor_context=FusedOutputProcessorContext(temperature=T))
         -> fused_output_processor(hidden_states [T, 1, h] ([T/P, 1, h] under SP),
                                   output_layer, output_weight, labels, context, config)
            stock: verl's CUDA kernel linear_cross_entropy(hidden, W shard, labels, T,
                   "none", tp group) -> CausalLMOutputForPPO(log_probs [T], entropy [T])
      -> unpacks log_probs (and entropy) per sequence

:func:`use_lp` replaces that module global with :class:`LpOutputProcessor`, which calls
:func:`lp_megatron.output_processor` (labels as given, temperature from verl's context,
entropy always) and returns verl's ``CausalLMOutputForPPO`` with flat ``[T]`` fp32
``log_probs`` and ``entropy``, as the stock kernel does. Tensor and sequence parallelism
use megatron's tensor-parallel group, as the stock output layer does. Every row of the
weight shard is in the softmax (megatron's padded rows too), as in verl's kernel.

verl's Megatron engine never reads ``fused_kernel_options.impl_backend`` and has no
plugin hook on its Megatron side, so lp is selected by calling :func:`use_lp` in every
worker process that runs the Megatron engine (after ``import verl``, before the first
forward); every fused forward of that process then runs on lp. :func:`remove_lp` gives
verl its processor back.

Where lp and verl's kernel differ, lp follows the model's own logits: an output-layer
bias and MuP's output multiplier are applied (verl's kernel leaves both out), and a model
whose logits lp cannot reproduce falls back to the stock layer's logits with a warning.
Refused, with an error naming it: verl other than 0.9.x; megatron-core without the
output-processor hook (verl then patches ``GPTModel.forward`` instead, which lp does not
replace); a batch dimension other than 1 (verl always packs to one row).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from lp_megatron.config import Backend, LogprobHeadConfig

__all__ = [
    "SUPPORTED_VERSIONS",
    "LpOutputProcessor",
    "remove_lp",
    "use_lp",
    "verl_version",
]

SUPPORTED_VERSIONS = "0.9"
"""The verl release series whose Megatron fused output step this module was read against."""

_FUSED = "verl.models.mcore.model_forward_fused"
_SEAM = "fused_output_processor"
_SEAM_PARAMETERS = (
    "hidden_states",
    "output_layer",
    "output_weight",
    "labels",
    "context",
    "config",
    "_ignored",
)


def verl_version() -> str:
    """The installed verl version (``importlib.metadata``)."""
    return importlib.metadata.version("verl")


@dataclass(frozen=True)
class LpOutputProcessor:
    """verl's ``fused_output_processor`` computed by lp (see the module docstring).

    ``stock`` is verl's own function (what :func:`remove_lp` puts back); the other fields
    are lp's options (:class:`lp_megatron.LogprobHeadConfig`'s).
    """

    stock: Any
    deterministic: bool = False
    backend: Backend = "auto"
    chunk_size: int | None = None
    validate: bool = True

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: Any,
        output_weight: torch.Tensor | None,
        labels: torch.Tensor,
        context: Any,
        config: Any,
        **rest: Any,
    ) -> Any:
        from verl.utils.model import CausalLMOutputForPPO

        from lp_megatron.context import OutputContext
        from lp_megatron.processor import output_processor

        if labels is None or labels.dim() != 2 or labels.shape[0] != 1:
            shape = None if labels is None else tuple(labels.shape)
            raise NotImplementedError(
                f"lp_megatron.verl: verl's fused path packs the batch to labels [1, T]; got {shape}"
            )
        head = LogprobHeadConfig(
            temperature=float(context.temperature),
            deterministic=self.deterministic,
            backend=self.backend,
            chunk_size=self.chunk_size,
            validate=self.validate,
        )
        out = output_processor(
            hidden_states=hidden_states,
            output_layer=output_layer,
            output_weight=output_weight,
            labels=labels,
            loss_mask=None,  # verl scores every packed position; it masks afterwards
            context=OutputContext(config=head, return_entropy=True, apply_loss_mask=False),
            config=config,
            scale_logits=rest.get("scale_logits"),
            runtime_gather_output=rest.get("runtime_gather_output"),
        )
        # [1, T] -> [T], the stock kernel's shape
        return CausalLMOutputForPPO(
            hidden_states=hidden_states,
            log_probs=out.logprob.reshape(-1),
            entropy=out.entropy.reshape(-1),
        )


def _fused_module() -> ModuleType:
    """verl's fused-forward module, after the version and seam checks."""
    version = verl_version()
    if version.split(".")[:2] != SUPPORTED_VERSIONS.split("."):
        raise RuntimeError(
            f"lp_megatron.verl supports verl {SUPPORTED_VERSIONS}.x (the Megatron fused "
            f"output step it reproduces was read there); found verl {version}"
        )
    from megatron.core.models.gpt.gpt_model import GPTModel

    if "output_processor" not in inspect.signature(GPTModel.forward).parameters:
        raise RuntimeError(
            "lp_megatron.verl needs megatron-core >= 0.18 (GPTModel's output_processor hook); "
            "on older megatron-core verl patches GPTModel.forward, which lp does not replace"
        )
    module = importlib.import_module(_FUSED)
    seam = getattr(module, _SEAM, None)
    stock = seam.stock if isinstance(seam, LpOutputProcessor) else seam
    names = tuple(inspect.signature(stock).parameters) if callable(stock) else ()
    if names != _SEAM_PARAMETERS:
        raise RuntimeError(
            f"verl {version}'s {_FUSED}.{_SEAM} takes {names}, not the arguments "
            f"lp_megatron.verl reproduces {_SEAM_PARAMETERS}"
        )
    return module


def use_lp(
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> LpOutputProcessor:
    """Make verl's Megatron fused forward (``use_fused_kernels=True``) compute with lp.

    Call it in every worker process that runs verl's Megatron engine, before its first
    forward (verl's Megatron side reads no backend name and has no plugin hook). Calling
    it again with the same options does nothing.

    Args:
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).

    Returns:
        The :class:`LpOutputProcessor` now in verl's module.

    Raises:
        RuntimeError: another verl version, megatron-core without the output-processor
            hook, or a verl output processor of other arguments.
        ValueError: already in place with other options (call :func:`remove_lp` first).

    Example:
        >>> lp_megatron.verl.use_lp()  # doctest: +SKIP
    """
    module = _fused_module()
    current = getattr(module, _SEAM)
    wanted = LpOutputProcessor(
        current.stock if isinstance(current, LpOutputProcessor) else current,
        deterministic,
        backend,
        chunk_size,
        validate,
    )
    if isinstance(current, LpOutputProcessor):
        if current != wanted:
            raise ValueError(f"lp is verl's Megatron output step with {current}; remove_lp first")
        return current
    setattr(module, _SEAM, wanted)
    return wanted


def remove_lp() -> None:
    """Give verl its own Megatron ``fused_output_processor`` back (idempotent)."""
    module = importlib.import_module(_FUSED)
    current = getattr(module, _SEAM)
    if isinstance(current, LpOutputProcessor):
        setattr(module, _SEAM, current.stock)
