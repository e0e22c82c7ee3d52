"""lp's ops as ``torch.library`` custom ops (namespace ``lp``): what ``torch.compile`` sees.

Under ``torch.compile`` the public ops call these instead of their autograd Functions (the
divergence ops' are in :mod:`lp_kernels.library_divergence`)::

    lp::linear_logprob(hidden, weight, bias?, targets, OPTIONS)
        -> (logprob, entropy, lse, log_sum_sq_probs, mean_logit, is_top1, lse_saved, E_saved)
    lp::linear_logprob_backward(hidden, weight, bias?, targets, lse_saved, E_saved,
                                g_lp?, g_ent?, g_lse?, bool[] needs, OPTIONS)
        -> (grad_hidden, grad_weight, grad_bias)
    lp::vocab_parallel_logprob(logits, targets, OPTIONS)       -> (the same 8)
    lp::vocab_parallel_logprob_backward(logits, targets, lse_saved, E_saved,
                                        g_lp?, g_ent?, g_lse?, OPTIONS) -> grad_logits

``OPTIONS`` are the public op's keyword options as schema scalars (:class:`OpOptions`): the
logit transform as three floats, a ``tp_group`` as its name (:func:`group_name`). Outputs
have a fixed arity: one not asked for is an empty tensor, None again in the public result;
they are flat ``[N]``, viewed with the targets' shape outside.

The ops are opaque to Dynamo and Inductor, and their implementations run what eager mode
runs: the same argument preparation (``lp_kernels._prepare.prepare``, checks, host syncs and
the per-call rank contract included, now at run time) and the same host ``forward`` /
``backward`` functions of the backend the eager call would pick, so a compiled step gets
eager mode's bits. What an eager Function keeps between its passes is rebuilt here: the
statistics (lse, E) are outputs of the forward op; the options are prepared again in the
backward op (``validate=False``: no host sync, the tensor-parallel layout from its cache);
the halo rows of ``deterministic=True`` under a group are exchanged again in the backward
(one more collective, the same rows); the launch config is taken again.

The fake kernels give shapes and dtypes from the arguments alone. Autograd is registered
with ``torch.library.register_autograd``; its backward calls the backward op, so
AOTAutograd compiles the backward graph around it too. The extras carry no gradient.
Under compile an output that is asked for gets an upstream gradient (zeros when the loss
does not use it) where eager mode passes none; ask only for the outputs the loss uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lp_kernels._prepare import Prepared, prepare
from lp_kernels.backends.resolve import resolve_backend
from lp_kernels.backends.torch import linear as torch_linear
from lp_kernels.backends.torch import logits as torch_logits
from lp_kernels.backends.torch.deterministic import LinearLogprobTorchDeterministic
from lp_kernels.backends.torch.deterministic import backward as det_backward
from lp_kernels.backends.torch.deterministic import forward as det_forward
from lp_kernels.backends.torch.linear import LinearLogprobTorch
from lp_kernels.core import amp
from lp_kernels.core.extras import EXTRAS, check_extras
from lp_kernels.core.transform import LogitTransform
from lp_kernels.core.types import LogProbOutput, LogprobParams
from lp_kernels.distributed.halo import bias_halo, owned_halo

NAMESPACE = __name__.split(".")[0].replace("_kernels", "", 1)
"""The custom ops' namespace: ``lp`` for the package ``lp_kernels``; a copy of the package
imported beside it under another name (``lp_kernels_NAME``, an A/B tree) registers its ops
as ``lp_NAME``, so the two do not collide."""

OPTIONS = (
    "float temperature, float? cap, float? scale, int ignore_index, bool return_entropy, "
    "bool return_lse, str[] extras, str? group, int? vocab_start, int? vocab_size, "
    "bool reduce_grad_hidden, bool deterministic, int? deterministic_tile, str backend, "
    "int? chunk_size, bool validate"
)
"""The options every op of this module takes, in :class:`OpOptions` order."""

OUTPUTS = "(" + ", ".join(["Tensor"] * 8) + ")"


class OpOptions(NamedTuple):
    """A public op's options as the custom ops take them (schema :data:`OPTIONS`)."""

    temperature: float
    cap: float | None
    """The transform's cap (:class:`LogitTransform`'s second field), or None."""
    scale: float | None
    """The transform's logit scale, or None."""
    ignore_index: int
    return_entropy: bool
    return_lse: bool
    extras: list[str]
    """Checked names, in ``EXTRAS`` order."""
    group: str | None
    """The ``tp_group``'s name (:func:`group_name`), or None."""
    vocab_start: int | None
    vocab_size: int | None
    reduce_grad_hidden: bool
    deterministic: bool
    deterministic_tile: int | None
    backend: str
    chunk_size: int | None
    validate: bool

    def prepared(self, inputs, weight, bias, targets, *, validate: bool) -> Prepared:
        """The call's arguments prepared as the eager op prepares them (``weight=None``:
        ``inputs`` are logits)."""
        options: dict[str, Any] = {
            "ignore_index": self.ignore_index,
            "return_entropy": self.return_entropy,
            "return_lse": self.return_lse,
            "extras": tuple(self.extras),
            "tp_group": group_by_name(self.group),
            "vocab_start": self.vocab_start,
            "vocab_size": self.vocab_size,
            "deterministic": self.deterministic,
            "deterministic_tile": self.deterministic_tile,
            "chunk_size": self.chunk_size,
            "validate": validate,
        }
        if weight is not None:
            options.update(
                bias=bias, reduce_grad_hidden=self.reduce_grad_hidden, backend=self.backend
            )
        values = (self.temperature, self.cap, self.scale)
        transform = LogitTransform.checked(**dict(zip(_TRANSFORM, values, strict=True)))
        return prepare(inputs, weight, targets, transform, **options)


