"""lp's divergence ops as ``torch.library`` custom ops (namespace ``lp``), as
:mod:`lp_kernels.library` makes ``linear_logprob``'s: what ``torch.compile`` sees::

    lp::linear_divergence(hidden, weight, bias?, teacher_hidden, teacher_weight,
                          teacher_bias?, mask?, OPTIONS)
        -> (divergence, student_entropy, teacher_entropy, saved, bound)
    lp::linear_divergence_backward(hidden, weight, bias?, teacher_hidden, teacher_weight,
                                   teacher_bias?, mask?, saved, bound, g_div, bool[] needs,
                                   OPTIONS) -> (grad_hidden, grad_weight, grad_bias)
    lp::linear_divergence_loss(hidden, ..., mask?, weights?, bool[] needs, OPTIONS)
        -> (loss, divergence, student_entropy, teacher_entropy,
            grad_hidden, grad_weight, grad_bias)
    lp::linear_divergence_loss_backward(grad_hidden, grad_weight, grad_bias, g_loss)
        -> the three scaled by g_loss
    lp::vocab_parallel_divergence(logits, teacher_logprobs, mask?, OPTIONS)
        -> (divergence, student_entropy, teacher_entropy, saved)
    lp::vocab_parallel_divergence_backward(logits, teacher_logprobs, mask?, saved, g_div,
                                           OPTIONS) -> grad_logits

``OPTIONS`` (:data:`OPTIONS`, :class:`DivergenceOptions`) are the public op's keyword options
as schema scalars: ``kind``, ``beta``, each side's logit transform as three floats (the
teacher's temperature resolved), a ``tp_group`` by name (:func:`lp_kernels.library.group_name`).
The per-row outputs are flat ``[N]`` fp32, viewed with the rows' shape outside; ``saved``
``[N, 4]`` fp32 holds the rows' statistics for the backward and ``bound`` (``[N]`` fp64 with
``deterministic=True``, else empty) the fixed-point bound of ``grad_hidden``.

The implementations run what eager mode runs: the same preparation
(:func:`lp_kernels._prepare_divergence.prepared`: checks, host syncs, the per-call rank
record, now at run time) and the same host forward and backward functions of the autograd
Functions (``backends.divergence``, ``backends.divergence_tiles``), so a compiled step gets
eager mode's bits. The backward op prepares again (``validate=False``) and, with
``deterministic=True``, exchanges the halo rows again (under a group: one more collective,
the same rows). The loss op's gradients (for an upstream gradient of 1, in the prepared
dtypes; empty where ``needs`` is False) are outputs kept for the backward op, which scales
copies of them (``core.loss.scale_``: eager's arithmetic, out of place); the cast back to the
inputs' dtypes follows, as autograd's follows in eager mode. Autograd is registered with
``torch.library.register_autograd``; the entropies, ``saved``, ``bound`` and the loss op's
gradients carry no gradient, the teacher's tensors, the mask and the weights none.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lp_kernels import _prepare_divergence as prep_div
from lp_kernels.backends import divergence_tiles as tiles
from lp_kernels.backends.divergence import (
    host_backward,
    host_forward,
    logits_backward,
    logits_forward,
    loss_forward,
    row_outputs,
)
from lp_kernels.core import amp
from lp_kernels.core.divergence import N_SAVED
from lp_kernels.core.loss import scale_
from lp_kernels.core.types import DivergenceLossOutput, DivergenceOutput
from lp_kernels.library import NAMESPACE, OPS, distinct, group_by_name, group_name

OPTIONS = (
    "str kind, float beta, float temperature, float? cap, float? scale, "
    "float teacher_temperature, float? teacher_cap, float? teacher_scale, str? group, "
    "int? vocab_start, int? vocab_size, bool reduce_grad_hidden, bool deterministic, "
    "int? deterministic_tile, str backend, int? chunk_size, bool validate"
)
"""The options every op of this module takes, in :class:`DivergenceOptions` order."""

HEADS = (
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor teacher_hidden, Tensor teacher_weight, "
    "Tensor? teacher_bias, Tensor? mask"
)


class DivergenceOptions(NamedTuple):
    """A divergence op's options as the custom ops take them (schema :data:`OPTIONS`)."""

    kind: str
    beta: float
    temperature: float
    cap: float | None
    """The student's transform's second field (``LogitTransform`` order), or None."""
    scale: float | None
    """The student's logit scale, or None."""
    teacher_temperature: float
    teacher_cap: float | None
    teacher_scale: float | None
    group: str | None
    """The ``tp_group``'s name, or None."""
    vocab_start: int | None
    vocab_size: int | None
    reduce_grad_hidden: bool
    deterministic: bool
    deterministic_tile: int | None
    backend: str
    chunk_size: int | None
    validate: bool

    def arguments(self, validate: bool) -> dict[str, Any]:
        """The op's arguments by name, as :func:`prep_div.prepared` reads them."""
        o = {name: getattr(self, name) for name in prep_div.LINEAR_OPTIONS if name != "tp_group"}
        return o | {
            "kind": self.kind,
            "beta": self.beta,
            "tp_group": group_by_name(self.group),
            "validate": validate,
        }

    def prepared(self, tensors: tuple, *, validate: bool, op: str = "linear_divergence"):
        """``op``'s preparation of ``tensors`` (the forward op's first seven)."""
        hidden, weight, bias, t_hidden, t_weight, t_bias, mask = tensors
        o = self.arguments(validate) | {"mask": mask, "bias": bias, "teacher_bias": t_bias}
        transforms = (self[2:5], self[5:8])
        heads = (hidden, weight, t_hidden, t_weight)
        return prep_div.prepared(heads, transforms, o, op=op)

    def prepared_logits(self, logits, teacher_logprobs, mask, *, validate: bool):
        """``vocab_parallel_divergence``'s preparation."""
        o = self.arguments(validate) | {"mask": mask}
        return prep_div.prepared_logits(logits, teacher_logprobs, self[2:5], o)


