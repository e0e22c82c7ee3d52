"""What ``lp bench`` times: named providers that set up one step, and nothing else.

A provider turns ``(mode, entropy, temperature, softcap, bias)`` into a :class:`Prepared`
step ``step(hidden, weight, targets, grad_out, grad_entropy, bias=None)``:

- ``train``: forward, then backward with the per-token upstream gradient ``grad_out`` on
  logprob (and ``grad_entropy`` on entropy when the step computes it); the harness reads
  the gradients from ``hidden.grad`` / ``weight.grad`` (and ``bias.grad``);
- ``fwd``: forward only; the harness calls it under ``torch.no_grad`` with inputs that do
  not require grad (what a trainer does for reference and old-policy log-probs);
- ``loss``: forward + backward of a per-token RL loss summed over the rows, the
  :class:`LossProblem` given to the provider (its ``loss_fn`` and per-token inputs); the
  upstream gradients are unused, the loss's own derivatives take their place.

A ``train`` / ``fwd`` step returns the detached per-token outputs ``(logprob, entropy)``, a
``loss`` step ``(logprob, entropy, loss)`` with the detached scalar loss (None where a
provider has no such output), which the harness compares with the reference. Timing,
memory and errors are the harness's (:mod:`lp_bench.protocol`), the same for every provider.

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
timing and memory only), ``cce`` (Apple's cut-cross-entropy, per-token) and ``trl`` (TRL's
fused head, ``trl.kernels.ChunkedLogProbFunction``, as its trainers call it: per-token
logprob and entropy, every logit option). liger and cce have no entropy: with entropy
requested they run logprob only and say so (:attr:`Prepared.note`).

In ``loss`` mode: ``lp-loss-triton``, ``lp-loss-torch``, ``lp-loss-auto`` and their
``-det`` variants run ``linear_logprob_loss`` (the loss's gradients finished in the
forward: three GEMMs; ``-det``: its ``deterministic=True`` path, four); lp's
``linear_logprob`` providers and ``materialized`` compute the log-probs, then the same
``loss_fn`` and ``backward()``; ``liger`` runs liger-kernel's ``LigerFusedLinearGRPOLoss``
with the same clip bounds, KL coefficient and token-mean aggregation (no entropy bonus);
``trl`` computes the log-probs, then the same ``loss_fn`` (TRL's head plus the loss, as a
TRL trainer runs it); ``cce`` has no loss and is skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from lp_bench.environment import triton_interpreting

Mode = Literal["train", "fwd", "loss", "distill"]
MODES: tuple[Mode, ...] = ("train", "fwd", "loss", "distill")
"""Every mode of ``lp bench``; ``distill`` steps come from :mod:`lp_bench.distill`."""

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
LP_LOSS_PROVIDERS = (
    "lp-loss-triton",
    "lp-loss-torch",
    "lp-loss-auto",
    "lp-loss-triton-det",
    "lp-loss-torch-det",
)
"""``linear_logprob_loss`` on lp's backends (``loss`` mode only); ``-det``:
``deterministic=True``."""
PEERS = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "trl": "trl"}  # provider -> module
ALL_PROVIDERS = (*LP_PROVIDERS, *LP_LOSS_PROVIDERS, "materialized", *PEERS)
TRITON_PROVIDERS = (
    "lp-triton",
    "lp-triton-det",
    "lp-triton-det128",
    "lp-loss-triton",
    "lp-loss-triton-det",
)

# step(hidden, weight, targets, grad_out, grad_entropy, bias=None)
#     -> (logprob | None, entropy | None), and in loss mode (..., loss | None)
Step = Callable[..., tuple[torch.Tensor | None, ...]]


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


@dataclass(frozen=True)
class LossProblem:
    """The objective of a ``loss``-mode step (made once per shape by the harness)."""

    loss_fn: Callable[..., torch.Tensor]
    """``loss_fn(logprob, entropy, lse, **per_token) -> [N]`` per-token loss; the step's
    loss is its sum."""
    per_token: dict[str, torch.Tensor]
    """Its per-token keyword arguments, ``[N]`` fp32 on the inputs' device."""
    seq_len: int
    """Tokens per sequence: row ``i`` belongs to sequence ``i // seq_len`` (one advantage
    per sequence; a peer that takes ``[B, T]`` inputs needs ``N % seq_len == 0``)."""
    entropy: bool = False
    """Whether ``loss_fn`` reads the entropy (otherwise it is passed None)."""
    lse: bool = False
    """Whether ``loss_fn`` reads the log-sum-exp (otherwise it is passed None)."""


