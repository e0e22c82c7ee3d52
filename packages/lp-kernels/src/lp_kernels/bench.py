"""The performance protocol and the self-test behind ``lp bench`` and ``lp check``.

Performance protocol (DESIGN.md), one run per shape (N tokens, H hidden, V vocab):

- floor (GPU only): the median time of four back-to-back cuBLAS ``[N, H] x [H, V]``
  matmuls in the input dtype (forward logits, backward recompute, two gradient GEMMs),
  measured in the same process at steady state (below). ``floor_single_ms`` keeps the
  earlier figure, 4 x the median of one matmul timed first on an idle GPU: a burst
  that runs at boost clock, up to 16 % below what a sustained sequence of matmuls takes
  on an H200 at its power limit (docs/benchmarks.md, "Steady state");
- each provider: forward + backward of a per-token logprob (and entropy with
  ``entropy=True``) with a random upstream gradient; median of ``reps`` timed runs after
  ``warmup`` runs and, on GPU, at least ``warm_s`` seconds of warm-up, so that the floor
  and every provider are timed at the clock their own sustained load settles to (CUDA
  events on GPU, ``time.perf_counter`` on CPU), peak memory above
  the inputs (``torch.cuda.max_memory_allocated`` on GPU, the returned gradients
  included; on CPU the storages allocated during one call, tracked as by ``lp demo``),
  and errors against a reference: norm-wise relative error of logprob, grad_hidden,
  grad_weight (and entropy), max abs error of logprob.
- reference: fp32 on GPU (TF32 off), fp64 on CPU; row chunks of logits, ``log_softmax``
  and the closed-form gradient, independent of lp.

Providers: ``lp-triton``, ``lp-torch``, ``lp-auto`` (lp's backends; ``lp-triton-det`` and
``lp-torch-det`` run them with ``deterministic=True`` and its default tile,
``lp-triton-det128`` with 128-column tiles), ``materialized``
(logits in the input dtype, fp32 ``log_softmax``, gather), and peers when importable
(never dependencies): ``liger`` (liger-kernel's fused linear cross entropy; a scalar
loss, so timing and memory only, no error figures) and ``cce`` (Apple's
cut-cross-entropy, per-token loss, errors included). Peers run on CUDA at temperature 1
without entropy only; other rows are marked skipped.

``lp check`` (:func:`run_checks`): parity of logprob / entropy / lse and both gradients
against an fp64 autograd reference on small awkward shapes (padded vocabulary, ignored
rows, temperature), run-to-run bitwise reproducibility, and gloo TP=2 runs on CPU
(two spawned processes, uneven shards) against the single-process result: the default
path within tolerance, ``deterministic=True`` bitwise.

``benchmarks/protocol.py`` is a thin wrapper over :func:`protocol_main`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from lp_kernels._dist import deterministic_tile_for
from lp_kernels.linear_logprob import _triton_interpreting

SHAPES: dict[str, tuple[int, int, int]] = {
    "S1": (8192, 4096, 151936),
    "S2": (16384, 2048, 248320),
    "S3": (32768, 4096, 128256),
    "S4": (16384, 2048, 62080),
}
CPU_SHAPES: dict[str, tuple[int, int, int]] = {"cpu": (256, 128, 16003)}
"""The embedded default problem of ``lp bench`` on CPU (well under a minute on 2 cores)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LP_PROVIDERS = (
    "lp-triton",
    "lp-torch",
    "lp-auto",
    "lp-triton-det",
    "lp-torch-det",
    "lp-triton-det128",
)
"""lp's backends; ``-det`` runs ``deterministic=True`` (bitwise TP-invariant mode) with its
default tile (``default_deterministic_tile``: about an eighth of the vocabulary),
``-det128`` the same with 128-column tiles."""


def tile_arg(spec: str, vocab: int) -> int:
    """A ``--det-tile`` of the benchmark scripts: an int, or ``tpN`` for the widest tile of
    TP degrees dividing N (``tp8``: ``linear_logprob``'s default)."""
    if spec.startswith("tp"):
        return deterministic_tile_for(vocab, int(spec[2:]))
    return int(spec)


PEERS = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}  # provider -> module
PEER_DISTS = {"liger": "liger-kernel", "cce": "cut-cross-entropy"}  # provider -> distribution
ALL_PROVIDERS = (*LP_PROVIDERS, "materialized", *PEERS)
ERROR_KEYS = ("err_logprob", "maxabs_logprob", "err_grad_hidden", "err_grad_weight")


