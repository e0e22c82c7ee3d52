"""What ``lp bench`` times: named providers that set up one step, and nothing else.

A provider turns ``(mode, entropy, temperature, softcap, bias)`` into a :class:`Prepared`
step ``step(hidden, weight, targets, grad_out, grad_entropy, bias=None) -> (logprob,
entropy)``:

- ``train``: forward, then backward with the per-token upstream gradient ``grad_out`` on
  logprob (and ``grad_entropy`` on entropy when the step computes it); the harness reads
  the gradients from ``hidden.grad`` / ``weight.grad`` (and ``bias.grad``);
- ``fwd``: forward only; the harness calls it under ``torch.no_grad`` with inputs that do
  not require grad (what a trainer does for reference and old-policy log-probs).

It returns the detached per-token outputs (None where a provider has none), which the
harness compares with the reference. Timing, memory and errors are the harness's
(:mod:`lp_bench.protocol`), the same for every provider.

With ``softcap=c`` the logits are capped, ``c * tanh(l / c)``, before the temperature;
with a bias (the step's ``bias [V]``, given when the provider was made with
``bias=True``), ``l = hidden @ weight.T + bias``. lp's providers pass both to
``linear_logprob``; peers whose installed function does not take them are skipped.

Providers: ``lp-triton``, ``lp-torch``, ``lp-auto`` (lp's backends), their ``-det``
variants (``deterministic=True`` with its default tile), ``lp-triton-det128``
(``deterministic_tile=128``), ``materialized`` (logits in the input dtype, the bias and
the cap applied to them there as HF Gemma 2 does, fp32 ``log_softmax``, gather: what a
trainer without lp writes) and peers when importable, never
dependencies: ``liger`` (liger-kernel's fused linear cross entropy; a scalar loss, so
timing and memory only) and ``cce`` (Apple's cut-cross-entropy, per-token). Peers have no
entropy: with entropy requested they run logprob only and say so (:attr:`Prepared.note`).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from lp_bench.environment import triton_interpreting

Mode = Literal["train", "fwd"]
MODES: tuple[Mode, ...] = ("train", "fwd")

LP_PROVIDERS = (
    "lp-triton",
    "lp-torch",
    "lp-auto",
    "lp-triton-det",
    "lp-torch-det",
    "lp-triton-det128",
)
"""lp's backends; ``-det``: ``deterministic=True`` (bitwise TP-invariant) with its default
tile, ``-det128`` the same with 128-column tiles."""
PEERS = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}  # provider -> module
ALL_PROVIDERS = (*LP_PROVIDERS, "materialized", *PEERS)
TRITON_PROVIDERS = ("lp-triton", "lp-triton-det", "lp-triton-det128")

# step(hidden, weight, targets, grad_out, grad_entropy, bias=None)
#     -> (logprob | None, entropy | None)
Step = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


class Unsupported(Exception):
    """A provider cannot run this configuration (its row is marked skipped)."""


@dataclass(frozen=True)
class Prepared:
    """A provider's step for one configuration."""

    step: Step
    """The step (see the module docstring)."""
    entropy: bool
    """Whether the step computes entropy (and, in train mode, its gradient)."""
    note: str | None = None
    """What differs from the requested configuration (e.g. logprob only), or None."""


def is_deterministic(name: str) -> bool | None:
    """``deterministic=True`` for lp's ``-det`` providers, False for lp's others, None for
    providers that have no such mode."""
    return ("-det" in name) if name in LP_PROVIDERS else None


