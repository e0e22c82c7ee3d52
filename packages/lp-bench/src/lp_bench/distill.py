"""What ``lp bench --mode distill`` times: a divergence between a student and a teacher head.

The problem, per shape ``(N, H, V)`` and teacher scale ``s``::

    student: hidden [N, H], weight [V, H]          (differentiable)
    teacher: teacher_hidden [N, s H], teacher_weight [V, s H]   (constants)
    z_s = hidden @ weight.T / T,  z_t = teacher_hidden @ teacher_weight.T / T
    p = softmax(z_s),  q = softmax(z_t)
    forward_kl: KL(q || p);  reverse_kl: KL(p || q)
    jsd: m = beta q + (1 - beta) p,  beta KL(q || m) + (1 - beta) KL(p || m)

A step is forward + backward of ``sum(divergence * grad_out)`` (a per-row upstream
gradient) into ``hidden`` and ``weight``. The teacher's logits are correlated with the
student's (:func:`make_teacher`: ``z_t = rho z_s + sqrt(1 - rho^2) z_extra``, each of std
about 2), so the divergences are those of a student near its teacher, not of two random
heads.

Providers (:func:`make_distill_provider`) return ``Prepared`` steps
``step(hidden, weight) -> (divergence | None, loss | None)``, both detached, the
gradients left in ``hidden.grad`` / ``weight.grad``:

- ``lp-torch``, ``lp-auto``, ``lp-triton`` and ``-det`` (``deterministic=True``):
  ``lp_kernels.linear_divergence``; a configuration it rejects with ValueError (a backend
  or ``deterministic`` it does not have yet) is reported :class:`Unsupported`, with its
  message, from a probe call on a tiny problem;
- ``materialized``: both ``[N, V]`` logits from GEMMs in the input dtype, upcast to fp32,
  ``log_softmax``, the divergence with ``F.kl_div(..., log_target=True)`` and autograd (what
  a trainer without a fused head writes; the jsd as TRL's ``generalized_jsd_loss``);
- ``liger``: liger-kernel's ``LigerFusedLinearJSD`` (kind ``jsd`` only). Its JSD is
  ``beta KL(P || M) + (1 - beta) KL(Q || M)``, ``M = beta P + (1 - beta) Q`` with ``P`` the
  target (teacher) and ``Q`` the input (student), so its ``jsd_beta`` is our ``beta``. It
  returns the mean over rows with its gradients finished in the forward: the step runs
  ``backward()`` of that mean, and its loss (times N) is compared with the reference's sum;
  timing, memory and that loss only;
- ``trl``: TRL's ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``, whose
  ``beta`` is 0 for forward KL, 1 for reverse KL and the jsd's ``beta`` in between (mixture
  ``(1 - beta) p + beta q``); per-row divergence, any upstream gradient.

The reference (:func:`distill_reference`) is the same math in fp64 (CPU) or fp32 with TF32
off (GPU), a block of rows at a time with autograd per block, independent of lp.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lp_bench.providers import PEERS, Prepared, Unsupported

Kind = Literal["forward_kl", "reverse_kl", "jsd"]
KINDS: tuple[Kind, ...] = ("forward_kl", "reverse_kl", "jsd")
DISTILL_SHAPES = ("S1", "S2", "S4", "S5")
"""The GPU shapes of ``--mode distill`` when ``--shapes`` is not given."""
TEACHER_SCALES = (1, 2)
"""Default teacher widths, in multiples of the student's H."""
TEACHER_RHO = 0.8
"""Correlation of the teacher's logits with the student's (:func:`make_teacher`)."""
LP_DISTILL_PROVIDERS = ("lp-torch", "lp-auto", "lp-triton", "lp-torch-det", "lp-triton-det")
LP_DISTILL_LOSS_PROVIDERS = ("lp-loss-torch", "lp-loss-auto", "lp-loss-triton")
"""``linear_divergence_loss`` (gradients finished in the forward) with the per-row upstream
gradient as its ``weights``."""
"""lp's providers in distill mode (``linear_divergence``); ``-det``: deterministic=True."""
TRL_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}
"""TRL's ``beta`` for the two KLs (jsd: its own beta)."""


