"""Compile lp's Triton kernels for a GPU on a machine without one (test-only).

The CPU suite runs the kernels under Triton's interpreter, which executes their Python
bodies and so never sees what only the compiler rejects: a global that is not a
``tl.constexpr``, code after an early ``return`` under a constexpr ``if`` (Triton still
compiles it), a tensor descriptor used as a pointer. Those failures otherwise surface only
on the GPU machine, one device call later.

This module runs ``linear_logprob`` (and ``linear_logprob_loss``) forward and backward on
CPU tensors with every
``JITFunction.run`` intercepted: each launch is recorded instead of run, with the GPU's
pinned tile configs (``config_for`` and the launch options are steered to a CUDA device of
the chosen shared-memory tier) and tensor descriptors where the GPU path would build them.
Each distinct launch is then compiled ahead of time for ``sm_90`` (ptxas included) with
``triton.compile``. The kernels' outputs are never computed, so nothing numeric is checked
here; the interpreter and the GPU suites do that.

Each line also gives the compiled kernel's registers per thread and its stack frame, read
from the cubin with the ``cuobjdump`` that Triton bundles: a stack frame in these kernels
means registers spilled to local memory (a pointer block held beside an accumulator is
the usual cause). The numbers are those of the installed Triton, which
need not be the GPU machine's.

It must run in a process without ``TRITON_INTERPRET=1`` (``triton.jit`` then returns
interpreter objects that cannot be compiled). ``lp_kernels.backends.resolve.triton_interpreting``
is patched instead, so the triton backend accepts CPU tensors. Usage::

    python -m lp_testing.aot [--tiers large,mid,small] [--variants all] [--jobs N]
        [--options] [--sass] [--only NAME]

It prints one line per compiled launch with its shared memory, and exits non-zero if any
failed to compile or needs more shared memory than the smallest tier it serves offers
(``smem_limit``): a launch error that would otherwise surface only on the GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import os
import sys
import time
import types
from collections.abc import Iterator
from unittest import mock

import torch

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


# The triton backend's modules: a patched name is replaced in each that holds it.
_TRITON = "lp_kernels.backends.triton"
_MODULES = (
    "config", "plan", "tl_utils", "softmax", "forward", "backward", "gemm", "fixed_point",
    "linear", "deterministic", "loss",
)  # fmt: skip
# Streaming multiprocessors of the pretend GPU (triton.config.sm_count): H200's. With it
# the small problems below take the GEMM's narrow output tile (triton.plan.mm_block_n);
# the "wide" variant prices the narrow tile out, so they take the pinned one.
SMS = 132

# Launch variants compiled by ``--variants all``: name -> ``{"config": KernelConfig phase
# fields replaced in every pinned config (``KernelConfig.replace``), "patch": [(name,
# function of the old value)]}``.
EXPERIMENTS = {
    "wide": {"config": {"gemm": {"narrow_cost": float("inf")}}},
    "two-chunks": {"patch": [("chunks_per_launch", lambda old: lambda *args: 2)]},
    # two chunks per launch in one program per output block (MULTI) where they would split
    "two-chunks-multi": {
        "patch": [
            ("chunks_per_launch", lambda old: lambda *args: 2),
            ("split_chunks", lambda old: lambda *args: False),
        ]
    },
}


def _modules() -> list[types.ModuleType]:
    return [importlib.import_module(f"{_TRITON}.{name}") for name in _MODULES]


def _everywhere(name: str, value) -> list[tuple]:
    """``(module, name, value)`` for every triton-backend module that holds ``name`` (the
    object it holds, or a function of it when ``value`` is callable with ``old=``)."""
    out = []
    for mod in _modules():
        if hasattr(mod, name):
            out.append((mod, name, value(getattr(mod, name)) if callable(value) else value))
    return out


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch, reduced to what compiling it needs."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...] = ()
    """Arguments the JIT would mark 16-divisible (``tt.divisibility``): see :func:`_specialize`."""

    def describe(self) -> str:
        flags = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        descs = [t for _, t in self.signature if t.startswith("tensordesc")]
        return f"{self.kernel}[{flags}; {opts}{'; TMA' if descs else ''}]"


def _arg_type(value) -> str:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):
        shape = ", ".join(str(s) for s in value.block_shape)
        return f"tensordesc<{_DTYPES[value.base.dtype]}[{shape}]>"
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature type for a {type(value).__name__} argument")


def _specialize(param, value) -> tuple[str, object]:
    """How Triton's JIT specializes a runtime argument at a GPU launch: ``("constexpr", 1)``
    for an int equal to 1, ``("aligned", None)`` for an int divisible by 16 or a tensor
    whose address is (``tt.divisibility = 16``), else ``("plain", None)``; parameters in
    ``do_not_specialize`` (``do_not_specialize_on_alignment``) keep all (their alignment).
    Without it the compiled code would assume nothing of strides and addresses and
    vectorize no store: not what the GPU runs."""
    if value is None:  # an absent optional pointer: a constexpr None
        return "constexpr", None
    if param.do_not_specialize or isinstance(value, bool):
        return "plain", None
    if isinstance(value, int) and value == 1:
        return "constexpr", 1
    if param.do_not_specialize_on_alignment:
        return "plain", None
    if isinstance(value, int) and value % 16 == 0:
        return "aligned", None
    if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0:
        return "aligned", None
    return "plain", None


def _record(fn, args, kwargs) -> Launch:
    params = fn.params
    values = dict(zip((p.name for p in params[: len(args)]), args, strict=True))
    options = {}
    for key, value in kwargs.items():
        if key in ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"):
            options[key] = value
        else:
            values[key] = value
    signature, constexprs, aligned = [], [], []
    for p in params:
        if p.name not in values:
            if not p.has_default:
                raise TypeError(f"{fn.__name__}: no value recorded for {p.name}")
            values[p.name] = p.default
        value = values[p.name]
        kind, fixed = ("constexpr", value) if p.is_constexpr else _specialize(p, value)
        if kind == "constexpr":
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, fixed))
        else:
            signature.append((p.name, _arg_type(value)))
            if kind == "aligned":
                aligned.append(p.name)
    return Launch(
        fn.__name__, tuple(signature), tuple(constexprs), tuple(sorted(options.items())),
        tuple(aligned),
    )  # fmt: skip


@contextlib.contextmanager
def gpu_launches(tier: str = "large", config_fields: dict | None = None) -> Iterator[list]:
    """Inside: lp's triton backend accepts CPU tensors, picks the GPU configs of a CUDA
    device of ``tier`` (with ``config_fields`` replaced) and records every kernel launch
    (fn, Launch) into the yielded list without running it."""
    from triton.runtime.jit import JITFunction

    import lp_kernels.backends.resolve as backends
    import lp_kernels.backends.triton.config as config
    import lp_kernels.backends.triton.fixed_point as fixed_point
    import lp_kernels.backends.triton.tl_utils as tl_utils

    if not isinstance(tl_utils.swizzle, JITFunction):
        raise RuntimeError("lp_testing.aot needs TRITON_INTERPRET unset (it compiles the kernels)")
    fake = types.SimpleNamespace(type="cuda", index=0)
    launches: list = []
    pinned, fixed_for = config.config_for, fixed_point.fixed_blocks_for
    opts, compile_opts = config.launch_opts, config.compile_opts
    fields = dict(config_fields or {})

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, _record(self, args, kwargs)))

    def config_for(device, dtype=torch.bfloat16):
        cfg = pinned(fake, dtype)
        return cfg.replace(**fields) if fields else cfg

    settings = [(JITFunction, "run", run), (backends, "triton_interpreting", lambda: True)]
    for name, value in (
        ("gpu_tier", lambda device: tier),
        ("sm_count", lambda device: SMS),
        ("config_for", config_for),
        ("fixed_blocks_for", lambda device, dtype: fixed_for(fake, dtype)),
        ("launch_opts", lambda phase, device: opts(phase, fake)),
        ("compile_opts", lambda device: compile_opts(fake)),
        ("full_stages", lambda a: a.element_size() <= 2 and tier == "large"),
    ):
        settings += _everywhere(name, lambda old, value=value: value)
    with _patched(*settings):
        yield launches


@contextlib.contextmanager
def _patched(*settings) -> Iterator[None]:
    """Set each ``(object, attribute, value)`` inside, restoring them all on exit."""
    with contextlib.ExitStack() as stack:
        for obj, name, value in settings:
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def _problems(options: bool = False):
    """(dtype, deterministic, entropy, H, deterministic_tile, V, cover) of the calls
    whose launches get compiled: both input dtype classes, both modes, with and without
    entropy, H a multiple of the tile or not, rows whose stride rules out tensor
    descriptors (H = 100 in bf16: 200 bytes), which takes the pointer path of every kernel,
    and deterministic tiles of every kind (several per vocabulary chunk, one per chunk, cut
    into chunks: see triton.plan.tile_chunks). ``cover``: the logit options
    (``"bias"``, with its gradient, ``"softcap"`` and ``"scale"``, a logit_scale), the
    kernels' HAS_BIAS / BIAS_GRAD / CAP / SCALE variants. ``options``: also the bf16
    default-mode calls of every option set, with and without entropy, beside the plain ones
    (``--options``: what each option adds to the same tile's code)."""
    both = ("bias", "softcap")
    for det in (False, True):
        for dtype in (torch.bfloat16, torch.float32):
            for entropy, h in ((True, 256), (False, 200)):
                yield dtype, det, entropy, h, 128, 1000, ()
            yield dtype, det, True, 256, 128, 1000, both
        yield torch.bfloat16, det, True, 100, 128, 1000, ()
        for entropy in (False, True):  # every option: SCALE beside CAP and HAS_BIAS
            yield torch.bfloat16, det, entropy, 256, 128, 1000, (*both, "scale")
    for dtype in (torch.bfloat16, torch.float32):
        for tile, v in ((384, 1000), (4224, 9000), (8320, 17000)):
            yield dtype, True, True, 256, tile, v, ()
        yield dtype, True, True, 256, 4224, 9000, both
        # several vocabulary chunks at small N: the default backward's chunk groups (the
        # grad_hidden GEMM summing each chunk apart in one launch: MULTI; with "group2",
        # two groups of two, the second accumulating)
        yield dtype, False, True, 256, 128, 25000, ()
    if options:
        for entropy in (False, True):
            for cover in ((), ("bias",), ("softcap",), both):
                yield torch.bfloat16, False, entropy, 256, 128, 1000, cover


def _every_output(logprob, entropy, lse):
    """A loss of every output of ``linear_logprob_loss`` (its launches' constexprs)."""
    out = -logprob + 0.01 * lse * lse
    return out if entropy is None else out - 0.1 * entropy


def collect(
    tier: str = "large", experiments: tuple[str, ...] = (), options: bool = False
) -> dict[Launch, object]:
    """Distinct launches (-> the JITFunction) of forward + backward over :func:`_problems`
    (``options``: see there), with each named launch variant in turn on top of the
    defaults."""
    from lp_kernels import linear_logprob, linear_logprob_loss

    found: dict[Launch, object] = {}
    for setting in [None, *experiments]:
        variant = EXPERIMENTS[setting] if setting is not None else {}
        changes = []
        for attr, value in variant.get("patch", []):
            changes += _everywhere(attr, value)
        with _patched(*changes):
            for dtype, det, entropy, h, tile, v, cover in _problems(options):
                gen = torch.Generator().manual_seed(0)
                n = 300
                hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
                weight = torch.randn(v, h, generator=gen).to(dtype).requires_grad_()
                targets = torch.randint(0, v, (n,), generator=gen)
                extra = {}
                if "bias" in cover:
                    extra["bias"] = torch.randn(v, generator=gen).requires_grad_()
                if "softcap" in cover:
                    extra["softcap"] = 30.0
                if "scale" in cover:
                    extra["logit_scale"] = 0.5
                with gpu_launches(tier, variant.get("config")) as launches:
                    out = linear_logprob(
                        hidden, weight, targets, backend="triton", deterministic=det,
                        deterministic_tile=tile, return_entropy=entropy, validate=False,
                        **extra,
                    )  # fmt: skip
                    loss = out.logprob.sum() + (out.entropy.sum() if entropy else 0)
                    loss.backward()
                    if not det:  # linear_logprob_loss: the forward's STORE_L, dlogits_l
                        fused = linear_logprob_loss(
                            hidden, weight, targets, _every_output, backend="triton",
                            return_entropy=entropy, validate=False, **extra,
                        )  # fmt: skip
                        fused.loss.backward()
                for fn, launch in launches:
                    found.setdefault(launch, fn)
    return found


def smem_limit(tier: str) -> int:
    """Shared memory per block (bytes) of the smallest GPU in a tier of
    :func:`lp_kernels.backends.triton.config.gpu_tier`: Hopper's 227 KiB (large), A100's
    163 KiB (mid), Ada's and consumer Ampere's 99 KiB (small). The tier thresholds (200 and
    160 KiB) only sort GPUs between these."""
    return {"large": 227 << 10, "mid": 163 << 10, "small": 99 << 10}[tier]


def cuobjdump(cubin: bytes, flag: str) -> str | None:
    """The output of Triton's bundled ``cuobjdump flag`` on a cubin; None if the tool is
    missing."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(cubin: bytes) -> tuple[int, int] | None:
    """(registers per thread, stack frame bytes) of a compiled kernel, from ``cuobjdump
    -res-usage``; None if the tool is missing or says nothing."""
    import re

    found = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "-res-usage") or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def sass_counts(cubin: bytes) -> dict[str, int] | None:
    """SASS instructions of a compiled kernel, from ``cuobjdump -sass``: ``{"all": n}`` and
    the count of each of :data:`SASS_OPS` (the special-function unit's ``MUFU``, warp
    shuffles, global stores); None if the tool is missing. Loops count once: compare
    variants of one kernel, whose main loops are the same."""
    import collections
    import re

    out = cuobjdump(cubin, "-sass")
    if out is None:
        return None
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", out)
    counts = collections.Counter(ops)
    return {"all": len(ops), **{op: counts[op] for op in SASS_OPS}}


SASS_OPS = ("MUFU", "SHFL", "STG")
"""The instruction kinds :func:`sass_counts` counts apart."""


def _compile(
    fn, launch: Launch, arch: int, limit: int, sass: bool = False
) -> tuple[str | None, int | None, tuple[int, int] | None, dict[str, int] | None]:
    """(error or None, shared memory bytes, :func:`resources`, :func:`sass_counts` if
    ``sass``) of compiling ``launch``; a kernel that needs more shared memory than
    ``limit`` is an error (it would fail at launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [name for name, _ in launch.signature]
    constexprs = {(names.index(k),): v for k, v in launch.constexprs}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in launch.aligned}
    src = ASTSource(fn, dict(launch.signature), constexprs, attrs)
    try:
        kernel = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options)
        )
    except Exception as exc:  # reported per launch
        return f"{type(exc).__name__}: {exc}", None, None, None
    shared = kernel.metadata.shared
    res = resources(kernel.asm["cubin"])
    counts = sass_counts(kernel.asm["cubin"]) if sass else None
    if shared > limit:
        return (
            f"needs {shared / 1024:.1f} KiB of shared memory; its tier offers {limit >> 10}",
            shared,
            res,
            counts,
        )
    return None, shared, res, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="large", help="shared-memory tiers: large,mid,small")
    parser.add_argument(
        "--variants", default="", help=f"launch variants too: all or {','.join(EXPERIMENTS)}"
    )
    parser.add_argument(
        "--options", action="store_true",
        help="also every logit option set (bias, softcap, both; with and without entropy) "
        "on the bf16 default-mode tile",
    )  # fmt: skip
    parser.add_argument(
        "--sass", action="store_true",
        help="SASS instruction counts per launch: all, MUFU, SHFL, STG (cuobjdump)",
    )  # fmt: skip
    parser.add_argument("--only", default="", help="compile only launches whose line has this")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run without TRITON_INTERPRET=1: this compiles the kernels")
    names = (
        list(EXPERIMENTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    )
    for v in names:
        if v not in EXPERIMENTS:
            parser.error(f"--variants: unknown {v!r}; expected all or {', '.join(EXPERIMENTS)}")
    found: dict[Launch, tuple[object, int]] = {}  # -> (JITFunction, smallest tier limit)
    for tier in args.tiers.split(","):
        for launch, fn in collect(tier, tuple(names), args.options).items():
            if args.only not in launch.describe():
                continue
            limit = min(smem_limit(tier), found.get(launch, (fn, smem_limit(tier)))[1])
            found[launch] = (fn, limit)
    t0 = time.perf_counter()
    failed = 0

    def work(item):
        launch, (fn, limit) = item
        return launch, *_compile(fn, launch, args.arch, limit, args.sass)

    # Threads: most of a compile is spent in MLIR passes and ptxas, outside the GIL.
    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        for launch, error, shared, res, counts in pool.map(work, found.items()):
            status = "ok" if error is None else "FAILED"
            smem = "-" if shared is None else f"{shared / 1024:.1f} KiB"
            regs = "-" if res is None else f"{res[0]:3d} regs {res[1]:5d} B stack"
            sass = ""
            if counts is not None:
                sass = f"{counts['all']:6d} ins " + " ".join(
                    f"{counts[op]:4d} {op.lower()}" for op in SASS_OPS
                ) + "  "  # fmt: skip
            print(f"{status:6} {smem:>10}  {regs:>20}  {sass}{launch.describe()}")
            if error is not None:
                failed += 1
                print("       " + error.replace("\n", "\n       "))
    print(f"{len(found) - failed}/{len(found)} launches compiled for sm_{args.arch} "
          f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