def finish(mode: Mode, outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """The backward of a train step: ``grads[i]`` is the upstream gradient of ``outputs[i]``."""
    if mode == "train":
        torch.autograd.backward(outputs, grads)


def finished(
    mode: Mode,
    logprob: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A step's end: :func:`finish` over the outputs it has (``entropy`` None: logprob only),
    then those outputs detached, ``(logprob, entropy or None)``."""
    if entropy is None:
        finish(mode, [logprob], [grad_out])
        return logprob.detach(), None
    finish(mode, [logprob, entropy], [grad_out, grad_entropy])
    return logprob.detach(), entropy.detach()


def materialized_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int | None = None,
    entropy: bool = False,
    lse: bool = False,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> dict[str, torch.Tensor]:
    """What a naive trainer computes: ``[N, V]`` logits in the input dtype, fp32 softmax.

    The model's head, ``F.linear(hidden, weight, bias)``, and its final-logit cap
    ``tanh(logits / c) * c`` run in the logits' dtype (as HF Gemma 2 does); the capped
    logits are upcast to fp32, divided by the temperature and go through ``log_softmax``.
    Returns ``logprob`` (and ``entropy``, ``lse`` when asked) ``[N]`` float32, differentiable;
    with ``ignore_index``, rows with that target are 0.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [N, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]
    keep = None if ignore_index is None else targets != ignore_index
    index = targets if keep is None else torch.where(keep, targets, 0)
    out = {"logprob": logp.gather(1, index[:, None]).squeeze(1)}
    if entropy:
        out["entropy"] = -(logp.exp() * logp).sum(-1)
    if lse:
        out["lse"] = torch.logsumexp(logits, dim=-1)
    if keep is not None:
        out = {k: torch.where(keep, x, 0.0) for k, x in out.items()}
    return out


def provider_lp(
    backend: str,
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    deterministic: bool = False,
    tile: int | None = None,
    tp: dict | None = None,
    softcap: float | None = None,
) -> Prepared:
    """lp's ``linear_logprob``; ``tp``: ``tp_group``, ``vocab_start``, ``vocab_size`` kwargs;
    ``tile``: ``deterministic_tile`` (None: the default); the step's ``bias`` (this rank's
    shard under TP) and ``softcap`` go to ``linear_logprob`` as they are."""
    from lp_kernels import linear_logprob

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        out = linear_logprob(
            hidden,
            weight,
            targets,
            bias=bias,
            softcap=softcap,
            temperature=temperature,
            return_entropy=entropy,
            backend=backend,
            validate=False,
            deterministic=deterministic,
            deterministic_tile=tile,
            **(tp or {}),
        )
        ent = out.entropy if entropy else None
        return finished(mode, out.logprob, ent, grad_out, grad_entropy)

    return Prepared(step, entropy)


def provider_materialized(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
) -> Prepared:
    """The materialized-logits path (:func:`materialized_outputs`)."""

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        out = materialized_outputs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            entropy=entropy,
            bias=bias,
            softcap=softcap,
        )
        return finished(mode, out["logprob"], out.get("entropy"), grad_out, grad_entropy)

    return Prepared(step, entropy)


def _peer_check(name: str, temperature: float) -> None:
    if importlib.util.find_spec(PEERS[name]) is None:
        raise Unsupported(f"{PEERS[name]} is not importable")
    if temperature != 1.0:
        raise Unsupported("peers run at temperature 1 only")


def peer_options(name: str, fn: Callable, *, softcap: float | None, bias: bool) -> dict:
    """The ``softcap=`` keyword for peer ``name``'s function ``fn`` (empty without a cap);
    raises :class:`Unsupported` when the installed ``fn`` takes no ``softcap`` / ``bias``
    keyword that the run needs. The bias itself is passed at each step."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: nothing can be claimed
        params = {}
    for option, needed in (("softcap", softcap is not None), ("bias", bias)):
        if needed and option not in params:
            raise Unsupported(f"the installed {PEERS[name]} takes no {option}=")
    return {} if softcap is None else {"softcap": softcap}


def with_bias(options: dict, bias: torch.Tensor | None) -> dict:
    """A peer's keywords ``options`` (from :func:`peer_options`) with the step's ``bias=``."""
    return options if bias is None else {**options, "bias": bias}


def _logprob_only(name: str, entropy: bool) -> str | None:
    return f"logprob only: {name} has no entropy" if entropy else None


def provider_liger(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
) -> Prepared:
    """liger-kernel's fused linear cross entropy; its backward is fused into the forward for
    a scalar loss, so it runs as ``sum(CE)`` (timing and memory only, no per-token output).
    ``softcap`` and the bias go to its ``softcap=`` and ``bias=`` keywords."""
    _peer_check("liger", temperature)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    opts = peer_options("liger", liger_fused_linear_cross_entropy, softcap=softcap, bias=bias)

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        extra = with_bias(opts, bias)
        loss = liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", **extra)
        if mode == "train":
            loss.backward()
        return None, None

    return Prepared(step, False, _logprob_only("liger", entropy))


def provider_cce(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
) -> Prepared:
    """Apple's cut-cross-entropy, per-token loss (``logprob = -loss``), default settings;
    ``softcap`` and the bias go to its ``softcap=`` and ``bias=`` keywords."""
    _peer_check("cce", temperature)
    from cut_cross_entropy import linear_cross_entropy

    opts = peer_options("cce", linear_cross_entropy, softcap=softcap, bias=bias)

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        extra = with_bias(opts, bias)
        logprob = -linear_cross_entropy(hidden, weight, targets, reduction="none", **extra)
        return finished(mode, logprob, None, grad_out, None)

    return Prepared(step, False, _logprob_only("cce", entropy))


def make_provider(
    name: str,
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    tp: dict | None = None,
    softcap: float | None = None,
    bias: bool = False,
) -> Prepared:
    """The step of provider ``name``; raises :class:`Unsupported` where it cannot run.

    ``softcap``: the final-logit cap, or None; ``bias``: whether the harness passes a
    ``[V_local]`` bias to each step (the step's ``bias=``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if softcap is not None and not (0 < softcap < float("inf")):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if name in LP_PROVIDERS:
        backend = name.removeprefix("lp-").removesuffix("128").removesuffix("-det")
        return provider_lp(
            backend,
            mode=mode,
            temperature=temperature,
            entropy=entropy,
            deterministic=is_deterministic(name) is True,
            tile=128 if name.endswith("-det128") else None,
            tp=tp,
            softcap=softcap,
        )
    if name not in ALL_PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(ALL_PROVIDERS)}")
    if tp is not None:
        raise Unsupported("a single-device provider (lp bench under tensor parallelism)")
    factory = {
        "materialized": provider_materialized,
        "liger": provider_liger,
        "cce": provider_cce,
    }[name]
    return factory(mode=mode, temperature=temperature, entropy=entropy, softcap=softcap, bias=bias)


def provider_available(name: str, device: str) -> str | None:
    """None if ``name`` can run on ``device``, else why not."""
    if name in PEERS:
        if importlib.util.find_spec(PEERS[name]) is None:
            return f"{PEERS[name]} is not importable"
        if device != "cuda":
            return "peers run on CUDA only"
    if name in TRITON_PROVIDERS:
        if importlib.util.find_spec("triton") is None:
            return "triton is not importable"
        if device != "cuda" and not triton_interpreting():
            return "the triton backend needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    return None


def default_providers(device: str, *, grid: bool = False) -> list[str]:
    """The providers of a plain ``lp bench`` on ``device`` (those that can run there);
    ``grid``: those of ``lp bench --grid``, lp's default and ``deterministic=True`` paths of
    its main backend (triton on CUDA, torch on CPU) beside the materialized path and peers."""
    if device == "cuda":
        names = ["lp-triton", "lp-triton-det"] if grid else ["lp-triton", "lp-torch"]
        names += ["materialized", *PEERS]
    else:
        names = ["lp-torch", "lp-torch-det"] if grid else ["lp-torch"]
        names += ["materialized"]
    return [n for n in names if provider_available(n, device) is None]
