"""The lp log-prob head for a Hugging Face ``transformers`` causal LM.

Data flow of one :meth:`LogprobHead.logprobs` call::

    head.logprobs(input_ids, labels, attention_mask, position_ids, logits_to_keep, ...)
      targets = next_token_targets(labels, ...)      [B, T]: position t -> label t + 1
      targets = slice_to_keep(targets, logits_to_keep)
      head's per-call record <- (targets, temperature, flags)      (cleared in a finally)
      model(input_ids, attention_mask, position_ids, logits_to_keep, use_cache=False, ...)
        decoder -> hidden [B, T', H] -> the model's own slicing (logits_to_keep)
        lm_head(hidden)      same module object; its forward is the head's while installed
          (FSDP2: pre-forward hook all-gathers lm_head.weight; post-backward reduce-scatters)
          linear_logprob(hidden, lm_head.weight, targets, bias=lm_head.bias,
                         softcap=c, logit_scale=s)      (the model's own: see below)
            -> stacked [B, T', 1 + e + l] fp32
        (the model's own softcap / scale after lm_head is off for this forward)
        out.logits = that stacked tensor (the model's output field, no [B, T, V] logits)
      -> LogProbOutput(logprob, entropy, lse), each [B, T'] fp32

Why the computation sits in the output layer's own forward: under FSDP2
(``torch.distributed.fsdp.fully_shard``) the output weight is a full tensor only between
FSDP's pre-forward hook (all-gather) and its post-forward reshard, and the gradient reaches
the sharded parameter only through FSDP's post-backward hook (reduce-scatter). Calling the
output layer through the model's own forward keeps both hooks in charge, whether
``lm_head`` is sharded on its own or with the root module (tied embeddings: the weight is
the input embedding's ``Parameter`` and gets one accumulated gradient). No copy of the
weight is made.

Under torch-native tensor parallel (``ColwiseParallel(output_layouts=Replicate())`` on
``lm_head``) the layer's weight is a ``Shard(0)`` DTensor and its hooks hand in a Replicate
DTensor ``hidden``: both go to ``linear_logprob`` as they are (lp reads them as vocabulary
shards). The head returns its result as a Replicate DTensor, which that output layout passes
on unchanged; any other layout would redistribute it and is refused on every rank.

The per-call record is set by ``logprobs`` for the length of one model forward. A call of
the output layer outside it (a plain ``model(...)``, generation, or the recompute of an
activation-checkpointed region that contains ``lm_head``) raises ``RuntimeError``;
``with head.paused():`` gives the stock logits for generation. transformers' own
``gradient_checkpointing_enable()`` checkpoints the decoder layers only, which is fine.

Final-logit softcap and scale (:mod:`lp_hf.final_logits`): some forwards change what
``lm_head`` returned, Gemma 2 / 3 by ``c * tanh(logits / c)`` (``final_logit_softcapping``),
Cohere, Granite, Falcon-H1 and HyperCLOVA X by a scalar ``s`` (a divisor is ``s = 1 / d``).
lp applies them inside the kernels (``softcap=c``, ``logit_scale=s``: ``z = c tanh(s l /
c) / T``), read at each call where the model's class reads them (a config field, or a module
attribute copied at init), so for the model forward of one ``logprobs`` call the head
switches each off (a softcap to None, a scale to 1) and restores it in a ``finally``. The
model then returns the head's result itself, or (a scale, multiplied by 1) a copy with the
same values, checked bit for bit (one host sync) and dropped. A field set on a class whose
code lp-hf has not read is refused at install; a model that changes the result by other
means (a ``text_config`` field, a module) fails the check with ``RuntimeError``. While a
call runs, another thread using the same model or config sees the switched-off values.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lp_hf.final_logits import (
    FinalLogitTransform,
    output_layer_owner,
    post_processing,
    same_values,
    switched_off,
)
from lp_hf.targets import next_token_targets, slice_to_keep
from lp_kernels import LogProbOutput, linear_logprob

__all__ = ["HeadConfig", "LogprobHead", "install_logprob_head"]

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")
_HEAD_ATTR = "_lp_hf_logprob_head"


def _check_temperature(value: Any, name: str = "temperature") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {value!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class HeadConfig:
    """Options of :func:`install_logprob_head` (keyword arguments there).

    Example:
        >>> HeadConfig(temperature=0.7).backend
        'auto'
    """

    temperature: float = 1.0
    """Default temperature of :meth:`LogprobHead.logprobs`: logits are divided by it."""
    ignore_index: int = -100
    """Label value of positions without a target: their outputs are 0, with no gradient."""
    backend: Backend = "auto"
    """lp_kernels backend: ``"auto"`` (triton on CUDA of compute capability >= 8.0, else
    torch), ``"torch"`` or ``"triton"``."""
    chunk_size: int | None = None
    """Token rows per step of lp's torch backend (a memory knob); None = its default."""
    validate: bool = True
    """Check the label ids against the vocabulary (one host sync per call)."""
    deterministic: bool = False
    """lp's tensor-parallel invariant mode (``linear_logprob(deterministic=True)``): under
    torch-native TP the outputs and gradients do not depend on the TP degree."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _check_temperature(self.temperature))
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.ignore_index >= 0:
            raise ValueError(
                f"ignore_index must be negative (not a token id), got {self.ignore_index}"
            )
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size <= 0
        ):
            raise ValueError(f"chunk_size must be None or a positive int, got {self.chunk_size!r}")
        for name in ("validate", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class _Call:
    """What one ``logprobs`` call hands to the output layer's forward."""

    targets: torch.Tensor
    temperature: float
    return_entropy: bool
    return_lse: bool
    transform: FinalLogitTransform = field(default_factory=FinalLogitTransform)
    """The model's final-logit softcap and scale, applied by lp (the model's own are off
    meanwhile)."""
    exact: bool = True
    """The model returns the layer's result itself (else, a scale multiplied by 1, a copy)."""
    result: torch.Tensor | None = field(default=None)
    mesh: Any = field(default=None)
    """The weight's device mesh under torch-native tensor parallel, else None."""


