"""lp as SkyRL's Megatron fused LM-head backend: ``use_lp(trainer_config)``.

SkyRL (the ``skyrl`` 0.4.0 wheel) has a fused LM-head path for its Megatron worker,
switched on by ``trainer.fused_lm_head_logprob=true``. Its output processor returns the
decoder's hidden state ``[B, S, H]`` (gathered under sequence parallel, else through
``copy_to_tensor_model_parallel_region``, whose backward all-reduces the hidden gradient)
and keeps the output weight; the loss then calls, in
``skyrl.backends.skyrl_train.distributed.megatron.model_utils``::

    from_parallel_hidden_to_logprobs(hidden, W [V/P, H], sequences, ..., temperature=T)
      W / T (a copy of the shard), targets = sequences rolled left by one
      -> _fused_lm_head_logprob_apply(backend, hidden, W / T, targets, vocab_start,
                                      vocab_end, chunk_size, tp_group, inference_only)
         -> [B, S] fp32 log-probs summed over TP; grad_hidden = this rank's partial
    _fused_vocab_parallel_entropy_from_hidden(hidden[:, actions], W, tp_group, T)
      a second pass over the vocabulary, without gradient (``use_entropy_loss`` raises)

``use_lp`` replaces, in that module (and in the worker's module if it is already
imported; imported later, it binds the replaced names):

- ``_fused_lm_head_logprob_apply`` by ``linear_logprob(hidden, W, targets, tp_group,
  vocab_start, temperature=T, reduce_grad_hidden=False, return_entropy, return_lse)``:
  the partial hidden gradient, as the processor's collective expects. ``validate=True``
  on the first call of each layout, False afterwards (no host sync on the hot path).
- ``from_parallel_hidden_to_logprobs`` (and the packed-sequence variant) by the same
  function called with ``temperature=1.0`` while lp gets ``T`` itself: no ``W / T`` copy.
- ``_fused_vocab_parallel_entropy_from_hidden`` by the entropy lp computed in the
  log-prob call when the hidden state is a slice of that call's (SkyRL's layout: the
  action columns), else by one lp call; either way differentiable.

Conventions kept from SkyRL's torch backend: every output row is a token (Megatron's
padded vocabulary rows enter the softmax, as in the stock logits); a target outside every
shard (``< 0`` or ``>= V``) gives 0, with the gradient SkyRL's backward gives it (that of
``-lse``); fp32 results; ``inference_only`` runs without autograd. SkyRL's ``chunk_size``
(sequence positions) and ``backend`` arguments are not used: lp's own ``chunk_size`` and
``backend`` options apply. ``use_entropy_loss=True`` still raises in SkyRL's loss before
any replaceable function runs: lp's entropy carries a gradient, but SkyRL's loss does not
ask for it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["SUPPORTED_VERSION", "LpFusedLMHead", "skyrl_version", "use_lp"]

SUPPORTED_VERSION = "0.4.0"
"""The ``skyrl`` release whose private fused LM-head seam this module replaces."""

_MODEL_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
_WORKER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
_SEAM = "_fused_lm_head_logprob_apply"
_SEAM_PARAMETERS = (
    "backend",
    "hidden",
    "weight",
    "target",
    "vocab_start_index",
    "vocab_end_index",
    "chunk_size",
    "tp_group",
    "inference_only",
)
_LOGPROBS = (
    "from_parallel_hidden_to_logprobs",
    "from_parallel_hidden_to_logprobs_packed_sequences",
)
_ENTROPY = "_fused_vocab_parallel_entropy_from_hidden"


def skyrl_version() -> str:
    """The installed ``skyrl`` version (``importlib.metadata``)."""
    return importlib.metadata.version("skyrl")


def _trainer_config(config: Any) -> Any:
    """The object holding ``fused_lm_head_logprob``: a TrainerConfig, or what wraps one."""
    for attribute in ("trainer", "cfg"):  # SkyRLConfig.trainer, MegatronModelWrapper.cfg
        inner = getattr(config, attribute, None)
        if inner is not None and hasattr(inner, "fused_lm_head_logprob"):
            return inner
    return config


def _check_config(config: Any) -> None:
    trainer = _trainer_config(config)
    if not getattr(trainer, "fused_lm_head_logprob", False):
        raise ValueError(
            "lp_megatron.skyrl.use_lp replaces SkyRL's fused LM-head path, which this trainer "
            "config does not enable: set trainer.fused_lm_head_logprob=true (with "
            "trainer.strategy=megatron)"
        )
    strategy = getattr(trainer, "strategy", "megatron")
    if strategy != "megatron":
        raise ValueError(
            f"trainer.fused_lm_head_logprob is Megatron only; trainer.strategy is {strategy!r}"
        )


def _seam_module() -> Any:
    """SkyRL's ``model_utils``, after the version and signature checks."""
    version = skyrl_version()
    if version != SUPPORTED_VERSION:
        raise RuntimeError(
            f"lp_megatron.skyrl supports skyrl {SUPPORTED_VERSION} (its private "
            f"{_SEAM} was read there); found skyrl {version}"
        )
    module = importlib.import_module(_MODEL_UTILS)
    names = tuple(inspect.signature(getattr(module, _SEAM)).parameters)
    if names != _SEAM_PARAMETERS:
        raise RuntimeError(
            f"skyrl {version}'s {_SEAM} takes {names}, not the arguments lp_megatron.skyrl "
            f"replaces {_SEAM_PARAMETERS}"
        )
    for name in _LOGPROBS:
        if "temperature" not in inspect.signature(getattr(module, name)).parameters:
            raise RuntimeError(f"skyrl {version}'s {name} takes no temperature")
    return module