_INTS = ("vocab_start", "vocab_size", "deterministic_tile", "chunk_size")
_BOOLS = ("reduce_grad_hidden", "deterministic", "validate")


def op_options(transforms: tuple, tp_group: Any, options: dict) -> list | None:
    """The schema arguments (:class:`DivergenceOptions` order) of a public op's options, or
    None where one has a type the schema does not carry (the eager op then raises its
    error). ``transforms``: both sides' transform values, checked when the op runs."""
    for first, *rest in transforms:
        if type(first) not in (int, float) or any(
            type(x) not in (int, float, type(None)) for x in rest
        ):
            return None
    kind, beta, backend = options["kind"], options["beta"], options["backend"]
    if type(kind) is not str or type(beta) not in (int, float) or type(backend) is not str:
        return None
    if any(type(options[k]) not in (int, type(None)) for k in _INTS):
        return None
    if any(type(options[k]) is not bool for k in _BOOLS):
        return None
    if tp_group is not None and not (
        dist.is_available() and isinstance(tp_group, dist.ProcessGroup)
    ):
        return None
    values = [None if x is None else float(x) for t in transforms for x in t]
    rest = {k: options[k] for k in (*_INTS, *_BOOLS, "backend")}
    return list(DivergenceOptions(kind, float(beta), *values, group=group_name(tp_group), **rest))