def is_deterministic(name: str) -> bool | None:
    """``deterministic=True`` for lp's ``-det`` providers, False for lp's others, None for
    providers that have no such mode."""
    return ("-det" in name) if name in (*LP_PROVIDERS, *LP_LOSS_PROVIDERS) else None


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


def loss_finished(
    problem: LossProblem,
    logprob: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A loss step's end after its log-probs: ``problem.loss_fn`` on them (``entropy`` and
    ``lse`` passed only where the loss reads them), summed, ``backward()``; returns the
    detached ``(logprob, entropy or None, loss)``."""
    ent = entropy if problem.entropy else None
    loss = problem.loss_fn(logprob, ent, lse if problem.lse else None, **problem.per_token).sum()
    loss.backward()
    return logprob.detach(), None if ent is None else ent.detach(), loss.detach()


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
    loss: LossProblem | None = None,
) -> Prepared:
    """lp's ``linear_logprob``; ``tp``: ``tp_group``, ``vocab_start``, ``vocab_size`` kwargs;
    ``tile``: ``deterministic_tile`` (None: the default); the step's ``bias`` (this rank's
    shard under TP) and ``softcap`` go to ``linear_logprob`` as they are. In ``loss`` mode
    the outputs that ``loss`` reads, then its ``loss_fn`` and ``backward()`` (four GEMMs)."""
    from lp_kernels import linear_logprob

    if mode == "loss":
        entropy = _loss_of(loss).entropy

    def step(hidden, weight, targets, grad_out=None, grad_entropy=None, bias=None):
        out = linear_logprob(
            hidden,
            weight,
            targets,
            bias=bias,
            softcap=softcap,
            temperature=temperature,
            return_entropy=entropy,
            return_lse=mode == "loss" and loss.lse,
            backend=backend,
            validate=False,
            deterministic=deterministic,
            deterministic_tile=tile,
            **(tp or {}),
        )
        ent = out.entropy if entropy else None
        if mode == "loss":
            return loss_finished(loss, out.logprob, ent, out.lse)
        return finished(mode, out.logprob, ent, grad_out, grad_entropy)

    return Prepared(step, entropy)


def provider_lp_loss(
    backend: str,
    *,
    temperature: float = 1.0,
    deterministic: bool = False,
    tp: dict | None = None,
    softcap: float | None = None,
    loss: LossProblem | None = None,
) -> Prepared:
    """lp's ``linear_logprob_loss`` (``loss`` mode): ``loss.loss_fn`` on ``loss.per_token``,
    the summed loss's ``backward()`` (which only scales the gradients finished in the
    forward); options as :func:`provider_lp`."""
    from lp_kernels import linear_logprob_loss

    problem = _loss_of(loss)

    def step(hidden, weight, targets, grad_out=None, grad_entropy=None, bias=None):
        out = linear_logprob_loss(
            hidden,
            weight,
            targets,
            problem.loss_fn,
            per_token=problem.per_token,
            return_entropy=problem.entropy,
            bias=bias,
            softcap=softcap,
            temperature=temperature,
            backend=backend,
            validate=False,
            deterministic=deterministic,
            **(tp or {}),
        )
        out.loss.backward()
        return out.logprob, out.entropy, out.loss.detach()

    return Prepared(step, problem.entropy)


def _loss_of(loss: LossProblem | None) -> LossProblem:
    if loss is None:
        raise ValueError("mode='loss' needs the step's LossProblem (loss=)")
    return loss


def provider_materialized(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
    loss: LossProblem | None = None,
) -> Prepared:
    """The materialized-logits path (:func:`materialized_outputs`); in ``loss`` mode followed
    by ``loss.loss_fn`` and ``backward()``."""
    if mode == "loss":
        entropy = _loss_of(loss).entropy

    def step(hidden, weight, targets, grad_out=None, grad_entropy=None, bias=None):
        out = materialized_outputs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            entropy=entropy,
            lse=mode == "loss" and loss.lse,
            bias=bias,
            softcap=softcap,
        )
        if mode == "loss":
            return loss_finished(loss, out["logprob"], out.get("entropy"), out.get("lse"))
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
    loss: LossProblem | None = None,
) -> Prepared:
    """liger-kernel's fused linear cross entropy; its backward is fused into the forward for
    a scalar loss, so it runs as ``sum(CE)`` (timing and memory only, no per-token output).
    ``softcap`` and the bias go to its ``softcap=`` and ``bias=`` keywords. In ``loss``
    mode: :func:`provider_liger_grpo`."""
    _peer_check("liger", temperature)
    if mode == "loss":
        return provider_liger_grpo(softcap=softcap, bias=bias, loss=_loss_of(loss))
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    opts = peer_options("liger", liger_fused_linear_cross_entropy, softcap=softcap, bias=bias)

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        extra = with_bias(opts, bias)
        loss = liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", **extra)
        if mode == "train":
            loss.backward()
        return None, None

    return Prepared(step, False, _logprob_only("liger", entropy))


LIGER_GRPO_KEYWORDS = ("beta", "epsilon_low", "epsilon_high", "loss_type", "use_ref_model")
"""The ``LigerFusedLinearGRPOLoss`` constructor keywords that :func:`provider_liger_grpo`
sets (older liger-kernel versions lack some: the row is then skipped)."""


def provider_liger_grpo(*, softcap: float | None, bias: bool, loss: LossProblem) -> Prepared:
    """liger-kernel's ``LigerFusedLinearGRPOLoss`` (``loss`` mode), default chunking and
    compilation, configured as ``loss.loss_fn``: ``epsilon_low`` / ``epsilon_high`` its clip
    bounds, ``beta`` its k3 KL coefficient against ``ref_per_token_logps``, and
    ``loss_type="bnpo"``, the masked token sum over the token count (on one device the same
    as DAPO's token-mean, which ``loss.per_token["weights"]`` must be).

    Its inputs are ``[B, T]`` sequences (one advantage per sequence), so ``N`` must be a
    multiple of ``loss.seq_len``. A scalar loss and the gradients; no per-token outputs.
    Raises :class:`Unsupported` for a loss it cannot express (entropy bonus, z-loss, dual
    clip, another KL estimator, non-uniform weights) or an installed version without the
    keywords it needs.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    fn = loss.loss_fn
    fields = {k: getattr(fn, k, None) for k in ("entropy_coef", "z_loss_coef", "dual_clip")}
    if getattr(fn, "clip_low", None) is None or getattr(fn, "kl_coef", None) is None:
        raise Unsupported("liger's GRPO loss runs a lp_kernels.losses.PolicyLoss only")
    if loss.entropy or fields["entropy_coef"] or fields["z_loss_coef"] or fields["dual_clip"]:
        raise Unsupported("liger's GRPO loss has no entropy bonus, z-loss or dual clip")
    if fn.kl_coef and getattr(fn, "kl_estimator", None) != "k3":
        raise Unsupported("liger's GRPO loss has the k3 KL estimator only")
    params = inspect.signature(LigerFusedLinearGRPOLoss.__init__).parameters
    missing = [k for k in LIGER_GRPO_KEYWORDS if k not in params]
    forward = inspect.signature(LigerFusedLinearGRPOLoss.forward).parameters
    missing += [k for k in ("ref_per_token_logps", "old_per_token_logps") if k not in forward]
    if missing:
        raise Unsupported(f"the installed liger_kernel's GRPO loss takes no {', '.join(missing)}")
    if softcap is not None:
        raise Unsupported("the installed liger_kernel's GRPO loss takes no softcap=")
    if bias and "bias" not in forward:
        raise Unsupported("the installed liger_kernel's GRPO loss takes no bias=")
    per_token, t = loss.per_token, loss.seq_len
    n = per_token["advantages"].numel()
    if n % t:
        raise Unsupported(
            f"liger's GRPO loss takes [B, T] sequences: N={n} is not a multiple of T={t}"
        )
    weights = per_token.get("weights")
    if weights is not None and not bool((weights == weights[0]).all()):
        raise Unsupported("liger's GRPO loss aggregates by token-mean only (uniform weights)")
    module = LigerFusedLinearGRPOLoss(
        beta=float(fn.kl_coef),
        epsilon_low=float(fn.clip_low),
        epsilon_high=float(fn.clip_high),
        loss_type="bnpo",
        use_ref_model=bool(fn.kl_coef),
    )
    b = n // t
    advantages = per_token["advantages"].view(b, t)[:, 0].contiguous()  # [B]
    seq = {k: per_token[k].view(b, t) for k in ("old_logprob", "ref_logprob")}
    mask = torch.ones(b, t, dtype=torch.int64, device=advantages.device)

    def step(hidden, weight, targets, grad_out=None, grad_entropy=None, bias=None):
        out = module(
            hidden.view(b, t, -1),
            weight,
            targets.view(b, t),
            mask,
            advantages,
            **({} if bias is None else {"bias": bias}),
            ref_per_token_logps=seq["ref_logprob"] if fn.kl_coef else None,
            old_per_token_logps=seq["old_logprob"],
        )
        value = out[0] if isinstance(out, tuple) else out  # (loss, metrics) in newer versions
        value.backward()
        return None, None, value.detach()

    return Prepared(step, False)


def provider_cce(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
    loss: LossProblem | None = None,
) -> Prepared:
    """Apple's cut-cross-entropy, per-token loss (``logprob = -loss``), default settings;
    ``softcap`` and the bias go to its ``softcap=`` and ``bias=`` keywords. No ``loss``
    mode (it has no RL loss of its own)."""
    if mode == "loss":
        raise Unsupported("cut-cross-entropy has no RL loss (loss mode)")
    _peer_check("cce", temperature)
    from cut_cross_entropy import linear_cross_entropy

    opts = peer_options("cce", linear_cross_entropy, softcap=softcap, bias=bias)

    def step(hidden, weight, targets, grad_out, grad_entropy=None, bias=None):
        extra = with_bias(opts, bias)
        logprob = -linear_cross_entropy(hidden, weight, targets, reduction="none", **extra)
        return finished(mode, logprob, None, grad_out, None)

    return Prepared(step, False, _logprob_only("cce", entropy))


TRL_VOCAB_CHUNK = 32768
"""The vocabulary chunk TRL 1.16's trainers pass to ``ChunkedLogProbFunction``."""


def provider_trl(
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    bias: bool = False,
    loss: LossProblem | None = None,
) -> Prepared:
    """TRL's fused LM head, ``trl.kernels.ChunkedLogProbFunction``, with the vocabulary chunk
    TRL's trainers use: logprob (and entropy) per token, ``softcap`` as its
    ``final_logit_softcapping``, the temperature and the bias as they are. In ``loss`` mode
    the log-probs, then ``loss.loss_fn`` and ``backward()``, as a TRL trainer does."""
    if importlib.util.find_spec(PEERS["trl"]) is None:
        raise Unsupported("trl is not importable")
    from trl.kernels import ChunkedLogProbFunction

    if mode == "loss":
        entropy = _loss_of(loss).entropy
    if mode == "loss" and loss.lse:
        raise Unsupported("TRL's head returns no log-sum-exp")
    outputs = ("entropy",) if entropy else ()

    def step(hidden, weight, targets, grad_out=None, grad_entropy=None, bias=None):
        logprob, ent, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, bias, targets, temperature, TRL_VOCAB_CHUNK, softcap, 1.0, outputs
        )
        if mode == "loss":
            return loss_finished(loss, logprob, ent, None)
        return finished(mode, logprob, ent, grad_out, grad_entropy)

    return Prepared(step, entropy)