@dataclass(frozen=True)
class DistillProblem:
    """The teacher side and the divergence of one distill-mode run."""

    teacher_hidden: torch.Tensor
    """``[N, H_t]`` teacher hidden states, a constant in the student's dtype."""
    teacher_weight: torch.Tensor
    """``[V, H_t]`` teacher head, a constant with the student head's rows."""
    kind: Kind = "reverse_kl"
    """The divergence (see the module docstring)."""
    beta: float = 0.5
    """jsd's mixture weight of the teacher, in (0, 1); unused by the KLs."""
    temperature: float = 1.0
    """Both heads' logits are divided by it."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"DistillProblem.kind: {self.kind!r} is not one of {KINDS}")
        if self.kind == "jsd" and not 0 < self.beta < 1:
            raise ValueError(f"DistillProblem.beta: jsd needs 0 < beta < 1, got {self.beta}")
        if self.teacher_hidden.requires_grad or self.teacher_weight.requires_grad:
            raise ValueError("DistillProblem: the teacher tensors are constants (no grad)")


def make_teacher(
    hidden: torch.Tensor, weight: torch.Tensor, scale: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher ``([N, scale H], [V, scale H])`` in ``hidden``'s dtype and device.

    ``teacher_hidden = [hidden | extra]`` and ``teacher_weight = rho [weight | 0] +
    sqrt(1 - rho^2) W_extra`` (``rho`` = :data:`TEACHER_RHO`, ``W_extra`` of std
    ``2 / sqrt(scale H)``), so the teacher's logits are ``rho`` times the student's plus an
    independent part of about the same std. Drawn from a CPU generator seeded with
    ``seed + 5`` (the student's inputs are untouched)."""
    if scale < 1:
        raise ValueError(f"make_teacher: scale must be >= 1, got {scale}")
    n, h = hidden.shape
    v, h_t = weight.shape[0], scale * h
    g = torch.Generator(device="cpu").manual_seed(seed + 5)
    extra = torch.randn(n, h_t - h, generator=g)
    t_hidden = torch.cat([hidden.detach().float().cpu(), extra], dim=1)
    w_extra = torch.randn(v, h_t, generator=g) * (2.0 / h_t**0.5)
    t_weight = math.sqrt(1 - TEACHER_RHO**2) * w_extra
    t_weight[:, :h] += TEACHER_RHO * weight.detach().float().cpu()
    return t_hidden.to(hidden.device, hidden.dtype), t_weight.to(hidden.device, hidden.dtype)


def torch_divergence(logp: torch.Tensor, logq: torch.Tensor, kind: Kind, beta: float):
    """Per-row divergence ``[rows]`` of student / teacher log-probs ``[rows, V]`` as a torch
    user writes it: ``F.kl_div(input, target, log_target=True)`` is ``KL(target || input)``
    elementwise; jsd's mixture log as TRL's ``generalized_jsd_loss`` forms it."""
    if kind == "forward_kl":
        return F.kl_div(logp, logq, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)
    mix = torch.stack([logp + math.log(1 - beta), logq + math.log(beta)])
    logm = torch.logsumexp(mix, dim=0)
    kl_teacher = F.kl_div(logm, logq, reduction="none", log_target=True).sum(-1)
    kl_student = F.kl_div(logm, logp, reduction="none", log_target=True).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def exact_divergence(logp: torch.Tensor, logq: torch.Tensor, kind: Kind, beta: float):
    """The reference's per-row divergence, written from the definitions (``sum p (log p -
    log q)``), not through ``F.kl_div``, so that it is a second formulation of
    :func:`torch_divergence`."""
    p, q = logp.exp(), logq.exp()
    if kind == "forward_kl":
        return (q * (logq - logp)).sum(-1)
    if kind == "reverse_kl":
        return (p * (logp - logq)).sum(-1)
    logm = torch.logaddexp(logq + math.log(beta), logp + math.log(1 - beta))  # no log(0)
    return (beta * q * (logq - logm) + (1 - beta) * p * (logp - logm)).sum(-1)