# --- the ops -------------------------------------------------------------------------------

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_LIB.define(f"linear_divergence({HEADS}, {OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define(
    f"linear_divergence_backward({HEADS}, Tensor saved, Tensor bound, Tensor g_div, "
    f"bool[] needs, {OPTIONS}) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    f"linear_divergence_loss({HEADS}, Tensor? weights, bool[] needs, {OPTIONS}) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "linear_divergence_loss_backward(Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, "
    "Tensor g_loss) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "vocab_parallel_divergence(Tensor logits, Tensor teacher_logprobs, Tensor? mask, "
    f"{OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "vocab_parallel_divergence_backward(Tensor logits, Tensor teacher_logprobs, Tensor? mask, "
    f"Tensor saved, Tensor g_div, {OPTIONS}) -> Tensor"
)


def _rows(x: torch.Tensor):
    """The number of rows of ``x [*, W]``."""
    return math.prod(x.shape[:-1])


def _fake_outputs(n, device, deterministic: bool | None) -> list[torch.Tensor]:
    """The forward ops' outputs for ``n`` rows (``deterministic=None``: no ``bound``)."""
    out = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(3)]
    out.append(torch.empty((n, N_SAVED), dtype=torch.float32, device=device))
    if deterministic is not None:
        out.append(torch.empty(n if deterministic else 0, dtype=torch.float64, device=device))
    return out


def _grads_like(grads, inputs: tuple, others: tuple) -> tuple:
    """The gradients of ``inputs`` in their dtypes and shapes (empty for None), none
    aliasing an argument."""
    out = [
        inputs[0].new_empty(0) if g is None else g.to(x.dtype).reshape(x.shape).contiguous()
        for g, x in zip(grads, inputs, strict=True)
    ]
    return tuple(distinct(out, (*inputs, *others)))


@torch.library.impl(f"{NAMESPACE}::linear_divergence", "CompositeExplicitAutograd", lib=_LIB)
def _linear_divergence(*args):
    tensors, o = args[:7], DivergenceOptions(*args[7:])
    with amp.autocast_off(tensors[0].device):  # the caller's graph has cast the inputs
        s, t, dp, ignored = o.prepared(tensors, validate=o.validate)
        heads = (s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias)
        if dp.student.deterministic:
            saved, sums, bound, _ = tiles.host_forward(*heads, dp)
        else:
            saved, sums = host_forward(*heads, dp)
            bound = saved.new_empty(0, dtype=torch.float64)
        outputs = row_outputs(ignored, sums)
    return tuple(distinct([*outputs, saved, bound], tensors))


@torch.library.register_fake(f"{NAMESPACE}::linear_divergence", lib=_LIB)
def _linear_divergence_fake(*args):
    hidden, o = args[0], DivergenceOptions(*args[7:])
    return tuple(_fake_outputs(_rows(hidden), hidden.device, o.deterministic))


@torch.library.impl(
    f"{NAMESPACE}::linear_divergence_backward", "CompositeExplicitAutograd", lib=_LIB
)
def _linear_divergence_backward(*args):
    tensors, (saved, bound, g_div, needs) = args[:7], args[7:11]
    o = DivergenceOptions(*args[11:])
    needs = tuple(needs)
    with amp.autocast_off(tensors[0].device), torch.no_grad():
        s, t, dp, ignored = o.prepared(tensors, validate=False)
        heads = (s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias)
        if dp.student.deterministic:
            halos = tiles.exchange_halos(s.weight, s.bias, t.weight, t.bias, dp.student)
            kept = (*heads, ignored, saved, bound, *halos)
            grads = tiles.host_backward(kept, g_div, needs, dp)
        else:
            grads = host_backward((*heads, ignored, saved), g_div, needs, dp)
    return _grads_like(grads, tensors[:3], (*tensors[3:], saved, bound, g_div))


@torch.library.register_fake(f"{NAMESPACE}::linear_divergence_backward", lib=_LIB)
def _linear_divergence_backward_fake(*args):
    hidden, needs = args[0], args[10]
    return tuple(
        x.new_empty(x.shape) if need and x is not None else hidden.new_empty(0)
        for need, x in zip(needs, args[:3], strict=True)
    )


@torch.library.impl(f"{NAMESPACE}::linear_divergence_loss", "CompositeExplicitAutograd", lib=_LIB)
def _linear_divergence_loss(*args):
    tensors, (weights, needs) = args[:7], args[7:9]
    o = DivergenceOptions(*args[9:])
    hidden = tensors[0]
    with amp.autocast_off(hidden.device):
        w = prep_div.row_weights(weights, hidden)
        s, t, dp, ignored = o.prepared(tensors, validate=o.validate, op="linear_divergence_loss")
        heads = (s.inputs, s.weight, s.bias, t.inputs, t.weight, t.bias)
        loss, rows, grads = loss_forward(heads, ignored, w.reshape(-1), tuple(needs), dp)
    grads = [  # in the prepared dtypes: the backward scales them, then casts
        hidden.new_empty(0) if g is None else g.reshape(x.shape)
        for g, x in zip(grads, tensors[:3], strict=True)
    ]
    return tuple(distinct([loss, *rows, *grads], (*tensors, weights)))


@torch.library.register_fake(f"{NAMESPACE}::linear_divergence_loss", lib=_LIB)
def _linear_divergence_loss_fake(*args):
    hidden, weight, bias, needs = args[0], args[1], args[2], args[8]
    n, dtype = _rows(hidden), torch.promote_types(hidden.dtype, weight.dtype)
    rows = [hidden.new_empty(n, dtype=torch.float32) for _ in range(3)]
    dtypes = (dtype, dtype, None if bias is None else bias.dtype)
    grads = [
        x.new_empty(x.shape, dtype=d) if need and x is not None else hidden.new_empty(0)
        for x, d, need in zip((hidden, weight, bias), dtypes, needs, strict=True)
    ]
    return (hidden.new_empty((), dtype=torch.float32), *rows, *grads)


@torch.library.impl(
    f"{NAMESPACE}::linear_divergence_loss_backward", "CompositeExplicitAutograd", lib=_LIB
)
def _linear_divergence_loss_backward(grad_hidden, grad_weight, grad_bias, g_loss):
    return tuple(scale_(x.clone(), g_loss) for x in (grad_hidden, grad_weight, grad_bias))


@torch.library.register_fake(f"{NAMESPACE}::linear_divergence_loss_backward", lib=_LIB)
def _linear_divergence_loss_backward_fake(grad_hidden, grad_weight, grad_bias, g_loss):
    return tuple(x.new_empty(x.shape) for x in (grad_hidden, grad_weight, grad_bias))


@torch.library.impl(
    f"{NAMESPACE}::vocab_parallel_divergence", "CompositeExplicitAutograd", lib=_LIB
)
def _vocab_parallel_divergence(logits, teacher_logprobs, mask, *options):
    o = DivergenceOptions(*options)
    with amp.autocast_off(logits.device):
        prep, teacher, dp, ignored = o.prepared_logits(
            logits, teacher_logprobs, mask, validate=o.validate
        )
        saved, sums = logits_forward(prep.inputs, teacher, dp)
        outputs = row_outputs(ignored, sums)
    return tuple(distinct([*outputs, saved], (logits, teacher_logprobs, mask)))


@torch.library.register_fake(f"{NAMESPACE}::vocab_parallel_divergence", lib=_LIB)
def _vocab_parallel_divergence_fake(logits, teacher_logprobs, mask, *options):
    return tuple(_fake_outputs(_rows(logits), logits.device, None))


@torch.library.impl(
    f"{NAMESPACE}::vocab_parallel_divergence_backward", "CompositeExplicitAutograd", lib=_LIB
)
def _vocab_parallel_divergence_backward(logits, teacher_logprobs, mask, saved, g_div, *options):
    o = DivergenceOptions(*options)
    with amp.autocast_off(logits.device), torch.no_grad():
        prep, teacher, dp, ignored = o.prepared_logits(
            logits, teacher_logprobs, mask, validate=False
        )
        grad = logits_backward(prep.inputs, teacher, ignored, saved, g_div, dp)
    return _grads_like([grad], (logits,), (teacher_logprobs, mask, saved, g_div))[0]


@torch.library.register_fake(f"{NAMESPACE}::vocab_parallel_divergence_backward", lib=_LIB)
def _vocab_parallel_divergence_backward_fake(logits, *args):
    return logits.new_empty(logits.shape)


# --- autograd ------------------------------------------------------------------------------


def _setup(n_inputs: int, n_saved: int):
    """``setup_context`` of a forward op whose first ``n_inputs`` arguments are tensors and
    whose outputs after the first three are its ``n_saved`` statistics."""

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        ctx.options = inputs[n_inputs:]
        ctx.save_for_backward(*inputs[:n_inputs], *output[3 : 3 + n_saved])
        ctx.mark_non_differentiable(*output[1:])  # the entropies and the statistics

    return setup_context


def _linear_backward(ctx, g_div, *_):
    needs = [bool(x) for x in ctx.needs_input_grad[:3]]
    nothing = (None,) * (7 + len(ctx.options))
    if g_div is None or not any(needs):
        return nothing
    out = OPS.linear_divergence_backward(*ctx.saved_tensors, g_div, needs, *ctx.options)
    return tuple(g if need else None for g, need in zip(out, needs, strict=True)) + nothing[3:]


def _logits_backward(ctx, g_div, *_):
    nothing = (None,) * (3 + len(ctx.options))
    if g_div is None or not ctx.needs_input_grad[0]:
        return nothing
    grad = OPS.vocab_parallel_divergence_backward(*ctx.saved_tensors, g_div, *ctx.options)
    return (grad, *nothing[1:])


def _setup_loss(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.n_inputs, ctx.needs = len(inputs), inputs[8]
    ctx.dtypes = [None if x is None else x.dtype for x in inputs[:3]]
    ctx.save_for_backward(*output[4:])  # the finished gradients
    ctx.mark_non_differentiable(*output[1:])


def _loss_backward(ctx, g_loss, *_):
    nothing = (None,) * ctx.n_inputs
    if g_loss is None:
        return nothing
    grads = OPS.linear_divergence_loss_backward(*ctx.saved_tensors, g_loss)
    pairs = zip(grads, ctx.needs, ctx.dtypes, strict=True)
    return tuple(g.to(dtype) if need else None for g, need, dtype in pairs) + nothing[3:]


torch.library.register_autograd(
    f"{NAMESPACE}::linear_divergence_loss", _loss_backward, setup_context=_setup_loss, lib=_LIB
)
torch.library.register_autograd(
    f"{NAMESPACE}::linear_divergence", _linear_backward, setup_context=_setup(7, 2), lib=_LIB
)
torch.library.register_autograd(
    f"{NAMESPACE}::vocab_parallel_divergence",
    _logits_backward,
    setup_context=_setup(3, 1),
    lib=_LIB,
)


# --- what the public ops call under torch.compile ------------------------------------------


def _cast(tensors: tuple) -> tuple:
    """``(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask)`` with
    autocast's casts of both heads made here, as eager mode makes them, so that they are in
    the caller's graph."""
    hidden, weight, bias, t_hidden, t_weight, t_bias, mask = tensors
    hidden, weight = amp.autocast_inputs(hidden, weight)
    t_hidden, t_weight = amp.autocast_inputs(t_hidden, t_weight)
    bias, t_bias = (None if b is None else amp.autocast_inputs(b)[0] for b in (bias, t_bias))
    return hidden, weight, bias, t_hidden, t_weight, t_bias, mask


def linear_divergence(tensors: tuple, options: list) -> DivergenceOutput:
    """``lp::linear_divergence`` for the public op's ``tensors = (hidden, weight, bias,
    teacher_hidden, teacher_weight, teacher_bias, mask)`` (``options``: :func:`op_options`)."""
    tensors = _cast(tensors)
    outs = OPS.linear_divergence(*tensors, *options)
    return DivergenceOutput(*(x.view(tensors[0].shape[:-1]) for x in outs[:3]))


def linear_divergence_loss(tensors: tuple, weights, options: list) -> DivergenceLossOutput:
    """``lp::linear_divergence_loss`` for the public op's arguments (as
    :func:`linear_divergence`, and the row ``weights``)."""
    tensors = _cast(tensors)
    needs = [x is not None and x.requires_grad for x in tensors[:3]]
    outs = OPS.linear_divergence_loss(*tensors, weights, needs, *options)
    lead = tensors[0].shape[:-1]
    return DivergenceLossOutput(outs[0], *(x.view(lead) for x in outs[1:4]))


def vocab_parallel_divergence(logits, teacher_logprobs, mask, options: list) -> DivergenceOutput:
    """``lp::vocab_parallel_divergence`` for the public op's arguments."""
    outs = OPS.vocab_parallel_divergence(logits, teacher_logprobs, mask, *options)
    return DivergenceOutput(*(x.view(logits.shape[:-1]) for x in outs[:3]))