class LogprobHead:
    """Handle returned by :func:`install_logprob_head`; also a context manager.

    Attributes:
        model: the model it was installed on.
        layer: the model's output layer (``model.get_output_embeddings()``), the same
            module object as before install.
        config: the :class:`HeadConfig`.
    """

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Linear, config: HeadConfig):
        self.model = model
        self.layer = layer
        self.config = config
        self._owner = output_layer_owner(model, layer)  # whose forward calls the layer
        self._call: _Call | None = None
        self._paused = False
        self._installed = False

    # -- install / remove ---------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """True from install until :meth:`remove`."""
        return self._installed

    def _install(self) -> None:
        self.layer.__dict__["forward"] = self._layer_forward
        self.model.__dict__[_HEAD_ATTR] = self
        self._installed = True

    def remove(self) -> None:
        """Give the output layer its own forward back: the model returns logits again.

        The layer is the same module object throughout; after ``remove`` it has no
        instance attribute left, so its forward is its class's. Idempotent.
        """
        if not self._installed:
            return
        if self.layer.__dict__.get("forward") == self._layer_forward:
            del self.layer.__dict__["forward"]
        if self.model.__dict__.get(_HEAD_ATTR) is self:
            del self.model.__dict__[_HEAD_ATTR]
        self._call = None
        self._installed = False

    def __enter__(self) -> LogprobHead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, the model computes its stock ``[B, T, V]`` logits (e.g. to generate)."""
        if not self._installed:
            raise RuntimeError("this LogprobHead was removed; install_logprob_head() again")
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    # -- the output layer's forward while installed ---------------------------------------

    def _layer_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Forward of the output layer while installed: ``[*, H]`` -> ``[*, 1 + e + l]``."""
        layer = self.layer
        if self._paused:
            return type(layer).forward(layer, hidden)
        call = self._call
        if call is None:
            raise RuntimeError(
                "the lp log-prob head is installed on this model: get log-probs with "
                "head.logprobs(...), use `with head.paused():` for the stock logits (e.g. "
                "generation), or head.remove(). (If this is the recompute of an activation "
                "checkpoint, the output layer must not be inside the checkpointed region.)"
            )
        if call.result is not None:
            raise RuntimeError(
                "the output layer ran twice in one model forward; lp-hf supports models that "
                "call it once"
            )
        targets = call.targets.to(hidden.device)
        if tuple(hidden.shape[:-1]) != tuple(targets.shape):
            raise ValueError(
                f"the output layer got hidden states of shape {tuple(hidden.shape)} but the "
                f"targets have shape {tuple(targets.shape)}: the model sliced its hidden "
                "states in a way lp-hf did not predict (logits_to_keep support?)"
            )
        cfg = self.config
        out = linear_logprob(
            hidden,
            layer.weight,  # under FSDP2 the unsharded weight, only inside this forward
            targets,
            bias=layer.bias,  # None, [V] (unsharded by FSDP2's hooks), or a TP Shard(0)
            temperature=call.temperature,
            softcap=call.transform.softcap,
            logit_scale=call.transform.logit_scale,
            ignore_index=cfg.ignore_index,
            return_entropy=call.return_entropy,
            return_lse=call.return_lse,
            deterministic=cfg.deterministic,
            backend=cfg.backend,
            chunk_size=cfg.chunk_size,
            validate=cfg.validate,
        )
        fields = [out.logprob]
        if call.return_entropy:
            fields.append(out.entropy)
        if call.return_lse:
            fields.append(out.lse)
        stacked = torch.stack(fields, dim=-1)
        call.result = stacked
        mesh = _tp_mesh(layer.weight)
        if mesh is None:
            return stacked
        # torch-native TP: ColwiseParallel's output hook runs on what this returns; the
        # result is the same on every rank, so it is a Replicate DTensor (a no-op for
        # output_layouts=Replicate(); a Shard(-1) layout would split it, and is refused)
        from torch.distributed.tensor import DTensor, Replicate

        call.mesh = mesh
        return DTensor.from_local(stacked, mesh, [Replicate()], run_check=False)

    # -- public computation ---------------------------------------------------------------

    def logprobs(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        temperature: float | None = None,
        return_entropy: bool = False,
        return_lse: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **model_kwargs: Any,
    ) -> LogProbOutput:
        """Run the model and return per-position log-probs of the next token.

        Position ``t`` holds ``log p(labels[:, t + 1] | tokens <= t)``, as transformers'
        causal-LM loss shifts labels, under ``softmax(z)`` with ``z = c * tanh(s * l / c) /
        T``, ``l`` the output layer's logits (its bias included), ``s`` and ``c`` the
        model's own final-logit scale and softcap (:func:`lp_hf.model_logit_transform`;
        none: ``z = l / T``); see
        :func:`lp_hf.next_token_targets` for the positions that get 0 (the last one,
        ``ignore_index`` labels, ``attention_mask == 0`` at ``t`` or ``t + 1``,
        packed-sequence boundaries found from ``position_ids``).

        Args:
            input_ids: ``[B, T]`` token ids (or None with ``inputs_embeds=`` in
                ``model_kwargs`` and explicit ``labels``).
            labels: ``[B, T]`` ids to score; default ``input_ids``. ``ignore_index``
                (``-100``) marks positions without a loss.
            attention_mask: ``[B, T]``, 0 at padding (passed to the model).
            position_ids: ``[B, T]`` or ``[1, T]`` (passed to the model). For padding-free
                packing give ``[1, T]`` positions that restart at 0 for each sequence and
                ``attention_mask=None``; transformers then keeps the sequences apart in
                attention (sdpa, eager and flash-attention-2).
            shift_labels: ``[B, T]`` targets already shifted (position ``t``'s target at
                ``t``), used as given instead of ``labels``; as transformers'
                ``shift_labels``.
            temperature: logits are divided by it; default ``config.temperature``.
            return_entropy: also return the per-position entropy (differentiable).
            return_lse: also return the per-position log-sum-exp (differentiable).
            logits_to_keep: passed to the model: an int ``k`` keeps the last ``k``
                positions (0: all), a tensor keeps the positions it names (see
                :func:`lp_hf.slice_to_keep`); the outputs have the kept shape.
            **model_kwargs: other arguments of the model's forward; ``use_cache``
                defaults to False.

        Returns:
            ``LogProbOutput(logprob, entropy, lse)``, each float32 of shape ``[B, T]`` (or
            the kept shape); entropy and lse None unless requested.

        Raises:
            RuntimeError: the head was removed or is paused; the model did not call its
                output layer or post-processed what it returned.
            ValueError, TypeError: bad shapes, dtypes or options (naming the argument); a
                final-logit field the head cannot take (naming it, as at install).
        """
        if not self._installed:
            raise RuntimeError("this LogprobHead was removed; install_logprob_head() again")
        if self._paused:
            raise RuntimeError("head.logprobs() inside `with head.paused():`")
        if self._call is not None:
            raise RuntimeError("head.logprobs() is already running (re-entrant call)")
        for name in ("labels", "return_dict"):
            if name in model_kwargs:  # pragma: no cover - named parameters catch labels
                raise TypeError(f"head.logprobs() got {name}= in model_kwargs")
        for name, flag in (("return_entropy", return_entropy), ("return_lse", return_lse)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        temp = self.config.temperature if temperature is None else _check_temperature(temperature)
        ignore = self.config.ignore_index
        if shift_labels is not None:
            if labels is not None:
                raise ValueError("pass labels or shift_labels, not both")
            if not isinstance(shift_labels, torch.Tensor) or shift_labels.dim() != 2:
                raise ValueError("shift_labels must be a 2-D [B, T] integer tensor")
            if shift_labels.dtype.is_floating_point or shift_labels.dtype == torch.bool:
                raise TypeError(f"shift_labels must be integer, got {shift_labels.dtype}")
            targets = shift_labels.long()
        else:
            base = labels if labels is not None else input_ids
            if base is None:
                raise ValueError("pass input_ids, or labels (with inputs_embeds=)")
            targets = next_token_targets(
                base, attention_mask=attention_mask, position_ids=position_ids, ignore_index=ignore
            )
        if input_ids is not None and tuple(input_ids.shape) != tuple(targets.shape):
            raise ValueError(
                f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(targets.shape)}"
            )
        targets = slice_to_keep(targets, logits_to_keep)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            model_kwargs["logits_to_keep"] = logits_to_keep
        model_kwargs.setdefault("use_cache", False)
        processing = post_processing(self._owner)
        call = _Call(
            targets, temp, return_entropy, return_lse, processing.transform, processing.exact
        )
        self._call = call
        try:
            with switched_off(processing):
                output = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    return_dict=True,
                    **model_kwargs,
                )
        finally:
            self._call = None
        stacked = getattr(output, "logits", None)
        if call.result is None:
            raise RuntimeError(
                "the model's forward did not call its output layer "
                f"({type(self.layer).__name__} from get_output_embeddings())"
            )
        if call.mesh is not None:
            stacked = _tp_result(stacked, call.result, call.mesh, call.exact)
        elif not call.exact and same_values(stacked, call.result):
            stacked = call.result  # the model's scale, switched to 1: the same values
        if stacked is not call.result:
            why = ""
            if isinstance(stacked, torch.Tensor) and stacked.dtype != torch.float32:
                why = (
                    f" (it came back as {stacked.dtype}: an FSDP MixedPrecisionPolicy "
                    "output_dtype casts the model output; leave it None)"
                )
            raise RuntimeError(
                "the model changed what its output layer returned before returning it as "
                f"logits{why}; lp-hf supports models that return the output layer's result "
                "unchanged, or change it only by the final-logit softcap or scale of the "
                "transformers classes listed in lp_hf.final_logits"
            )
        entropy = stacked[..., 1] if return_entropy else None
        lse = stacked[..., 1 + int(return_entropy)] if return_lse else None
        return LogProbOutput(stacked[..., 0], entropy, lse)