def distill_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    problem: DistillProblem,
    grad_out: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """The divergence and its gradients for the upstream ``grad_out [N]``, in ``dtype``
    (fp64: the truth on CPU; fp32 with TF32 off: a GPU-shape reference), a block of
    ``rows`` rows at a time (default: about 2^26 logits per block) with autograd on each
    block. Returns ``divergence [N]``, ``grad_hidden [N, H]``, ``grad_weight [V, H]``."""
    n, v = hidden.shape[0], weight.shape[0]
    rows = rows or max(1, min(n, 2**26 // v))
    w = weight.detach().to(dtype).requires_grad_()
    tw = problem.teacher_weight.detach().to(dtype)
    div, grad_hidden = [], []
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.enable_grad():
            for start in range(0, n, rows):
                block = slice(start, start + rows)
                h = hidden[block].detach().to(dtype).requires_grad_()
                th = problem.teacher_hidden[block].detach().to(dtype)
                logp = torch.log_softmax(h @ w.T / problem.temperature, dim=-1)
                logq = torch.log_softmax(th @ tw.T / problem.temperature, dim=-1)
                d = exact_divergence(logp, logq, problem.kind, problem.beta)
                (d * grad_out[block].to(dtype)).sum().backward()
                div.append(d.detach())
                grad_hidden.append(h.grad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return {
        "divergence": torch.cat(div),
        "grad_hidden": torch.cat(grad_hidden),
        "grad_weight": w.grad,
    }


def _finished(divergence: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Backward of ``sum(divergence * grad_out)`` when it has a graph; ``(divergence, None)``
    detached."""
    if divergence.requires_grad:
        divergence.backward(grad_out)
    return divergence.detach(), None


def provider_lp_divergence(backend: str, problem: DistillProblem, deterministic: bool):
    """lp's ``linear_divergence`` with the problem's options (``validate=False``, as the
    other modes' lp providers); :class:`Unsupported` where lp_kernels has no such op, or
    where a probe call on a tiny problem (on the teacher's device and dtype, validated)
    raises ValueError (a backend or option not implemented yet)."""
    try:
        from lp_kernels import linear_divergence
    except ImportError as exc:
        raise Unsupported(f"lp_kernels has no linear_divergence ({type(exc).__name__})") from None
    options = {"kind": problem.kind, "temperature": problem.temperature}
    options |= {"beta": problem.beta} if problem.kind == "jsd" else {}
    options |= {"deterministic": deterministic, "backend": backend}
    dev, dt = problem.teacher_hidden.device, problem.teacher_hidden.dtype
    tiny = [torch.randn(shape, device=dev, dtype=dt) for shape in ((2, 4), (3, 4), (2, 4), (3, 4))]
    try:
        linear_divergence(*tiny, **options)
    except ValueError as exc:
        det = ", deterministic=True" if deterministic else ""
        raise Unsupported(f"linear_divergence(backend={backend!r}{det}): {exc}") from None
    teacher = (problem.teacher_hidden, problem.teacher_weight)

    def step(hidden, weight, grad_out):
        out = linear_divergence(hidden, weight, *teacher, **options, validate=False)
        return _finished(out.divergence, grad_out)

    return Prepared(step, False)


def provider_lp_divergence_loss(backend: str, problem: DistillProblem) -> Prepared:
    """lp's ``linear_divergence_loss`` with the step's per-row upstream gradient as its
    ``weights`` (the same gradients as the other providers' ``backward(grad_out)``), its
    gradients finished in the forward (four GEMMs); :class:`Unsupported` where lp_kernels
    has no such op."""
    try:
        from lp_kernels import linear_divergence_loss
    except ImportError as exc:
        raise Unsupported(
            f"lp_kernels has no linear_divergence_loss ({type(exc).__name__})"
        ) from None
    options = {"kind": problem.kind, "temperature": problem.temperature, "backend": backend}
    options |= {"beta": problem.beta} if problem.kind == "jsd" else {}
    teacher = (problem.teacher_hidden, problem.teacher_weight)

    def step(hidden, weight, grad_out):
        out = linear_divergence_loss(
            hidden, weight, *teacher, weights=grad_out, **options, validate=False
        )
        if out.loss.requires_grad:
            out.loss.backward()
        return out.divergence, None

    return Prepared(step, False)


def provider_materialized_divergence(problem: DistillProblem) -> Prepared:
    """Both logits ``[N, V]`` from GEMMs in the input dtype, upcast to fp32, divided by the
    temperature, ``log_softmax``, :func:`torch_divergence`, autograd (the teacher's side
    under ``no_grad``)."""

    def step(hidden, weight, grad_out):
        with torch.no_grad():
            t_logits = problem.teacher_hidden @ problem.teacher_weight.T
            logq = torch.log_softmax(t_logits.float() / problem.temperature, dim=-1)
            del t_logits
        logp = torch.log_softmax((hidden @ weight.T).float() / problem.temperature, dim=-1)
        div = torch_divergence(logp, logq, problem.kind, problem.beta)
        return _finished(div, grad_out)

    return Prepared(step, False)


def provider_liger_jsd(problem: DistillProblem) -> Prepared:
    """liger-kernel's ``LigerFusedLinearJSD`` (kind jsd only, ``jsd_beta = beta``): its mean
    over rows, ``backward()`` of it; returns ``(None, mean * N)`` (the divergence's sum)."""
    if importlib.util.find_spec(PEERS["liger"]) is None:
        raise Unsupported("liger_kernel is not importable")
    if problem.kind != "jsd":
        raise Unsupported("liger's fused linear JSD runs kind jsd only (--kind jsd)")
    from liger_kernel.transformers import LigerFusedLinearJSD

    module = LigerFusedLinearJSD(jsd_beta=problem.beta, temperature=problem.temperature)
    teacher = (problem.teacher_hidden, problem.teacher_weight)
    # newer versions take shift_labels (no default), older ones do not
    labels = (None,) if "shift_labels" in inspect.signature(module.forward).parameters else ()

    def step(hidden, weight, grad_out):
        loss = module(hidden, weight, *teacher, *labels)
        if loss.requires_grad:
            loss.backward()
        return None, loss.detach().float() * hidden.shape[0]

    note = "a scalar mean loss: timing, memory and the summed divergence only"
    return Prepared(step, False, note)


def provider_trl_divergence(problem: DistillProblem) -> Prepared:
    """TRL's ``ChunkedDivergenceFunction`` with ``beta`` :data:`TRL_BETA` (jsd: the jsd's
    beta; the mixture ``(1 - beta) p + beta q`` is ours), no biases, no caps, the run's
    temperature for both heads."""
    if importlib.util.find_spec(PEERS["trl"]) is None:
        raise Unsupported("trl is not importable")
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except ImportError as exc:
        raise Unsupported(f"the installed trl has no chunked divergence ({exc})") from None
    beta = TRL_BETA.get(problem.kind, problem.beta)
    th, tw = problem.teacher_hidden, problem.teacher_weight

    def step(hidden, weight, grad_out):
        div, _ = ChunkedDivergenceFunction.apply(
            hidden, weight, None, th, tw, None, beta, problem.temperature
        )
        return _finished(div, grad_out)

    return Prepared(step, False)


def make_distill_provider(name: str, problem: DistillProblem) -> Prepared:
    """The distill-mode step of provider ``name``: ``step(hidden, weight, grad_out) ->
    (divergence [N] | None, summed loss | None)``, detached, gradients in ``hidden.grad``
    and ``weight.grad`` when they require grad. Raises :class:`Unsupported` where ``name``
    cannot run this problem (a provider of another mode, a peer not installed)."""
    if name in LP_DISTILL_PROVIDERS:
        backend = name.removeprefix("lp-").removesuffix("-det")
        return provider_lp_divergence(backend, problem, name.endswith("-det"))
    if name in LP_DISTILL_LOSS_PROVIDERS:
        return provider_lp_divergence_loss(name.removeprefix("lp-loss-"), problem)
    if name == "materialized":
        return provider_materialized_divergence(problem)
    if name == "liger":
        return provider_liger_jsd(problem)
    if name == "trl":
        return provider_trl_divergence(problem)
    raise Unsupported(f"{name} has no distillation divergence (distill mode)")


def distill_floor(hidden, weight, problem: DistillProblem) -> Callable[[], None]:
    """The floor of a distill step as one call: 6 GEMMs, four of the student's shape
    (forward logits, backward recompute, grad_hidden, grad_weight: ``[N, H] x [H, V]`` each)
    and two of the teacher's (forward and backward logits, ``[N, H_t] x [H_t, V]``)."""
    th, tw = problem.teacher_hidden, problem.teacher_weight

    def floor() -> None:
        for _ in range(4):
            hidden @ weight.T
        for _ in range(2):
            th @ tw.T

    return floor