_INTS = ("vocab_start", "vocab_size", "deterministic_tile", "chunk_size")
_BOOLS = ("return_entropy", "return_lse", "reduce_grad_hidden", "deterministic", "validate")


def plain(*tensors: Any) -> bool:
    """Every argument is None or a plain tensor (a parameter too; no DTensor)."""
    return all(x is None or type(x) in (torch.Tensor, torch.nn.Parameter) for x in tensors)


_TRANSFORM = tuple(LogitTransform.__dataclass_fields__)
"""The names of the logit transform's options (the public ops' keywords)."""


def op_options(transform: tuple, extras: Any, tp_group: Any, **options: Any):
    """The schema arguments (:class:`OpOptions` order) of a public op's options, or None
    where one has a type the schema does not carry (the eager op then raises its error).
    ``transform``: the values of :data:`_TRANSFORM`, checked when the op runs."""
    first, *rest = transform
    if type(first) not in (int, float) or any(
        type(x) not in (int, float, type(None)) for x in rest
    ):
        return None
    ints = [options["ignore_index"], *(options[k] for k in _INTS if options[k] is not None)]
    if any(type(x) is not int for x in ints) or not isinstance(options["backend"], str):
        return None
    if any(type(options[k]) is not bool for k in _BOOLS):
        return None
    if tp_group is not None and not (
        dist.is_available() and isinstance(tp_group, dist.ProcessGroup)
    ):
        return None
    t = (float(first), *(None if x is None else float(x) for x in rest))
    names = list(check_extras(extras))
    return list(OpOptions(*t, extras=names, group=group_name(tp_group), **options))


# --- process groups, by name --------------------------------------------------------------


def group_name(group: Any) -> str | None:
    """``group``'s name for the custom ops (None for None)."""
    return None if group is None else group.group_name


def group_by_name(name: str | None) -> Any:
    """The process group named ``name`` (:func:`group_name`), from torch's registry of named
    groups, as torch's own functional collectives resolve theirs. (Under Dynamo a group
    reaches lp's code as a stand-in, so lp cannot keep the group itself.)"""
    if name is None:
        return None
    if dist.group.WORLD is not None and dist.group.WORLD.group_name == name:
        return dist.group.WORLD
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# --- the backends' host functions -----------------------------------------------------------


def _halo(weight, bias, p: LogprobParams) -> tuple:
    """The halo rows of ``deterministic=True`` (weight's, bias'), as its forward makes them."""
    w_real = weight[: p.local_real_columns(weight.shape[0])]
    return owned_halo(w_real, p)[1], bias_halo(bias, w_real.shape[0], p)[1]