class Unsupported(Exception):
    """A provider cannot run this configuration (the row is marked skipped)."""


# ----------------------------------------------------------------------------- inputs, timing


def make_inputs(
    n: int,
    h: int,
    v: int,
    *,
    seed: int = 0,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
):
    """hidden/weight with LM-like logit magnitudes (std about 2), targets, upstream grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad_out = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, grad_out


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int,
    reps: int,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (CUDA events).

    ``before`` runs ahead of each timed call, outside the timing (e.g. queueing GPU work
    so that the call's host work before its first kernel is hidden).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def floor_call(hidden: torch.Tensor, weight: torch.Tensor) -> Callable[[], None]:
    """The floor's work as one call: four back-to-back ``hidden @ weight.T`` matmuls."""

    def four() -> None:
        for _ in range(4):
            hidden @ weight.T

    return four


def steady_warmup(
    fn: Callable[[], object], warmup: int, warm_s: float, tp: int = 1, device: str = "cuda"
) -> int:
    """Warm-up calls for :func:`time_cuda` such that they last at least ``warm_s`` seconds
    (and are at least ``warmup``): a GPU at its power limit runs sustained work at a lower
    clock than a burst after idle, so each call is timed once its clock has settled under
    its own load (docs/benchmarks.md, "Steady state"). Runs ``fn`` twice to time it (the
    first call compiles and allocates). Under TP (``tp > 1``, every rank of the default
    group calls this) every rank gets the largest count, so that collectives inside ``fn``
    stay paired.
    """
    if warm_s <= 0:
        return warmup
    fn()
    timer = time_cuda if device == "cuda" else time_cpu
    ms = statistics.median(timer(fn, warmup=0, reps=1))
    count = max(warmup, math.ceil(warm_s * 1e3 / max(ms, 1e-3)))
    if tp > 1:
        count = int(_all_ranks_max(float(count), device))
    return count