def make_provider(
    name: str,
    *,
    mode: Mode = "train",
    temperature: float = 1.0,
    entropy: bool = False,
    tp: dict | None = None,
    softcap: float | None = None,
    bias: bool = False,
    loss: LossProblem | None = None,
) -> Prepared:
    """The step of provider ``name``; raises :class:`Unsupported` where it cannot run.

    ``softcap``: the final-logit cap, or None; ``bias``: whether the harness passes a
    ``[V_local]`` bias to each step (the step's ``bias=``); ``loss``: the objective of a
    ``loss``-mode step (its ``entropy`` decides whether the step computes the entropy; the
    ``entropy`` argument is then unused)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "distill":
        raise ValueError("distill-mode steps come from lp_bench.distill.make_distill_provider")
    if softcap is not None and not (0 < softcap < float("inf")):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if mode == "loss":
        _loss_of(loss)
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
            loss=loss,
        )
    if name in LP_LOSS_PROVIDERS:
        if mode != "loss":
            raise Unsupported(f"{name} runs in loss mode only (--mode loss)")
        return provider_lp_loss(
            name.removeprefix("lp-loss-").removesuffix("-det"),
            temperature=temperature,
            deterministic=is_deterministic(name) is True,
            tp=tp,
            softcap=softcap,
            loss=loss,
        )
    if name not in ALL_PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(ALL_PROVIDERS)}")
    if tp is not None:
        raise Unsupported("a single-device provider (lp bench under tensor parallelism)")
    factory = {
        "materialized": provider_materialized,
        "liger": provider_liger,
        "cce": provider_cce,
        "trl": provider_trl,
    }[name]
    options = {"temperature": temperature, "entropy": entropy, "softcap": softcap, "bias": bias}
    return factory(mode=mode, loss=loss, **options)


def provider_available(name: str, device: str) -> str | None:
    """None if ``name`` can run on ``device``, else why not."""
    if name in PEERS:
        if importlib.util.find_spec(PEERS[name]) is None:
            return f"{PEERS[name]} is not importable"
        if device != "cuda" and name != "trl":  # TRL's head has a torch path off CUDA
            return "liger and cce run on CUDA only"
    if name in TRITON_PROVIDERS:
        if importlib.util.find_spec("triton") is None:
            return "triton is not importable"
        if device != "cuda" and not triton_interpreting():
            return "the triton backend needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    return None


def default_providers(
    device: str, *, grid: bool = False, modes: tuple[Mode, ...] = ("train",)
) -> list[str]:
    """The providers of a plain ``lp bench`` on ``device`` (those that can run there);
    ``grid``: those of ``lp bench --grid``, lp's default and ``deterministic=True`` paths of
    its main backend (triton on CUDA, torch on CPU) beside the materialized path and peers.
    ``modes``: with ``loss`` among them, ``linear_logprob_loss`` (default and
    ``deterministic=True``) on that backend joins them (with other modes too, each mode's
    rows of a provider that does not run there are marked skipped). ``distill``:
    ``linear_divergence`` (lp-torch, lp-torch-det; lp-triton too on CUDA) and
    ``linear_divergence_loss`` (lp-loss-triton on CUDA, else lp-loss-torch), the materialized
    path, liger (kind jsd only) and trl where importable."""
    main = "triton" if device == "cuda" else "torch"
    names: list[str] = []
    logprob_modes = any(mode in ("train", "fwd") for mode in modes)
    if logprob_modes:
        if device == "cuda":
            names += ["lp-triton", "lp-triton-det"] if grid else ["lp-triton", "lp-torch"]
        else:
            names += ["lp-torch", "lp-torch-det"] if grid else ["lp-torch"]
    if "loss" in modes:
        names += [f"lp-loss-{main}", f"lp-loss-{main}-det", f"lp-{main}"]
    if "distill" in modes:
        names += ["lp-triton"] if device == "cuda" else []
        names += ["lp-torch", "lp-torch-det"]
        names += ["lp-loss-triton"] if device == "cuda" else ["lp-loss-torch"]
    names += ["materialized", "liger", "trl"] if device == "cuda" else ["materialized"]
    if "distill" in modes:
        names.append("trl")  # TRL's divergence has a torch path off CUDA
    if device == "cuda" and logprob_modes:
        names.append("cce")
    names = list(dict.fromkeys(names))
    return [n for n in names if provider_available(n, device) is None]
