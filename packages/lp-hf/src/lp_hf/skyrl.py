"""lp for SkyRL's FSDP / DeepSpeed policy: ``HFModelWrapper.forward`` without logits.

``use_lp(wrapper)`` gives one ``skyrl_train.model_wrapper.HFModelWrapper`` (skyrl-train
0.3.x) an instance ``forward`` with the signature and the results of the class's own,
computed by lp-hf's head::

    wrapper(sequences [B, S], num_actions, attention_mask [B, S], temperature, ...)
      position_ids = cumsum(attention_mask) - 1 (1 at padding)
      use_sample_packing: flash-attn's unpad (SkyRL's import) -> [1, nnz] ids and positions
      targets = the ids rolled left by one (packed: across sequence ends, as SkyRL does)
      install_logprob_head(wrapper.model) for this call only (removed in a finally)
        head.logprobs(..., shift_labels=targets, temperature=temperature,
                      return_entropy=compute_entropy, logits_to_keep=num_actions + 1 when
                      only the action columns are asked for)
      entropy * attention_mask (packed: re-padded with zeros); detached unless
        entropy_requires_grad
      use_sample_packing: re-pad the log-probs -> [B, S]
      log_probs[:, -num_actions - 1 : -1]

The conventions are the stock forward's: the per-call ``temperature`` argument (not the
wrapper's attribute), log-probs of every position, ``output["entropy"]`` ``[B, S]`` when
``compute_entropy``. Differences: the log-probs and entropy are float32 whatever the model's
dtype (the stock ones have the logits' dtype); ``output`` has no ``logits``. Not supported,
with an error naming it: ``sequence_parallel_size > 1`` (Ulysses), ``num_actions`` as a list
of several lengths (the stock forward cannot slice by it either).

The head is installed around each call, so outside it ``wrapper.model`` is the stock model:
``wrapper.generate`` and weight sync see it unchanged. Under FSDP the output layer runs
inside the wrapped module's forward, so its weight is unsharded there as for the stock one.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from lp_hf.adapters import (
    HeadOptions,
    check_class,
    check_parameters,
    check_series,
    head_logprobs,
    remove_forward,
    set_forward,
)
from lp_hf.head import Backend

__all__ = ["SUPPORTED_VERSIONS", "remove_lp", "use_lp"]

SUPPORTED_VERSIONS = "0.3"
"""The skyrl-train release series whose ``HFModelWrapper.forward`` this module reproduces."""

_PARAMETERS = (
    "self",
    "sequences",
    "num_actions",
    "attention_mask",
    "temperature",
    "return_output",
    "compute_entropy",
    "entropy_requires_grad",
)


def skyrl_train_version() -> str:
    """The installed skyrl-train version (``importlib.metadata``)."""
    return importlib.metadata.version("skyrl-train")


def _wrapper_class() -> type:
    version = skyrl_train_version()
    seam = "HFModelWrapper.forward"
    check_series("lp_hf.skyrl", "skyrl-train", version, SUPPORTED_VERSIONS, seam)
    from skyrl_train.model_wrapper import HFModelWrapper

    what = f"skyrl-train {version}'s {seam}"
    check_parameters("lp_hf.skyrl", what, HFModelWrapper.forward, _PARAMETERS)
    return HFModelWrapper


def _check_parallel(wrapper: torch.nn.Module) -> None:
    if getattr(wrapper, "sequence_parallel_size", 1) > 1:
        raise NotImplementedError(
            "lp_hf.skyrl: sequence_parallel_size > 1 (Ulysses) is not supported; use "
            "sequence_parallel_size=1 or call lp_hf.skyrl.remove_lp(wrapper)"
        )


def _action_count(num_actions: int | list[int]) -> int:
    if isinstance(num_actions, list):
        if len(num_actions) != 1:
            raise ValueError(
                "HFModelWrapper.forward: num_actions must be an int or a one-element list (one "
                f"response width for the batch), got a list of {len(num_actions)}"
            )
        num_actions = num_actions[0]
    return int(num_actions)


class _LpForward:
    """The adapted wrapper's ``forward`` (an instance attribute; see the module docstring)."""

    def __init__(self, wrapper: torch.nn.Module, options: HeadOptions):
        self.wrapper = wrapper
        self.options = options

    def __call__(
        self,
        sequences: torch.Tensor,
        num_actions: int | list[int],
        attention_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_output: bool = False,
        compute_entropy: bool = False,
        entropy_requires_grad: bool = True,
    ) -> Any:
        wrapper = self.wrapper
        _check_parallel(wrapper)
        if attention_mask is None:
            raise ValueError("HFModelWrapper.forward needs attention_mask")
        width = _action_count(num_actions)
        packing = bool(wrapper.use_sample_packing)
        batch, seqlen = sequences.shape
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        ids, positions, mask, indices = sequences, position_ids, attention_mask, None
        if packing:
            from skyrl_train import model_wrapper

            with torch.no_grad():
                ids, indices, *_ = model_wrapper.unpad_input(sequences[..., None], attention_mask)
                positions, *_ = model_wrapper.unpad_input(position_ids[..., None], attention_mask)
            ids, positions, mask = ids.transpose(0, 1), positions.transpose(0, 1), None
        keep = width + 1 if not packing and not compute_entropy and 0 < width < seqlen else 0
        out, output = head_logprobs(
            wrapper.model,
            self.options,
            ids,
            temperature,
            shift_labels=torch.roll(ids, shifts=-1, dims=1),
            attention_mask=mask,
            position_ids=positions,
            return_entropy=bool(compute_entropy),
            logits_to_keep=keep,
        )
        log_probs, entropy = out.logprob, out.entropy
        if packing:
            from skyrl_train import model_wrapper

            def repad(values: torch.Tensor) -> torch.Tensor:
                padded = model_wrapper.pad_input(values.transpose(0, 1), indices, batch, seqlen)
                return padded.squeeze(-1)

            log_probs = repad(log_probs)
            entropy = None if entropy is None else repad(entropy)
        elif entropy is not None:
            entropy = entropy * attention_mask
        if entropy is not None:
            output["entropy"] = entropy if entropy_requires_grad else entropy.detach()
        action_log_probs = log_probs[:, -width - 1 : -1]
        return (action_log_probs, output) if return_output else action_log_probs