def _tp_mesh(weight: torch.Tensor) -> Any:
    """The device mesh of a DTensor weight (torch-native tensor parallel), else None."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return weight.device_mesh if dtensor is not None and isinstance(weight, dtensor) else None


def _tp_result(logits: Any, result: torch.Tensor, mesh: Any, exact: bool = True) -> Any:
    """The model's ``.logits`` under torch-native TP, as the head's own ``result`` tensor.

    The output layer returned ``result`` as a Replicate DTensor. With
    ``ColwiseParallel(output_layouts=Replicate())`` the hook hands it on unchanged (or its
    local tensor, ``use_local_output=True``): the same values, a view of ``result``'s
    memory (not ``exact``: a model's scale switched to 1 may have made a copy with the same
    values). Any other output layout redistributes it; that is refused on every rank of the
    mesh (one flag all-reduced), since a split could leave some ranks a view that passes.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    local = logits
    if isinstance(logits, DTensor):
        local = logits.to_local() if logits.placements == (Replicate(),) else None
    same = (
        isinstance(local, torch.Tensor)
        and not isinstance(local, DTensor)
        and local.shape == result.shape
        and local.stride() == result.stride()
        and local.data_ptr() == result.data_ptr()
    ) or (not exact and same_values(local, result))
    bad = torch.tensor([0 if same else 1], dtype=torch.int64, device=result.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=mesh.get_group())
    if int(bad.item()):
        raise RuntimeError(
            "the tensor-parallel output layer redistributed the head's result: lp-hf's "
            "result is the same on every rank (a Replicate DTensor), so parallelize lm_head "
            "with ColwiseParallel(output_layouts=Replicate()) (transformers' own lm_head plan "
            "'colwise_gather_output' is that layout); Shard(-1) (loss parallel) is not "
            "supported"
        )
    return result