def _triton(deterministic: bool):
    """``(forward, backward, configs)`` of the triton backend's host functions: ``configs``
    gives the launch configs its Function takes (imported here: triton is optional)."""
    if deterministic:
        from lp_kernels.backends.triton import deterministic as det

        def configs(hidden, p):
            cfg, fixed = det.deterministic_config(hidden.device, hidden.dtype, p.deterministic_tile)
            return (cfg,), (cfg, fixed)

        return det.forward, det.backward, configs
    from lp_kernels.backends.triton import linear
    from lp_kernels.backends.triton.config import config_for

    def config(hidden, p):
        cfg = config_for(hidden.device, hidden.dtype)
        return (cfg,), (cfg,)

    return linear.forward, linear.backward, config


def host_forward(function: type, hidden, weight, bias, targets, p: LogprobParams) -> tuple:
    """``(outputs, lse, E)`` of the host forward that ``function`` (a backend's autograd
    Function of ``linear_logprob``) runs; E is None without entropy."""
    if function is LinearLogprobTorch:
        return torch_linear.forward(hidden, weight, bias, targets, p)
    if function is LinearLogprobTorchDeterministic:
        outputs, lse, mean_z, *_ = det_forward(hidden, weight, bias, targets, p)
        return outputs, lse, mean_z
    forward, _, configs = _triton(p.deterministic)
    outputs, saved = forward(hidden, weight, bias, targets, p, *configs(hidden, p)[0])
    return outputs, saved[4], saved[5]


def host_backward(function: type, saved: tuple, upstream: tuple, needs, p: LogprobParams):
    """``(grad_hidden, grad_weight, grad_bias)`` of ``function``'s host backward for the
    forward's ``saved = (hidden, weight, bias, targets, lse, E)``."""
    hidden, weight, bias, targets, lse, mean_z = saved
    if function is LinearLogprobTorch:
        return torch_linear.backward(*saved, upstream, needs, p)
    if function is LinearLogprobTorchDeterministic:
        return det_backward((*saved, *_halo(weight, bias, p)), upstream, needs, p)
    from lp_kernels.backends.triton.backward import kernel_inputs

    _, backward, configs = _triton(p.deterministic)
    hidden, _, targets = kernel_inputs(hidden, weight, targets, p)  # as its forward kept
    kept = (hidden, weight, bias, targets, lse, mean_z)
    if p.deterministic:
        kept = (*kept, *_halo(weight, bias, p))
    return backward(kept, upstream, needs, p, *configs(hidden, p)[1])