def _tp_layout(group: Any) -> tuple[Any, int]:
    """``(group or None, size)`` of SkyRL's tensor-parallel group."""
    if group is None or not torch.distributed.is_initialized():
        return None, 1
    size = torch.distributed.get_world_size(group)
    return (group, size) if size > 1 else (None, 1)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), t.shape, t.stride())


def _columns(whole: tuple, part: torch.Tensor) -> slice | None:
    """The columns of a ``[B, S, H]`` tensor (by its :func:`_view_key`) that ``part`` views."""
    ptr, device, offset, shape, stride = whole
    if part.dim() != 3 or (part.untyped_storage().data_ptr(), part.device) != (ptr, device):
        return None
    if part.stride() != stride or part.shape[0] != shape[0] or part.shape[2] != shape[2]:
        return None
    start, rest = divmod(part.storage_offset() - offset, stride[1])
    if rest or start < 0 or start + part.shape[1] > shape[1]:
        return None
    return slice(start, start + part.shape[1])


@dataclass(frozen=True)
class _Options:
    deterministic: bool
    backend: Literal["auto", "torch", "triton"]
    chunk_size: int | None


class LpFusedLMHead:
    """Handle returned by :func:`use_lp`; ``remove()`` restores SkyRL's functions.

    Also a context manager. ``entropy_reused`` counts the entropy requests served from a
    log-prob call's own entropy (no second pass over the vocabulary).
    """

    def __init__(self, module: Any, options: _Options) -> None:
        self.options = options
        self.entropy_reused = 0
        self._module = module
        self._originals: dict[str, Callable[..., Any]] = {}
        self._temperature = 1.0
        self._checked: set[tuple] = set()
        self._stash: tuple | None = None  # (hidden view key, weight, T, entropy [B, S])

    # -- SkyRL's seam --------------------------------------------------------------------
    def fused_logprob_apply(
        self,
        backend: str,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: Any,
        inference_only: bool,
    ) -> torch.Tensor:
        """SkyRL's ``_fused_lm_head_logprob_apply`` contract, computed by lp.

        Args:
            backend, chunk_size: SkyRL's options; unused (lp's ``use_lp`` options apply).
            hidden: ``[B, S, H]`` decoder output (this rank's copy of the whole sequence).
            weight: ``[V/P, H]`` this rank's output weight shard (``W / T`` when a caller
                divided it; SkyRL's own callers no longer do while installed).
            target: ``[B, S]`` int64 global ids, already rolled.
            vocab_start_index, vocab_end_index: this rank's rows ``[start, end)``.
            tp_group: the tensor-parallel group.
            inference_only: no autograd graph.

        Returns:
            ``[B, S]`` float32 log-probs, the same on every rank; 0 for a target outside
            every shard. The hidden gradient is this rank's partial.
        """
        del backend, chunk_size
        group, size = _tp_layout(tp_group)
        rows = weight.shape[0]
        if vocab_end_index - vocab_start_index != rows:
            raise ValueError(
                f"SkyRL's vocabulary bounds [{vocab_start_index}, {vocab_end_index}) do not "
                f"match the weight shard's {rows} rows"
            )
        outside = (target < 0) | (target >= rows * size)  # SkyRL: even shards
        grad = contextlib.nullcontext() if not inference_only else torch.no_grad()
        with grad:
            out = self._linear_logprob(
                hidden, weight, size, targets=target.masked_fill(outside, 0), tp_group=group,
                vocab_start=vocab_start_index, temperature=self._temperature,
                return_entropy=not inference_only, return_lse=True,
            )  # fmt: skip
            # SkyRL gives such a target 0 and the gradient of -lse (its one-hot is empty)
            logprob = torch.where(outside, out.lse.detach() - out.lse, out.logprob)
        self._stash = None
        if out.entropy is not None and hidden.dim() == 3:
            self._stash = (_view_key(hidden), weight, self._temperature, out.entropy)
        return logprob

    def entropy_from_hidden(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        tp_group: Any,
        chunk_size: int | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """SkyRL's ``_fused_vocab_parallel_entropy_from_hidden``: ``[B, S']`` float32 entropy
        of ``softmax(hidden @ W.T / T)``, differentiable; from the last log-prob call when
        ``hidden`` is a slice of its hidden state (same weight and temperature)."""
        del chunk_size
        stash, self._stash = self._stash, None
        if stash is not None and stash[1] is lm_head_weight and stash[2] == temperature:
            columns = _columns(stash[0], hidden)
            if columns is not None:
                self.entropy_reused += 1
                return stash[3][:, columns]
        group, size = _tp_layout(tp_group)
        rank = torch.distributed.get_rank(group) if group is not None else 0
        # any valid id, the same on every rank: only the entropy is kept
        targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
        out = self._linear_logprob(
            hidden, lm_head_weight, size, targets=targets, tp_group=group,
            vocab_start=rank * lm_head_weight.shape[0], temperature=temperature,
            return_entropy=True,
        )  # fmt: skip
        return out.entropy

    def _linear_logprob(
        self, hidden: torch.Tensor, weight: torch.Tensor, size: int, **kwargs: Any
    ) -> Any:
        """lp on this rank's shard; ``validate=True`` until a call of this layout succeeded."""
        layout = (weight.shape, size, weight.dtype, hidden.dtype, hidden.device)
        out = _lp().linear_logprob(
            hidden, weight, reduce_grad_hidden=False, deterministic=self.options.deterministic,
            backend=self.options.backend, chunk_size=self.options.chunk_size,
            validate=layout not in self._checked, **kwargs,
        )  # fmt: skip
        self._checked.add(layout)
        return out

    def _temperature_to_lp(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` called with ``temperature=1.0`` while lp applies ``T`` (no W / T)."""
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self._temperature = float(bound.arguments["temperature"])
            bound.arguments["temperature"] = 1.0
            try:
                return original(*bound.args, **bound.kwargs)
            finally:
                self._temperature = 1.0

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    # -- install / remove ----------------------------------------------------------------
    def _replacements(self) -> dict[str, Callable[..., Any]]:
        module = self._module
        out: dict[str, Callable[..., Any]] = {
            _SEAM: self.fused_logprob_apply,
            _ENTROPY: self.entropy_from_hidden,
        }
        for name in _LOGPROBS:
            out[name] = self._temperature_to_lp(getattr(module, name))
        return out

    def _install(self) -> None:
        replacements = self._replacements()
        for name, new in replacements.items():
            self._originals[name] = getattr(self._module, name)
            setattr(self._module, name, new)
        worker = sys.modules.get(_WORKER)  # imported later, it binds the names set above
        if worker is not None:
            for name, new in replacements.items():
                if getattr(worker, name, None) is self._originals[name]:
                    setattr(worker, name, new)

    def remove(self) -> None:
        """Restore SkyRL's functions (in its modules where they are still lp's). Idempotent."""
        for module in (self._module, sys.modules.get(_WORKER)):
            if module is None:
                continue
            for name, original in self._originals.items():
                current = getattr(module, name, None)
                if getattr(current, "__self__", None) is self or (
                    getattr(current, "__wrapped__", None) is original
                ):
                    setattr(module, name, original)
        self._originals.clear()
        self._stash = None

    @property
    def installed(self) -> bool:
        """True from :func:`use_lp` until :meth:`remove`."""
        return bool(self._originals)

    def __enter__(self) -> LpFusedLMHead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _lp() -> Any:
    return importlib.import_module("lp_kernels")


def use_lp(
    config: Any,
    *,
    deterministic: bool = False,
    backend: Literal["auto", "torch", "triton"] = "auto",
    chunk_size: int | None = None,
) -> LpFusedLMHead:
    """Make SkyRL's Megatron fused LM-head path compute with lp (this process).

    Call it once in each Megatron worker process, before or after the worker is built,
    with the trainer config; ``trainer.fused_lm_head_logprob_backend`` is then not used.

    Args:
        config: SkyRL's ``TrainerConfig`` (or an object with it as ``.trainer``, or the
            ``MegatronModelWrapper``, ``.cfg``); ``fused_lm_head_logprob`` must be true.
        deterministic: lp's TP-invariant mode (shard bounds multiples of 128, as
            Megatron's vocabulary padding gives).
        backend: lp's backend, ``"auto"`` (triton on CUDA, else torch), ``"torch"`` or
            ``"triton"``.
        chunk_size: lp's token rows per step of the torch backend (None: lp's default).

    Returns:
        An :class:`LpFusedLMHead`; ``remove()`` (or leaving its ``with`` block) restores
        SkyRL's functions. A second call with the same options returns the same handle.

    Raises:
        ValueError: the config does not enable the fused path
            (``trainer.fused_lm_head_logprob``), or it is not the Megatron strategy.
        RuntimeError: a ``skyrl`` version other than :data:`SUPPORTED_VERSION`, a seam
            whose signature differs, or lp installed with other options.

    Example:
        >>> from lp_megatron.skyrl import use_lp  # doctest: +SKIP
        >>> handle = use_lp(cfg.trainer, deterministic=True)  # doctest: +SKIP
    """
    _check_config(config)
    options = _Options(deterministic=deterministic, backend=backend, chunk_size=chunk_size)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    module = _seam_module()
    current = getattr(getattr(module, _SEAM), "__self__", None)
    if isinstance(current, LpFusedLMHead):
        if current.options != options:
            raise RuntimeError(
                f"lp is already SkyRL's fused LM-head backend with {current.options}; call "
                "remove() on its handle first"
            )
        return current
    handle = LpFusedLMHead(module, options)
    handle._install()
    return handle