def install_logprob_head(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
    deterministic: bool = False,
) -> LogprobHead:
    """Make a transformers causal LM's output layer compute lp's log-probs, not logits.

    The output layer (``model.get_output_embeddings()``, an ``nn.Linear``, with or without
    a bias) stays the same module object with the same weight ``Parameter`` (tied or not)
    and bias; only its forward is replaced by an instance attribute, removed by
    :meth:`LogprobHead.remove`. Parameters, ``state_dict`` and optimizer state are
    unchanged. Install before or after ``fully_shard``.

    A bias goes to lp as ``bias=`` (its gradient lands on the bias ``Parameter``); the
    model's final-logit softcap (Gemma 2 / 3) and scale (Cohere, Granite, Falcon-H1,
    HyperCLOVA X), read at each call where its class reads them, go to lp as ``softcap=``
    and ``logit_scale=``, and the model's own steps are off while the head computes (see
    the module docstring and :mod:`lp_hf.final_logits`).

    Args:
        model: a ``transformers.PreTrainedModel`` (or any module with
            ``get_output_embeddings()``) whose forward returns ``.logits`` from that layer.
        temperature: default temperature of :meth:`LogprobHead.logprobs` (> 0).
        ignore_index: label value of positions without a target (negative).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of the torch backend; None = its default.
        validate: check label ids (one host sync per call).
        deterministic: lp's TP-invariant mode (:attr:`HeadConfig.deterministic`).

    Returns:
        The :class:`LogprobHead`. Installing again with the same options returns it.

    Raises:
        TypeError: no ``get_output_embeddings()``, or the output layer is not an
            ``nn.Linear``.
        ValueError: the model's config sets a final-logit field
            (:data:`lp_hf.final_logits.FIELDS`) that its class's forward is not known to
            read, or a softcap or scale that is not finite and > 0 (TypeError: not a
            number); the layer's forward is already replaced (e.g. accelerate offload
            hooks); a head with other options is installed.

    Example:
        >>> head = install_logprob_head(model)  # doctest: +SKIP
        >>> out = head.logprobs(input_ids, attention_mask=mask, return_entropy=True)
        >>> out.logprob.shape  # [B, T], position t scores token t + 1
    """
    config = HeadConfig(
        temperature=temperature,
        ignore_index=ignore_index,
        backend=backend,
        chunk_size=chunk_size,
        validate=validate,
        deterministic=deterministic,
    )
    if not isinstance(model, torch.nn.Module) or not callable(
        getattr(model, "get_output_embeddings", None)
    ):
        raise TypeError(
            "model must be a torch.nn.Module with get_output_embeddings() (a transformers "
            f"PreTrainedModel), got {type(model).__name__}"
        )
    existing = model.__dict__.get(_HEAD_ATTR)
    if existing is not None and existing.installed:
        if existing.config != config:
            raise ValueError(
                f"a log-prob head with other options is installed ({existing.config}); call "
                "head.remove() first"
            )
        return existing
    layer = model.get_output_embeddings()
    if not isinstance(layer, torch.nn.Linear):
        raise TypeError(
            "model.get_output_embeddings() must be an nn.Linear (the LM head), got "
            f"{type(layer).__name__}"
        )
    if "forward" in layer.__dict__ and getattr(layer, "_is_hooked", False):
        raise ValueError(
            "the output layer is tensor-parallel through transformers' tp_plan, which replaces "
            "its forward; lp-hf takes torch's own: leave lm_head out of tp_plan and run "
            "torch.distributed.tensor.parallel.parallelize_module(model, tp_mesh, "
            '{"lm_head": ColwiseParallel(output_layouts=Replicate())})'
        )
    if "forward" in layer.__dict__:
        raise ValueError(
            "the output layer's forward is already replaced by an instance attribute (e.g. "
            "accelerate hooks from device_map / offloading); lp-hf needs the layer's own "
            "forward"
        )
    head = LogprobHead(model, layer, config)
    post_processing(head._owner)  # an unknown field or a bad value fails here
    head._install()
    return head