def use_lp(
    wrapper: torch.nn.Module,
    *,
    deterministic: bool = False,
    backend: Backend = "auto",
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.nn.Module:
    """Make a SkyRL ``HFModelWrapper``'s forward compute its log-probs and entropy with lp.

    After the call, ``wrapper(sequences, num_actions, attention_mask, temperature=...,
    return_output=..., compute_entropy=..., entropy_requires_grad=...)`` returns what
    ``HFModelWrapper.forward`` returns (shapes, slicing, temperature, masks, sample packing),
    computed by lp-hf's head (:func:`lp_hf.install_logprob_head`) inside ``wrapper.model``'s
    forward instead of from materialized logits, in float32; ``output`` has no ``logits``.
    Call it after building the wrapper, before or after FSDP wraps it (FSDP calls this
    same module's forward; with FSDP1 pass the wrapped module, ``fsdp_model.module``).

    Args:
        wrapper: a ``skyrl_train.model_wrapper.HFModelWrapper`` (skyrl-train 0.3.x) of a
            text causal LM, ``sequence_parallel_size`` 1.
        deterministic: lp's tensor-parallel invariant mode (``linear_logprob``'s).
        backend: lp_kernels backend (``"auto"``, ``"torch"``, ``"triton"``).
        chunk_size: token rows per step of lp's torch backend; None = its default.
        validate: check the token ids against the vocabulary (one host sync per call).

    Returns:
        ``wrapper`` itself. :func:`remove_lp` gives it the stock forward back.

    Raises:
        RuntimeError: another skyrl-train version, or a forward of other arguments.
        TypeError: not an ``HFModelWrapper``, or a subclass with its own forward.
        NotImplementedError: ``sequence_parallel_size > 1``.
        ValueError: already adapted with other options; a model lp-hf refuses
            (:func:`lp_hf.install_logprob_head`'s errors).

    Example:
        >>> policy = lp_hf.skyrl.use_lp(HFModelWrapper(model_path, ...))  # doctest: +SKIP
        >>> action_log_probs, output = policy(sequences, num_actions, attention_mask,
        ...     temperature=1.0, return_output=True, compute_entropy=True)
    """
    wrapper_cls = _wrapper_class()
    what = "a skyrl_train HFModelWrapper"
    check_class("lp_hf.skyrl", wrapper, wrapper_cls, what, "an FSDP1 module: pass its .module")
    _check_parallel(wrapper)
    options = HeadOptions(deterministic, backend, chunk_size, validate)
    set_forward(wrapper, wrapper.model, _LpForward, options, "wrapper")
    return wrapper


def remove_lp(wrapper: torch.nn.Module) -> torch.nn.Module:
    """Give a wrapper adapted by :func:`use_lp` its class's forward back (idempotent)."""
    return remove_forward(wrapper, _LpForward)