# --- the ops -------------------------------------------------------------------------------

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
OPS = getattr(torch.ops, NAMESPACE)
"""``torch.ops.lp``: the ops of this namespace."""
_LIB.define(
    "linear_logprob(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, "
    f"{OPTIONS}) -> {OUTPUTS}"
)
_LIB.define(
    "linear_logprob_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, "
    "Tensor lse, Tensor mean_z, Tensor? g_lp, Tensor? g_ent, Tensor? g_lse, bool[] needs, "
    f"{OPTIONS}) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(f"vocab_parallel_logprob(Tensor logits, Tensor targets, {OPTIONS}) -> {OUTPUTS}")
_LIB.define(
    "vocab_parallel_logprob_backward(Tensor logits, Tensor targets, Tensor lse, Tensor mean_z, "
    f"Tensor? g_lp, Tensor? g_ent, Tensor? g_lse, {OPTIONS}) -> Tensor"
)


def distinct(tensors: list[torch.Tensor], inputs: tuple) -> list[torch.Tensor]:
    """``tensors`` with a copy wherever one shares memory with an input or an earlier one
    (a custom op's outputs may not alias); the values, and so the bits, are the same."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    out = []
    for x in tensors:
        ptr = x.untyped_storage().data_ptr()
        if x.numel() and ptr in seen:
            x = x.clone()
            ptr = x.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(x)
    return out


_DTYPES = (
    *[torch.float32] * 3,
    *(torch.bool if name == "is_top1" else torch.float32 for name in EXTRAS),
    *[torch.float32] * 2,
)
"""The dtype of each forward op output (``is_top1``: bool)."""


def _forward_outputs(outputs, lse, mean_z, device, inputs) -> tuple:
    """The 8 outputs of a forward op (None as empty tensors), none aliasing another."""
    flat = [
        torch.empty(0, dtype=dtype, device=device) if x is None else x
        for x, dtype in zip((*outputs, lse, mean_z), _DTYPES, strict=True)
    ]
    return tuple(distinct(flat, inputs))


def _fake_outputs(n: int, device, o: OpOptions) -> tuple:
    """The forward ops' outputs for ``n`` rows, as :func:`_forward_outputs` gives them."""
    asked = (True, o.return_entropy, o.return_lse, *(name in o.extras for name in EXTRAS))
    asked = (*asked, True, o.return_entropy)
    return tuple(
        torch.empty(n if a else 0, dtype=dtype, device=device)
        for a, dtype in zip(asked, _DTYPES, strict=True)
    )


@torch.library.impl(f"{NAMESPACE}::linear_logprob", "CompositeExplicitAutograd", lib=_LIB)
def _linear_logprob(hidden, weight, bias, targets, *options):
    o = OpOptions(*options)
    with amp.autocast_off(hidden.device):  # the caller's graph has cast the inputs
        prep = o.prepared(hidden, weight, bias, targets, validate=o.validate)
        function = resolve_backend(o.backend, prep.inputs.device, deterministic=o.deterministic)
        outputs, lse, mean_z = host_forward(
            function, prep.inputs, prep.weight, prep.bias, prep.targets, prep.params
        )
    return _forward_outputs(outputs, lse, mean_z, lse.device, (hidden, weight, bias, targets))


@torch.library.register_fake(f"{NAMESPACE}::linear_logprob", lib=_LIB)
def _linear_logprob_fake(hidden, weight, bias, targets, *options):
    return _fake_outputs(targets.numel(), hidden.device, OpOptions(*options))


@torch.library.impl(f"{NAMESPACE}::linear_logprob_backward", "CompositeExplicitAutograd", lib=_LIB)
def _linear_logprob_backward(hidden, weight, bias, targets, lse, mean_z, *grads_options):
    g_lp, g_ent, g_lse, needs, *options = grads_options
    o = OpOptions(*options)
    with amp.autocast_off(hidden.device), torch.no_grad():
        prep = o.prepared(hidden, weight, bias, targets, validate=False)
        function = resolve_backend(o.backend, prep.inputs.device, deterministic=o.deterministic)
        saved = (prep.inputs, prep.weight, prep.bias, prep.targets, lse, mean_z)
        saved = (*saved[:5], mean_z if o.return_entropy else None)
        grads = host_backward(function, saved, (g_lp, g_ent, g_lse), tuple(needs), prep.params)
    inputs = (hidden, weight, bias)
    out = [
        hidden.new_empty(0) if g is None else g.to(x.dtype).reshape(x.shape).contiguous()
        for g, x in zip(grads, inputs, strict=True)
    ]
    return tuple(distinct(out, (*inputs, targets, lse, mean_z)))


@torch.library.register_fake(f"{NAMESPACE}::linear_logprob_backward", lib=_LIB)
def _linear_logprob_backward_fake(hidden, weight, bias, targets, lse, mean_z, *grads_options):
    needs = grads_options[3]
    return tuple(
        x.new_empty(x.shape) if need and x is not None else hidden.new_empty(0)
        for need, x in zip(needs, (hidden, weight, bias), strict=True)
    )


@torch.library.impl(f"{NAMESPACE}::vocab_parallel_logprob", "CompositeExplicitAutograd", lib=_LIB)
def _vocab_parallel_logprob(logits, targets, *options):
    o = OpOptions(*options)
    with amp.autocast_off(logits.device):
        prep = o.prepared(logits, None, None, targets, validate=o.validate)
        outputs, lse, mean_z = torch_logits.forward(prep.inputs, prep.targets, prep.params)
    return _forward_outputs(outputs, lse, mean_z, lse.device, (logits, targets))


@torch.library.register_fake(f"{NAMESPACE}::vocab_parallel_logprob", lib=_LIB)
def _vocab_parallel_logprob_fake(logits, targets, *options):
    return _fake_outputs(targets.numel(), logits.device, OpOptions(*options))


@torch.library.impl(
    f"{NAMESPACE}::vocab_parallel_logprob_backward", "CompositeExplicitAutograd", lib=_LIB
)
def _vocab_parallel_logprob_backward(logits, targets, lse, mean_z, g_lp, g_ent, g_lse, *options):
    o = OpOptions(*options)
    with amp.autocast_off(logits.device), torch.no_grad():
        prep = o.prepared(logits, None, None, targets, validate=False)
        mean_z = mean_z if o.return_entropy else None
        upstream = (g_lp, g_ent, g_lse)
        grad = torch_logits.backward(prep.inputs, prep.targets, lse, mean_z, upstream, prep.params)
    grad = grad.to(logits.dtype).reshape(logits.shape).contiguous()
    return distinct([grad], (logits, targets, lse, mean_z))[0]


@torch.library.register_fake(f"{NAMESPACE}::vocab_parallel_logprob_backward", lib=_LIB)
def _vocab_parallel_logprob_backward_fake(logits, targets, lse, mean_z, *grads_options):
    return logits.new_empty(logits.shape)


# --- autograd ------------------------------------------------------------------------------


def _setup(n_inputs: int) -> Callable:
    """``setup_context`` of a forward op whose first ``n_inputs`` arguments are tensors."""

    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # an output that reaches no loss: None, as in eager
        ctx.options = inputs[n_inputs:]
        ctx.save_for_backward(*inputs[:n_inputs], output[6], output[7])
        ctx.mark_non_differentiable(*output[3:])  # the extras and the statistics

    return setup_context


def _upstream(grads, o: OpOptions) -> tuple:
    """``(g_lp, g_ent, g_lse)``: None for an output not asked for."""
    g_lp, g_ent, g_lse = grads[:3]
    return g_lp, g_ent if o.return_entropy else None, g_lse if o.return_lse else None


def _linear_backward(ctx, *grads):
    hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
    o = OpOptions(*ctx.options)
    needs = [bool(x) for x in ctx.needs_input_grad[:3]]
    out = OPS.linear_logprob_backward(
        hidden, weight, bias, targets, lse, mean_z, *_upstream(grads, o), needs, *ctx.options
    )
    grads_in = tuple(g if need else None for g, need in zip(out, needs, strict=True))
    return (*grads_in, None) + (None,) * len(ctx.options)


def _logits_backward(ctx, *grads):
    logits, targets, lse, mean_z = ctx.saved_tensors
    o = OpOptions(*ctx.options)
    grad = OPS.vocab_parallel_logprob_backward(
        logits, targets, lse, mean_z, *_upstream(grads, o), *ctx.options
    )
    return (grad, None) + (None,) * len(ctx.options)


torch.library.register_autograd(
    f"{NAMESPACE}::linear_logprob", _linear_backward, setup_context=_setup(4), lib=_LIB
)
torch.library.register_autograd(
    f"{NAMESPACE}::vocab_parallel_logprob", _logits_backward, setup_context=_setup(2), lib=_LIB
)


# --- what the public ops call under torch.compile ------------------------------------------


def _result(outs: tuple, lead: torch.Size, o: OpOptions) -> LogProbOutput:
    """The public result of a forward op's outputs (None for those not asked for)."""
    asked = (True, o.return_entropy, o.return_lse, *(name in o.extras for name in EXTRAS))
    views = [x.view(lead) if a else None for x, a in zip(outs[:6], asked, strict=True)]
    logprob, entropy, lse, *extras = views
    return LogProbOutput(logprob, entropy, lse, **dict(zip(EXTRAS, extras, strict=True)))


def linear_logprob(hidden, weight, targets, bias, options: list) -> LogProbOutput:
    """``lp::linear_logprob`` for the public op's arguments (``options``: :func:`op_options`),
    with autocast's casts of ``hidden``, ``weight`` and ``bias`` made here, as eager mode
    makes them, so that they are in the caller's graph."""
    if bias is None:
        hidden, weight = amp.autocast_inputs(hidden, weight)
    else:
        hidden, weight, bias = amp.autocast_inputs(hidden, weight, bias)
    outs = OPS.linear_logprob(hidden, weight, bias, targets, *options)
    return _result(outs, targets.shape, OpOptions(*options))


def vocab_parallel_logprob(logits, targets, options: list) -> LogProbOutput:
    """``lp::vocab_parallel_logprob`` for the public op's arguments."""
    outs = OPS.vocab_parallel_logprob(logits, targets, *options)
    return _result(outs, targets.shape, OpOptions(*options))