def time_cpu(fn: Callable[[], object], *, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (``time.perf_counter``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak memory of one call of ``fn`` above what was allocated before it."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from lp_kernels.cli import _LiveBytes  # the tracker of `lp demo`

    with _LiveBytes() as tracker:
        fn()
    return tracker.peak


# ----------------------------------------------------------------------------- reference


@torch.no_grad()
def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
    rows: int = 2048,
) -> dict[str, torch.Tensor]:
    """logprob, entropy, grad_hidden, grad_weight in ``dtype``, chunked over rows, without lp.

    The upstream gradient is ``grad_out`` on logprob and ``grad_entropy`` (if given) on
    entropy; the gradient is the closed form ``dz = g (onehot - p) - g_ent p (log p + H)``,
    divided by the temperature. TF32 is off during the call.
    """
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        dev = hidden.device
        w = weight.to(dtype)
        n = hidden.shape[0]
        logprob = torch.empty(n, device=dev, dtype=dtype)
        entropy = torch.empty(n, device=dev, dtype=dtype)
        grad_h = torch.empty(hidden.shape, device=dev, dtype=dtype)
        grad_w = torch.zeros(w.shape, device=dev, dtype=dtype)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            h = hidden[r0:r1].to(dtype)
            ls = torch.log_softmax((h @ w.T) / temperature, dim=-1)
            t = targets[r0:r1]
            logprob[r0:r1] = ls.gather(1, t[:, None]).squeeze(1)
            p = ls.exp()
            ent = -(p * ls).sum(-1)
            entropy[r0:r1] = ent
            g = grad_out[r0:r1].to(dtype)
            dz = p * (-g[:, None])
            dz[torch.arange(r1 - r0, device=dev), t] += g
            if grad_entropy is not None:
                dz -= grad_entropy[r0:r1].to(dtype)[:, None] * p * (ls + ent[:, None])
            dz /= temperature
            grad_h[r0:r1] = dz @ w
            grad_w.addmm_(dz.T, h)
            del ls, p, dz
        return {
            "logprob": logprob,
            "entropy": entropy,
            "grad_hidden": grad_h,
            "grad_weight": grad_w,
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def fp32_reference(hidden, weight, targets, grad_out, *, rows: int = 2048):
    """(logprob, grad_hidden, grad_weight) in fp32 (the protocol's original interface)."""
    ref = reference(hidden, weight, targets, grad_out, rows=rows)
    return ref["logprob"], ref["grad_hidden"], ref["grad_weight"]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``ref`` (in ``ref``'s dtype)."""
    return float((a.to(ref.dtype) - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- providers

# step(hidden, weight, targets, grad_out, grad_entropy) -> (logprob, entropy | None) after
# running the backward; logprob None when the provider has no per-token output.
Step = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


def provider_lp(
    backend: str,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    deterministic: bool = False,
    tile: int | None = None,
    tp: dict | None = None,
) -> Step:
    """lp's ``linear_logprob``; ``tp``: ``tp_group``, ``vocab_start``, ``vocab_size`` kwargs;
    ``tile``: ``deterministic_tile`` (None: the default)."""
    from lp_kernels import linear_logprob

    def run(hidden, weight, targets, grad_out, grad_entropy=None):
        out = linear_logprob(
            hidden,
            weight,
            targets,
            temperature=temperature,
            return_entropy=entropy,
            backend=backend,
            validate=False,
            deterministic=deterministic,
            deterministic_tile=tile,
            **(tp or {}),
        )
        if entropy:
            torch.autograd.backward([out.logprob, out.entropy], [grad_out, grad_entropy])
            return out.logprob.detach(), out.entropy.detach()
        out.logprob.backward(grad_out)
        return out.logprob.detach(), None

    return run


def provider_materialized(*, temperature: float = 1.0, entropy: bool = False) -> Step:
    """What a naive trainer does: logits in the input dtype, fp32 log_softmax, gather."""

    def run(hidden, weight, targets, grad_out, grad_entropy=None):
        logits = (hidden @ weight.T).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        logprob = logp.gather(1, targets[:, None]).squeeze(1)
        if entropy:
            ent = -(logp.exp() * logp).sum(-1)
            torch.autograd.backward([logprob, ent], [grad_out, grad_entropy])
            return logprob.detach(), ent.detach()
        logprob.backward(grad_out)
        return logprob.detach(), None

    return run


def _peer_guard(name: str, temperature: float, entropy: bool) -> None:
    if importlib.util.find_spec(PEERS[name]) is None:
        raise Unsupported(f"{PEERS[name]} is not importable")
    if temperature != 1.0 or entropy:
        raise Unsupported("peers run at temperature 1 without entropy only")


def provider_liger(*, temperature: float = 1.0, entropy: bool = False) -> Step:
    """liger-kernel's fused linear cross entropy; its backward is fused into the forward for a
    scalar loss, so it runs as ``sum(CE)`` (timing and memory only, no per-token output)."""
    _peer_guard("liger", temperature, entropy)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def run(hidden, weight, targets, grad_out, grad_entropy=None):
        loss = liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
        loss.backward()
        return None, None

    return run


def provider_cce(*, temperature: float = 1.0, entropy: bool = False) -> Step:
    """Apple's cut-cross-entropy, per-token loss (``logprob = -loss``), default settings."""
    _peer_guard("cce", temperature, entropy)
    from cut_cross_entropy import linear_cross_entropy

    def run(hidden, weight, targets, grad_out, grad_entropy=None):
        logprob = -linear_cross_entropy(hidden, weight, targets, reduction="none")
        logprob.backward(grad_out)
        return logprob.detach(), None

    return run


def make_provider(
    name: str, *, temperature: float = 1.0, entropy: bool = False, tp: dict | None = None
) -> Step:
    if name in LP_PROVIDERS:
        backend = name.removeprefix("lp-").removesuffix("128").removesuffix("-det")
        return provider_lp(
            backend,
            temperature=temperature,
            entropy=entropy,
            deterministic="-det" in name,
            tile=128 if name.endswith("-det128") else None,
            tp=tp,
        )
    if tp is not None:
        raise Unsupported("a single-device provider (lp bench under tensor parallelism)")
    factory = {
        "materialized": provider_materialized,
        "liger": provider_liger,
        "cce": provider_cce,
    }[name]
    return factory(temperature=temperature, entropy=entropy)


PROVIDERS: dict[str, Callable[[], Step]] = {
    name: (lambda name=name: make_provider(name)) for name in ALL_PROVIDERS
}


def provider_available(name: str, device: str) -> str | None:
    """None if ``name`` can run on ``device``, else why not."""
    if name in PEERS:
        if importlib.util.find_spec(PEERS[name]) is None:
            return f"{PEERS[name]} is not importable"
        if device != "cuda":
            return "peers run on CUDA only"
    if name in ("lp-triton", "lp-triton-det", "lp-triton-det128"):
        if importlib.util.find_spec("triton") is None:
            return "triton is not importable"
        if device != "cuda" and not _triton_interpreting():
            return "the triton backend needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    return None


def default_providers(device: str) -> list[str]:
    names = ["lp-triton", "lp-torch", "materialized", *PEERS]
    if device != "cuda":
        names = ["lp-torch", "materialized"]
    return [n for n in names if provider_available(n, device) is None]


# ----------------------------------------------------------------------------- one shape


@dataclass(frozen=True)
class BenchConfig:
    """One ``lp bench`` run."""

    shapes: tuple[tuple[str, int, int, int], ...]
    providers: tuple[str, ...]
    dtypes: tuple[str, ...]
    device: str
    temperature: float = 1.0
    entropy: bool = False
    reps: int = 5
    warmup: int = 2
    warm_s: float = 0.0
    """GPU: warm each timed call up for at least this many seconds (steady clocks)."""
    check: bool = True
    seed: int = 0
    tp: int = 1
    """Tensor-parallel degree: under torchrun, each rank holds V / tp rows of the head."""


def tp_shard(weight: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's ``[V_pad / tp, H]`` shard of ``weight`` and its global start.

    The vocabulary is padded to a multiple of 128 x tp (as Megatron pads it), with zero
    rows that ``vocab_size`` excludes, so shards are even and 128-aligned
    (``deterministic=True`` accepts them).
    """
    v, h = weight.shape
    size = -(-v // (128 * tp)) * 128
    start = rank * size
    shard = torch.zeros((size, h), dtype=weight.dtype, device=weight.device)
    real = max(0, min(size, v - start))
    shard[:real] = weight[start : start + real]
    return shard, start


def _all_ranks_max(x: float | None, device: str) -> float | None:
    """The maximum of ``x`` over the ranks (the slowest rank sets a TP step's time)."""
    import torch.distributed as dist

    if x is None:
        return None
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_problem(
    shape: tuple[str, int, int, int],
    dtype_name: str,
    cfg: BenchConfig,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Floor (GPU), reference and every provider on one shape and dtype; one row each.

    With ``cfg.tp > 1`` (every rank of a torchrun launch calls this): each rank holds an
    even 128-aligned shard of the head; the floor is 4 matmuls of the per-rank shard;
    times and peaks are the maxima over ranks; errors are rank 0's outputs, its
    grad_weight shard and the all-reduced grad_hidden against the full reference.
    Single-device providers are marked skipped.
    """
    name, n, h, v = shape
    cuda = cfg.device == "cuda"
    dtype = DTYPES[dtype_name]
    hidden, weight, targets, grad_out = make_inputs(
        n, h, v, seed=cfg.seed, device=cfg.device, dtype=dtype
    )
    tp_kwargs, shard, start = None, weight, 0
    if cfg.tp > 1:
        import torch.distributed as dist

        shard, start = tp_shard(weight, cfg.tp, dist.get_rank())
        tp_kwargs = {"tp_group": dist.group.WORLD, "vocab_start": start, "vocab_size": v}
    grad_ent = None
    if cfg.entropy:
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        grad_ent = torch.randn(n, generator=gen).to(cfg.device)
    floor = floor_single = None
    if cuda:
        # Taken first, on a GPU that has been idle: the burst figure of earlier runs.
        mm = statistics.median(
            time_cuda(lambda: hidden @ shard.T, warmup=cfg.warmup, reps=cfg.reps)
        )
        floor_single = 4 * mm
        four = floor_call(hidden, shard)
        warm = steady_warmup(four, cfg.warmup, cfg.warm_s, cfg.tp)
        floor = statistics.median(time_cuda(four, warmup=warm, reps=cfg.reps))
        if cfg.tp > 1:
            floor = _all_ranks_max(floor, cfg.device)
            floor_single = _all_ranks_max(floor_single, cfg.device)
    ref = None
    if cfg.check:
        ref = reference(
            hidden,
            weight,
            targets,
            grad_out,
            grad_ent,
            temperature=cfg.temperature,
            dtype=torch.float32 if cuda else torch.float64,
        )
    rows = []
    for prov in cfg.providers:
        row: dict = {"shape": name, "N": n, "H": h, "V": v, "dtype": dtype_name}
        row |= {"provider": prov, "floor_ms": floor, "floor_single_ms": floor_single}
        if cfg.tp > 1:
            row["tp"] = cfg.tp
        try:
            fn = make_provider(prov, temperature=cfg.temperature, entropy=cfg.entropy, tp=tp_kwargs)
        except Unsupported as exc:
            row["skipped"] = str(exc)
            rows.append(row)
            if on_row:
                on_row(row)
            continue
        hl = hidden.detach().requires_grad_()
        wl = shard.detach().requires_grad_()

        def step(fn=fn, hl=hl, wl=wl):
            hl.grad = wl.grad = None
            return fn(hl, wl, targets, grad_out, grad_ent)

        try:
            if cuda:
                warm = steady_warmup(step, cfg.warmup, cfg.warm_s, cfg.tp)
                times = time_cuda(step, warmup=warm, reps=cfg.reps)
            else:
                times = time_cpu(step, warmup=cfg.warmup, reps=cfg.reps)
            hl.grad = wl.grad = None
            peak = peak_bytes(step, cfg.device)
            hl.grad = wl.grad = None
            logprob, ent = step()  # the results checked (the memory run may be traced)
            ms = statistics.median(times)
            if cfg.tp > 1:
                ms = _all_ranks_max(ms, cfg.device)
                peak = int(_all_ranks_max(float(peak), cfg.device))
            row.update(
                ms=ms,
                ms_all=times,
                x_floor=ms / floor if floor else None,
                x_floor_single=ms / floor_single if floor_single else None,
                peak_bytes=peak,
                peak_gib=peak / 2**30,
            )
            if ref is not None and logprob is not None:
                row.update(
                    err_logprob=rel_err(logprob, ref["logprob"]),
                    maxabs_logprob=float(
                        (logprob.to(ref["logprob"].dtype) - ref["logprob"]).abs().max()
                    ),
                    err_grad_hidden=rel_err(hl.grad, ref["grad_hidden"]),
                    err_grad_weight=rel_err(
                        wl.grad[: max(0, min(shard.shape[0], v - start))],
                        ref["grad_weight"][start : start + shard.shape[0]],
                    ),
                )
                if ent is not None:
                    row["err_entropy"] = rel_err(ent, ref["entropy"])
            del logprob, ent
        except torch.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc).splitlines()[0]}"
        except Exception as exc:  # a provider's failure is a row, not the end of the run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        hl.grad = wl.grad = None
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def bench_shape(
    name: str, providers: list[str], *, warmup: int, reps: int, check: bool
) -> list[dict]:
    """The protocol's unit (GPU, bf16, temperature 1): every provider on shape ``name``."""
    n, h, v = SHAPES[name]
    cfg = BenchConfig(
        shapes=((name, n, h, v),),
        providers=tuple(providers),
        dtypes=("bf16",),
        device="cuda",
        reps=reps,
        warmup=warmup,
        check=check,
    )

    def show(row: dict) -> None:
        print(json.dumps({k: x for k, x in row.items() if k != "ms_all"}), flush=True)

    return bench_problem(cfg.shapes[0], "bf16", cfg, show)


# ----------------------------------------------------------------------------- environment


def git_commit() -> str | None:
    """``$LP_COMMIT`` if set (a copied checkout whose git metadata is stale), else
    ``git rev-parse --short HEAD`` of the working directory, or None."""
    if os.environ.get("LP_COMMIT"):
        return os.environ["LP_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _dist_version(dist: str) -> str | None:
    """Installed version of distribution ``dist``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(commit: str | None = None, device: str = "cuda") -> dict:
    cuda = device == "cuda"
    return {
        "device": device,
        "device_name": (
            torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
        ),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "cuda": torch.version.cuda,
        "lp_kernels": _dist_version("lp-kernels"),
        "peers": {name: _dist_version(dist) for name, dist in PEER_DISTS.items()},
        "python": platform.python_version(),
        "commit": commit or os.environ.get("LP_COMMIT") or git_commit() or "unknown",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- output


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table; materialized-relative time and memory per row."""
    head = ["shape", "dtype", "provider", "ms", "floor ms", "x floor", "MiB", "mem/mat"]
    head += ["err logprob", "maxabs lp", "err grad_h", "err grad_w"]
    keys = ERROR_KEYS
    if any("err_entropy" in r for r in rows):
        head.append("err entropy")
        keys = (*ERROR_KEYS, "err_entropy")
    base = {
        (r["shape"], r["dtype"]): r for r in rows if r["provider"] == "materialized" and "ms" in r
    }
    cells = []
    for r in rows:
        lead = [r["shape"], r["dtype"], r["provider"]]
        if "ms" not in r:
            why = r.get("error") or f"skipped: {r.get('skipped')}"
            cells.append([*lead, why, *[""] * (len(head) - 4)])
            continue
        mat = base.get((r["shape"], r["dtype"]))
        ratio = r["peak_bytes"] / mat["peak_bytes"] if mat and mat["peak_bytes"] else None
        cells.append(
            [
                *lead,
                f"{r['ms']:.2f}",
                _fmt(r["floor_ms"], ".2f"),
                _fmt(r["x_floor"], ".3f"),
                f"{r['peak_bytes'] / 2**20:.2f}",
                _fmt(ratio, ".2f"),
                *[_fmt(r.get(k), ".2e") for k in keys],
            ]
        )
    return head, cells


def print_table(rows: list[dict], title: str | None = None) -> None:
    head, cells = table_rows(rows)
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for i, col in enumerate(head):
            table.add_column(col, justify="left" if i < 3 else "right")
        for row in cells:
            table.add_row(*row)
        Console().print(table)
        return
    if title:
        print(title)
    full = [row for row in cells if row[4]]  # skipped / error rows: one free-text cell
    widths = [max(len(c) for c in col) for col in zip(head, *full, strict=True)]
    widths[:3] = [max(len(row[i]) for row in [head, *cells]) for i in range(3)]

    def fmt_row(row: list[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in pairs)

    print(fmt_row(head))
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for row in cells:
        if not row[4]:
            print(
                "  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths[:3], strict=True)), row[3]])
            )
        else:
            print(fmt_row(row))


def write_plot(rows: list[dict], path: Path, device: str) -> bool:
    """bench.png: time over floor (GPU) or ms (CPU), and peak memory, per shape and provider.

    Returns False (and writes nothing) when matplotlib is not importable.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "ms" in r]
    groups = list(dict.fromkeys(f"{r['shape']} {r['dtype']}" for r in ok))
    provs = list(dict.fromkeys(r["provider"] for r in ok))
    key = "x_floor" if device == "cuda" else "ms"
    fig, axes = plt.subplots(1, 2, figsize=(min(max(10, 2.4 * len(groups)), 24), 4))
    width = 0.8 / max(len(provs), 1)
    for j, prov in enumerate(provs):
        by_group = {f"{r['shape']} {r['dtype']}": r for r in ok if r["provider"] == prov}
        xs = [i + j * width for i, g in enumerate(groups) if g in by_group]
        rs = [by_group[g] for g in groups if g in by_group]
        axes[0].bar(xs, [r[key] or 0 for r in rs], width, label=prov)
        axes[1].bar(xs, [r["peak_bytes"] / 2**20 for r in rs], width, label=prov)
    labels = ["time / floor" if device == "cuda" else "ms", "peak MiB"]
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
        ax.set_ylabel(label)
    if device == "cuda":
        axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- protocol CLI


def protocol_main(argv: list[str] | None = None) -> int:
    """``benchmarks/protocol.py``: the GPU protocol, bf16, writes ``protocol.json``."""
    ap = argparse.ArgumentParser(description="DESIGN.md's GPU performance protocol")
    ap.add_argument("--shapes", default="S1,S2,S3,S4")
    ap.add_argument("--providers", default="lp-torch,materialized")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 reference")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("protocol.py needs a CUDA GPU", file=sys.stderr)
        return 2
    providers = args.providers.split(",")
    for p in providers:
        if p not in ALL_PROVIDERS:
            ap.error(f"unknown provider {p!r}; choose from {sorted(ALL_PROVIDERS)}")
    env = environment(args.commit)
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    for s in args.shapes.split(","):
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {sorted(SHAPES)}")
        rows += bench_shape(
            s, providers, warmup=args.warmup, reps=args.reps, check=not args.no_check
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "protocol.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print()
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit']}")
    print_table(rows)
    return 0


# ----------------------------------------------------------------------------- shape parsing


def parse_shapes(text: str) -> tuple[tuple[str, int, int, int], ...]:
    """``S1,S3,512x256x32003`` -> ((name, N, H, V), ...); ValueError names the bad item."""
    known = SHAPES | CPU_SHAPES
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        if item in known:
            shapes.append((item, *known[item]))
            continue
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", item)
        if not m:
            raise ValueError(f"{item!r} is neither a shape name ({', '.join(known)}) nor NxHxV")
        n, h, v = (int(x) for x in m.groups())
        if n < 1 or h < 1 or v < 2:
            raise ValueError(f"{item!r}: need N >= 1, H >= 1, V >= 2")
        shapes.append((item, n, h, v))
    if not shapes:
        raise ValueError("no shape given")
    return tuple(shapes)


# ----------------------------------------------------------------------------- lp check

CHECK_IGNORE = -100
# (name, N, H, V real, V padded rows, dtype, temperature)
CHECK_SHAPES = (
    ("7x13x257 pad+ign T=0.7", 7, 13, 257, 263, torch.float32, 0.7),
    ("33x64x1000 T=1", 33, 64, 1000, 1000, torch.float32, 1.0),
    ("5x8x130 bf16 T=1.3", 5, 8, 130, 136, torch.bfloat16, 1.3),
)
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Max abs error over max |fp64 reference| (per output / gradient) for PASS."""
TP_TIMEOUT_S = 60.0
TP_SPLIT = 128  # rank 0 holds vocabulary rows [0, 128), rank 1 the rest: uneven shards


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


def check_problem(n: int, h: int, v: int, v_pad: int, dtype: torch.dtype, seed: int = 0):
    """hidden [n, h], weight [v_pad, h] (rows >= v are padding), targets with ignored rows,
    upstream grads for logprob, entropy, lse."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v_pad, h, generator=gen) * (2.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[1::3] = CHECK_IGNORE
    targets[-1] = v - 1  # the last real token
    grads = torch.randn(3, n, generator=gen)
    return hidden, weight, targets, grads


def check_reference(hidden, weight, targets, grads, *, temperature: float, vocab_size: int):
    """fp64 autograd reference: materialized logits over the real vocabulary."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    z = (h @ w[:vocab_size].T) / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = targets != CHECK_IGNORE
    logprob = logp.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    lse = torch.logsumexp(z, dim=-1)
    outs = [torch.where(valid, x, 0.0) for x in (logprob, entropy, lse)]
    torch.autograd.backward(outs, [g.double() for g in grads])
    return dict(zip(("logprob", "entropy", "lse"), (o.detach() for o in outs), strict=True)) | {
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
    }


def _lp_run(hidden, weight, targets, grads, *, temperature, vocab_size, backend, **kw):
    from lp_kernels import linear_logprob

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    out = linear_logprob(
        h,
        w,
        targets,
        temperature=temperature,
        ignore_index=CHECK_IGNORE,
        return_entropy=True,
        return_lse=True,
        vocab_size=vocab_size,
        backend=backend,
        **kw,
    )
    outs = [out.logprob, out.entropy, out.lse]
    torch.autograd.backward(outs, [g.to(o.device) for g, o in zip(grads, outs, strict=True)])
    return dict(zip(("logprob", "entropy", "lse"), (o.detach() for o in outs), strict=True)) | {
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
    }


def _max_err(res: dict, ref: dict) -> tuple[float, str]:
    """Worst (max abs error / max |ref|) over the keys of ``ref``, and which key."""
    worst, which = 0.0, ""
    for k, truth in ref.items():
        err = float((res[k].double().cpu() - truth.cpu()).abs().max())
        scaled = err / max(float(truth.abs().max()), 1.0)
        if scaled > worst or not which:
            worst, which = scaled, k
    return worst, which


def check_backends(device: str) -> list[str]:
    names = ["torch"]
    if importlib.util.find_spec("triton") is not None and (
        device == "cuda" or _triton_interpreting()
    ):
        names.append("triton")
    return names


def check_parity(backend: str, device: str, shapes=CHECK_SHAPES) -> list[CheckResult]:
    results = []
    for name, n, h, v, v_pad, dtype, temp in shapes:
        hidden, weight, targets, grads = check_problem(n, h, v, v_pad, dtype)
        ref = check_reference(hidden, weight, targets, grads, temperature=temp, vocab_size=v)
        dev = [x.to(device) for x in (hidden, weight, targets)]
        kw = dict(temperature=temp, vocab_size=v, backend=backend)
        try:
            first = _lp_run(*dev, grads, **kw)
            second = _lp_run(*dev, grads, **kw)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            results.append(CheckResult(f"{backend} parity {name}", False, msg))
            continue
        err, which = _max_err(first, ref)
        tol = CHECK_TOL[dtype]
        results.append(
            CheckResult(
                f"{backend} parity {name}",
                err <= tol,
                f"max rel err {err:.2e} ({which}), tol {tol:.0e}",
            )
        )
        same = [k for k in first if not torch.equal(first[k], second[k])]
        results.append(
            CheckResult(
                f"{backend} bitwise run to run {name}",
                not same,
                "all 5 equal" if not same else f"differ: {', '.join(same)}",
            )
        )
    return results


def _tp_worker(rank: int, world: int, store_path: str, payload: bytes, conn) -> None:
    """One gloo rank of the TP=2 check: its shard of the head, results pickled back."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: tuple[str, object]
    try:
        hidden, weight, targets, grads, temp, v, deterministic = pickle.loads(payload)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            bounds = [0, TP_SPLIT, weight.shape[0]]
            shard = weight[bounds[rank] : bounds[rank + 1]]
            res = _lp_run(
                hidden,
                shard,
                targets,
                grads,
                temperature=temp,
                vocab_size=v,
                backend="torch",
                tp_group=dist.group.WORLD,
                vocab_start=bounds[rank],
                deterministic=deterministic,
            )
            result = ("ok", res)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the check
        import traceback

        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send_bytes(pickle.dumps(result))
    conn.close()


def run_tp_ranks(payload: bytes, world: int = 2, timeout: float = TP_TIMEOUT_S) -> list:
    """Spawn ``world`` gloo ranks of :func:`_tp_worker`; results in rank order.

    Raises RuntimeError on a rank's error and TimeoutError past ``timeout``; every child is
    reaped (killed if need be) and the rendezvous directory removed.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children read it at start
    procs, conns = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="lp-check-") as tmp:
            store = os.path.join(tmp, "store")
            for rank in range(world):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_tp_worker, args=(rank, world, store, payload, send), daemon=True
                )
                p.start()
                send.close()
                procs.append(p)
                conns.append(recv)
            deadline = time.monotonic() + timeout
            results = []
            for rank, conn in enumerate(conns):
                left = deadline - time.monotonic()
                if left <= 0 or not conn.poll(left):
                    raise TimeoutError(f"TP rank {rank} did not finish within {timeout:.0f} s")
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    raise RuntimeError(f"TP rank {rank} died without a result") from None
                if status != "ok":
                    raise RuntimeError(f"TP rank {rank} failed: {value}")
                results.append(value)
            return results
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp


def check_tp(timeout: float = TP_TIMEOUT_S, *, deterministic: bool = False) -> CheckResult:
    """gloo TP=2 on CPU, uneven shards: outputs and gradients match the single process;
    with ``deterministic=True`` they must be bitwise equal to it."""
    name, n, h, v, v_pad, dtype, temp = CHECK_SHAPES[0]
    mode = "deterministic, bitwise" if deterministic else "uneven shards"
    label = f"torch gloo TP=2 {mode} {name}"
    hidden, weight, targets, grads = check_problem(n, h, v, v_pad, dtype)
    single = _lp_run(
        hidden, weight, targets, grads, temperature=temp, vocab_size=v, backend="torch",
        deterministic=deterministic,
    )  # fmt: skip
    payload = pickle.dumps((hidden, weight, targets, grads, temp, v, deterministic))
    try:
        ranks = run_tp_ranks(payload, 2, timeout)
    except (RuntimeError, TimeoutError) as exc:
        return CheckResult(label, False, str(exc).splitlines()[0])
    if deterministic:
        differ = [
            f"{key} (rank {rank})"
            for rank, res in enumerate(ranks)
            for key in ("logprob", "entropy", "lse", "grad_hidden")
            if not torch.equal(res[key], single[key])
        ]
        grad_w = torch.cat([r["grad_weight"] for r in ranks])
        if not torch.equal(grad_w, single["grad_weight"]):
            differ.append("grad_weight")
        detail = "all 5 equal to TP=1" if not differ else f"differ: {', '.join(differ)}"
        return CheckResult(label, not differ, detail)
    worst, which = 0.0, ""
    for rank, res in enumerate(ranks):
        combined = dict(res)
        if rank == 0:  # the shard gradients together are the full weight gradient
            combined["grad_weight"] = torch.cat([r["grad_weight"] for r in ranks])
        else:
            combined.pop("grad_weight")
        ref = {k: single[k] for k in combined}
        err, key = _max_err(combined, ref)
        if err > worst or not which:
            worst, which = err, f"{key}, rank {rank}"
    tol = 1e-5
    return CheckResult(
        label, worst <= tol, f"max rel err vs TP=1 {worst:.2e} ({which}), tol {tol:.0e}"
    )


def run_checks(
    *, quick: bool = False, tp: bool = True, report: Callable[[CheckResult], None] = print
) -> list[CheckResult]:
    """Every check of ``lp check``; ``report`` is called as each one finishes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CHECK_SHAPES[:1] if quick else CHECK_SHAPES
    results: list[CheckResult] = []
    for backend in check_backends(device):
        for res in check_parity(backend, device, shapes):
            report(res)
            results.append(res)
    if tp:
        for deterministic in (False, True):
            res = check_tp(deterministic=deterministic)
            report(res)
            results.append(res)
    return results


def default_bench_dtypes(device: str) -> tuple[str, ...]:
    return ("bf16",) if device == "cuda" else ("fp32", "bf16")


def dump_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
