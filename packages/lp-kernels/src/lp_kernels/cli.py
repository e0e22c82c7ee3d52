"""`lp`: the command-line entry point (the project's main job).

    lp demo [--n N] [--h H] [--v V] [--dtype bf16|fp16|fp32|both] [--seed S] [--json PATH]

`lp demo` builds an embedded problem (hidden [N, H], weight [V, H], targets [N] with some
rows at ignore_index), runs forward + backward with a random per-token upstream gradient on
logprob, entropy and lse through three paths, and prints them side by side:

    lp              linear_logprob(hidden, weight, targets, return_entropy, return_lse)
    materialized    logits = hidden @ weight.T in the input dtype -> fp32 log_softmax -> gather
    fp64 reference  the materialized path in float64, the truth the other two are measured against

Reported per path: median wall time of forward + backward, peak memory above the inputs,
the part of that peak that is neither an output nor a gradient (the logits scratch), max
abs error of logprob / entropy / lse / grad_hidden / grad_weight against fp64, and whether
repeated runs are bitwise equal. On CPU, memory is measured by a dispatch mode that tracks
the storages allocated during the call; on CUDA by torch.cuda.max_memory_allocated.

    lp bench [--shapes S1,S2|NxHxV,...] [--backends lp-triton,lp-torch,materialized,...]
             [--dtype bf16|fp16|fp32|both] [--temperature T] [--entropy] [--reps R]
             [--warmup W] [--warm-s S] [--device auto|cpu|cuda] [--out DIR]
    lp check [--quick] [--no-tp]

`lp bench` runs the performance protocol of `lp_kernels.bench` (the S1-S4 shapes on a GPU,
an embedded small problem on CPU) and prints a table last; `lp check` is a short self-test
of the installed backends (parity, reproducibility, gloo TP=2), one PASS/FAIL line per check.

This module depends on torch only (rich and matplotlib are used when importable).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IGNORE_INDEX = -100
TIME_BUDGET_S = 5.0  # stop repeating a path once its timed runs add up to this
OUTPUTS = ("logprob", "entropy", "lse")
GRADS = ("grad_hidden", "grad_weight")
PATHS = ("lp", "materialized", "fp64")
HEADERS = {
    "lp": "lp linear_logprob",
    "materialized": "materialized logits",
    "fp64": "fp64 reference",
}

# (logprob, entropy, lse), each [N] and differentiable
Path3 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


# ----------------------------------------------------------------------------- problem


@dataclass(frozen=True)
class DemoConfig:
    """One `lp demo` run, as parsed from the command line."""

    n: int
    """Tokens N."""
    h: int
    """Hidden size H."""
    v: int
    """Vocabulary V: weight has exactly V rows (no padding)."""
    dtypes: tuple[str, ...]
    """Input dtypes to run, keys of DTYPES."""
    seed: int
    """Seed of the problem and of the upstream gradient."""
    repeat: int
    """Timed runs per path (after one warm-up); the median is reported."""
    device: str
    """"cpu" or "cuda"."""
    backend: str
    """linear_logprob backend: "auto" | "torch" | "triton"."""
    chunk_size: int | None
    """linear_logprob chunk_size; None = backend default."""


def make_problem(cfg: DemoConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded hidden [N, H], weight [V, H] (dtype), targets [N] int64, upstream grads [N] fp32.

    Logits come out with a standard deviation of about 2. About 1 row in 16 (never row 0)
    has target IGNORE_INDEX. The same seed gives the same problem for every dtype.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    hidden = torch.randn(cfg.n, cfg.h, generator=gen)
    weight = torch.randn(cfg.v, cfg.h, generator=gen) * (2.0 / cfg.h**0.5)
    targets = torch.randint(0, cfg.v, (cfg.n,), generator=gen)
    ignored = torch.rand(cfg.n, generator=gen) < 1 / 16
    ignored[0] = False
    targets[ignored] = IGNORE_INDEX
    upstream = torch.randn(len(OUTPUTS), cfg.n, generator=gen)
    problem = {"hidden": hidden.to(dtype), "weight": weight.to(dtype), "targets": targets}
    problem |= {f"d_{name}": upstream[i] for i, name in enumerate(OUTPUTS)}
    return {k: t.to(cfg.device) for k, t in problem.items()}


# ----------------------------------------------------------------------------- paths


def _lp_path(cfg: DemoConfig) -> Path3:
    from lp_kernels import linear_logprob  # imported here: `lp --help` works without it

    def path(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        out = linear_logprob(
            hidden,
            weight,
            targets,
            ignore_index=IGNORE_INDEX,
            return_entropy=True,
            return_lse=True,
            backend=cfg.backend,
            chunk_size=cfg.chunk_size,
        )
        return out.logprob, out.entropy, out.lse

    return path


def _materialized_path(acc_dtype: torch.dtype) -> Path3:
    """What trainers do today: [N, V] logits in the input dtype, softmax math in acc_dtype."""

    def path(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        logits = (hidden @ weight.T).to(acc_dtype)  # [N, V]
        logp = torch.log_softmax(logits, dim=-1)  # [N, V]
        lse = torch.logsumexp(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        valid = targets != IGNORE_INDEX
        logprob = logp.gather(-1, torch.where(valid, targets, 0)[:, None]).squeeze(-1)
        return tuple(torch.where(valid, x, 0.0) for x in (logprob, entropy, lse))

    return path


def _fwd_bwd(path: Path3, problem: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    """Forward + backward of `path` with the per-token upstream gradients; all results, detached."""
    hidden = problem["hidden"].detach().to(dtype or problem["hidden"].dtype).requires_grad_()
    weight = problem["weight"].detach().to(dtype or problem["weight"].dtype).requires_grad_()
    outputs = path(hidden, weight, problem["targets"])
    upstream = [
        problem[f"d_{name}"].to(out.dtype) for name, out in zip(OUTPUTS, outputs, strict=True)
    ]
    grads = torch.autograd.grad(outputs, (hidden, weight), upstream)
    return dict(zip(OUTPUTS + GRADS, [*(o.detach() for o in outputs), *grads], strict=True))


# ----------------------------------------------------------------------------- measurement


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages allocated while active (CPU stand-in for max_memory_allocated).

    Every op's outputs whose storage is not one of its inputs' (so views and in-place ops of
    existing tensors are not counted) are tracked by weak reference until freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        seen = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _is_dense(t)}
        for t in tree_leaves(out):
            if _is_dense(t) and (storage := t.untyped_storage())._cdata not in seen:
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def _is_dense(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _peak_bytes(run: Callable[[], dict[str, torch.Tensor]], device: str) -> int:
    """CUDA peak memory of `run` above what was allocated before it started."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _measure(run: Callable[[], dict[str, torch.Tensor]], cfg: DemoConfig) -> dict:
    """Warm-up, then up to `repeat` timed runs (fewer once TIME_BUDGET_S is spent).

    On CPU the warm-up run is also the memory run (the tracker slows it down; it is not
    timed); on CUDA memory gets its own run after the warm-up, so that one-time allocations
    (cuBLAS workspace, Triton compilation) are not counted. Returns the figures and the
    results of the last run.
    """
    cuda = cfg.device == "cuda"
    if cuda:
        results = [run()]
        peak = _peak_bytes(run, cfg.device)
    else:
        with _LiveBytes() as tracker:
            results = [run()]
        peak = tracker.peak
    times: list[float] = []
    while len(times) < cfg.repeat and (not times or sum(times) < TIME_BUDGET_S):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        results.append(run())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    reproducible = all(torch.equal(r[k], results[0][k]) for r in results for k in results[0])
    returned = sum(t.numel() * t.element_size() for t in results[-1].values())
    return {
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_bytes": peak,
        "scratch_bytes": max(peak - returned, 0),
        "reproducible": reproducible,
        "results": results[-1],
    }


def _errors(results: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Max abs error per output/gradient, and the same divided by max |ref|."""
    abs_err, rel_err = {}, {}
    for k, truth in ref.items():
        err = (results[k].double() - truth).abs().max().item()
        abs_err[k] = err
        rel_err[k] = err / max(truth.abs().max().item(), 1e-300)
    return abs_err, rel_err


def run_demo(cfg: DemoConfig, dtype_name: str) -> dict:
    """All three paths on one dtype; a JSON-ready record (plus tensors under "_results")."""
    dtype = DTYPES[dtype_name]
    problem = make_problem(cfg, dtype)
    lp_path = _lp_path(cfg)
    runs = {
        "lp": lambda: _fwd_bwd(lp_path, problem),
        "materialized": lambda: _fwd_bwd(_materialized_path(torch.float32), problem),
        "fp64": lambda: _fwd_bwd(_materialized_path(torch.float64), problem, torch.float64),
    }
    figures = {name: _measure(run, cfg) for name, run in runs.items()}
    ref = figures["fp64"]["results"]
    for fig in figures.values():
        fig["max_abs_err"], fig["max_rel_err"] = _errors(fig["results"], ref)
    n_v = cfg.n * cfg.v * dtype.itemsize
    return {
        "dtype": dtype_name,
        "ignored_rows": int((problem["targets"] == IGNORE_INDEX).sum()),
        "logits_and_grad_bytes": 2 * n_v,
        "paths": {
            p: {k: x for k, x in fig.items() if k != "results"} for p, fig in figures.items()
        },
        "_results": {k: fig["results"] for k, fig in figures.items()},
        "_targets": problem["targets"],
    }


# ----------------------------------------------------------------------------- printing


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _print_record(cfg: DemoConfig, rec: dict) -> None:
    paths = rec["paths"]
    rows: list[tuple[str, list[str]]] = [
        (
            "time fwd+bwd, median (runs)",
            [f"{paths[p]['time_s'] * 1e3:.1f} ms ({len(paths[p]['times_s'])})" for p in PATHS],
        ),
        ("peak memory above inputs", [_mib(paths[p]["peak_bytes"]) for p in PATHS]),
        ("  scratch (peak - outputs - grads)", [_mib(paths[p]["scratch_bytes"]) for p in PATHS]),
    ]
    for k in OUTPUTS + GRADS:
        errs = [f"{paths[p]['max_abs_err'][k]:.2e}" for p in PATHS[:2]]
        rows.append((f"max |err| {k} vs fp64", [*errs, "-"]))
    rows.append(
        (
            "bitwise equal run to run",
            ["yes" if paths[p]["reproducible"] else "NO" for p in PATHS],
        )
    )
    print(f"\n{rec['dtype']} ({rec['ignored_rows']} ignored rows)")
    print(f"  {'':36}" + "".join(f"{HEADERS[p]:>22}" for p in PATHS))
    for label, cells in rows:
        print(f"  {label:36}" + "".join(f"{c:>22}" for c in cells))
    print(
        f"  [N, V] logits + their grad in {rec['dtype']}: {_mib(rec['logits_and_grad_bytes'])}"
        " (the materialized path also holds fp32 [N, V] softmax intermediates)",
    )

    # First tokens, all three paths side by side.
    res, targets = rec["_results"], rec["_targets"]
    names = ("logprob", "entropy")
    print(f"\n  first tokens {'':9}" + "".join(f"{n:^42}" for n in names))
    print(f"  {'row':>5} {'target':>15}" + "".join(f"{p:>14}" for p in PATHS) * 2)
    for i in range(min(cfg.n, 5)):
        target = int(targets[i])
        cells = [float(res[p][n][i]) for n in names for p in PATHS]
        label = "ignored" if target == IGNORE_INDEX else str(target)
        print(f"  {i:>5} {label:>15}" + "".join(f"{c:>14.6f}" for c in cells))


# ----------------------------------------------------------------------------- commands


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _vocab_size(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"the vocabulary needs at least 2 tokens, got {value}")
    return value


def _cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    cfg = DemoConfig(
        n=args.n,
        h=args.h,
        v=args.v,
        dtypes=("bf16", "fp32") if args.dtype == "both" else (args.dtype,),
        seed=args.seed,
        repeat=args.repeat,
        device=args.device,
        backend=args.backend,
        chunk_size=args.chunk_size,
    )
    env = {
        "lp_kernels": _version("lp-kernels"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": cfg.device,
        "device_name": (
            torch.cuda.get_device_name()
            if cfg.device == "cuda"
            else platform.processor() or platform.machine()
        ),
        "threads": torch.get_num_threads(),
    }
    print(
        f"lp demo: N={cfg.n} H={cfg.h} V={cfg.v} (no vocab padding), seed {cfg.seed}, "
        f"backend={cfg.backend}, {cfg.device} ({env['device_name']}), "
        f"torch {env['torch']}, {env['threads']} threads"
    )
    print("forward + backward with a random per-token upstream gradient on logprob/entropy/lse")
    memory = (
        "torch.cuda.max_memory_allocated"
        if cfg.device == "cuda"
        else "storages allocated during the call, tracked by a dispatch mode"
    )
    print(f"memory: {memory}")
    records = []
    for dtype_name in cfg.dtypes:
        record = run_demo(cfg, dtype_name)
        _print_record(cfg, record)
        records.append({k: v for k, v in record.items() if not k.startswith("_")})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": "demo", "config": asdict(cfg), "env": env, "runs": records}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


# ----------------------------------------------------------------------------- bench, check


def _shapes_arg(text: str):
    from lp_kernels.bench import parse_shapes

    try:
        return parse_shapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backends_arg(text: str) -> tuple[str, ...]:
    from lp_kernels.bench import ALL_PROVIDERS

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError("no backend given")
    for name in names:
        if name not in ALL_PROVIDERS:
            raise argparse.ArgumentTypeError(
                f"unknown backend {name!r}; choose from {', '.join(ALL_PROVIDERS)}"
            )
    return tuple(dict.fromkeys(names))


def _temperature_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _init_tp(tp: int, device: str, parser: argparse.ArgumentParser) -> int:
    """Join the torchrun launch of ``lp bench --tp N``; returns this process's rank."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        parser.error(
            f"argument --tp: {tp} needs a torchrun launch with {tp} processes (WORLD_SIZE is "
            f"{world}), e.g. torchrun --nproc-per-node {tp} -m lp_kernels.cli bench --tp {tp}"
        )
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank()


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda requested but CUDA is not available")
    if args.tp == 1:
        return _bench(args, parser, device, rank=0)
    rank = _init_tp(args.tp, device, parser)
    import torch.distributed as dist

    try:
        code = _bench(args, parser, device, rank=rank)
        # Every rank reaches teardown together: a gloo rank that tears its connections
        # down while a peer is still finishing was seen to abort that peer at exit
        # ("terminate called without an active exception", once in CI under load).
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str, rank: int):
    """``lp bench`` on this process (rank 0 of a TP launch prints and writes; all ranks time)."""
    from lp_kernels import bench

    cuda = device == "cuda"
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.backends is None:
        providers = tuple(bench.default_providers(device))
        if args.tp > 1:  # single-device providers have no sharded counterpart
            providers = tuple(p for p in providers if p in bench.LP_PROVIDERS)
    else:
        providers = args.backends
        for name in providers:
            why = bench.provider_available(name, device)
            if why is not None:
                parser.error(f"argument --backends: {name} is not available here: {why}")
    if args.shapes is None:
        shapes = tuple((k, *v) for k, v in (bench.SHAPES if cuda else bench.CPU_SHAPES).items())
    else:
        shapes = args.shapes
    if args.dtype is None:
        dtypes = bench.default_bench_dtypes(device)
    else:
        dtypes = ("fp32", "bf16") if args.dtype == "both" else (args.dtype,)
    cfg = bench.BenchConfig(
        shapes=shapes,
        providers=providers,
        dtypes=dtypes,
        device=device,
        temperature=args.temperature,
        entropy=args.entropy,
        reps=args.reps if args.reps is not None else (5 if cuda else 3),
        warmup=args.warmup if args.warmup is not None else (2 if cuda else 1),
        warm_s=(args.warm_s if args.warm_s is not None else 1.0) if cuda else 0.0,
        check=not args.no_check,
        seed=args.seed,
        tp=args.tp,
    )
    env = bench.environment(device=device)
    ref = "fp32 (TF32 off)" if cuda else "fp64"
    say(
        f"lp bench: {device} ({env['device_name']}), torch {env['torch']}, "
        f"triton {env['triton'] or '-'}, commit {env['commit']}"
    )
    say(
        f"providers {', '.join(providers)}; dtypes {', '.join(dtypes)}; T={cfg.temperature}; "
        f"entropy {'on' if cfg.entropy else 'off'}; median of {cfg.reps} after {cfg.warmup} "
        f"warm-up"
        + (f" (and >= {cfg.warm_s:g} s: steady clocks)" if cfg.warm_s else "")
        + f"; errors vs the {ref} reference"
        + (
            f"; TP={cfg.tp}: per-rank head shards, floor of one rank's shard, "
            "slowest rank's time"
            if cfg.tp > 1
            else ""
        )
    )
    total = len(shapes) * len(dtypes) * len(providers)
    rows: list[dict] = []
    progress = _progress(total) if rank == 0 else _Silent()
    try:
        for shape in shapes:
            for dtype_name in dtypes:
                progress.describe(f"{shape[0]} {dtype_name}")
                rows += bench.bench_problem(shape, dtype_name, cfg, progress.advance)
    finally:
        progress.close()
    failed = [r for r in rows if "error" in r]
    if rank != 0:
        return 1 if failed else 0
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        config = asdict(cfg) | {
            "shapes": [dict(zip(("name", "N", "H", "V"), s, strict=True)) for s in shapes],
        }
        doc = {"command": "bench", "env": env, "config": config, "rows": rows}
        bench.dump_json(doc, args.out / "bench.json")
        print(f"wrote {args.out / 'bench.json'}")
        try:
            if bench.write_plot(rows, args.out / "bench.png", device):
                print(f"wrote {args.out / 'bench.png'}")
            else:
                print("no plot: matplotlib is not importable")
        except Exception as exc:  # the figures are already on disk; a plot is a bonus
            print(f"no plot: {type(exc).__name__}: {exc}")
    print()
    bench.print_table(rows)
    return 1 if failed else 0


class _Silent:
    """The progress reporter of ranks other than 0."""

    def describe(self, what: str) -> None:
        pass

    def advance(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _Progress:
    """A rich progress bar when rich is importable, else one plain line per finished row."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.what = total, 0, ""
        self._bar = None
        try:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task("lp bench", total=total)
        except ImportError:
            pass

    def describe(self, what: str) -> None:
        self.what = what
        if self._bar is not None:
            self._bar.update(self._task, description=what)

    def advance(self, row: dict) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
            return
        status = f"{row['ms']:.2f} ms" if "ms" in row else row.get("error") or "skipped"
        print(f"  [{self.done}/{self.total}] {self.what} {row['provider']}: {status}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _progress(total: int) -> _Progress:
    return _Progress(total)


def _cmd_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lp_kernels import bench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = bench.check_backends(device)
    print(
        f"lp check: backends {', '.join(backends)} on {device}, torch {torch.__version__}; "
        "errors are max abs error / max(1, max |fp64 reference|)"
    )

    def report(res) -> None:
        print(f"{'PASS' if res.passed else 'FAIL'}  {res.name}: {res.detail}", flush=True)

    start = time.perf_counter()
    results = bench.run_checks(quick=args.quick, tp=not args.no_tp, report=report)
    failed = sum(not r.passed for r in results)
    took = time.perf_counter() - start
    print(f"{len(results) - failed} passed, {failed} failed in {took:.1f} s")
    return 1 if failed else 0


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lp", description="lp: LM-head log-probs without materialized logits."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run lp next to the materialized-logits path and an fp64 reference",
        description="Run lp on an embedded problem next to the materialized-logits path and "
        "an fp64 reference: time, memory, error.",
    )
    demo.add_argument("--n", type=_positive_int, default=512, help="tokens (default 512)")
    demo.add_argument("--h", type=_positive_int, default=128, help="hidden size (default 128)")
    demo.add_argument("--v", type=_vocab_size, default=32003, help="vocabulary (default 32003)")
    demo.add_argument(
        "--dtype", choices=[*DTYPES, "both"], default="both", help="default: both = bf16 + fp32"
    )
    demo.add_argument("--seed", type=int, default=0, help="default 0")
    demo.add_argument("--repeat", type=_positive_int, default=3, help="timed runs (default 3)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    demo.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    demo.add_argument("--chunk-size", type=_positive_int, default=None)
    demo.add_argument("--json", type=Path, default=None, metavar="PATH", help="write figures")
    demo.set_defaults(func=_cmd_demo)

    bench = commands.add_parser(
        "bench",
        help="time lp against the matmul floor and the materialized path (GPU: S1-S4)",
        description="The performance protocol: forward + backward of a per-token logprob "
        "with a random upstream gradient. On a GPU the S1-S4 shapes, a floor of 4 cuBLAS "
        "matmuls measured in the same run and errors against an fp32 reference; on CPU a "
        "small embedded problem timed with perf_counter, errors against fp64. Peers "
        "(liger-kernel, cut-cross-entropy) join when importable. --tp N under torchrun "
        "shards the head over N ranks. Exit status 1 if a provider failed.",
    )
    bench.add_argument(
        "--shapes",
        type=_shapes_arg,
        default=None,
        help="comma-separated names (S1..S4, cpu) or NxHxV; default S1-S4 on GPU, "
        "cpu (256x128x16003) on CPU",
    )
    bench.add_argument(
        "--backends",
        type=_backends_arg,
        default=None,
        help="comma-separated: lp-triton, lp-torch, lp-auto, lp-triton-det, lp-torch-det "
        "(deterministic=True, its default tile), lp-triton-det128 (the same with "
        "deterministic_tile=128), materialized, liger, cce; default: all available except -det",
    )
    bench.add_argument(
        "--dtype",
        choices=[*DTYPES, "both"],
        default=None,
        help="default bf16 on GPU, both (fp32 + bf16) on CPU",
    )
    bench.add_argument("--temperature", type=_temperature_arg, default=1.0, help="default 1")
    bench.add_argument(
        "--entropy", action="store_true", help="also return entropy, with its own upstream grad"
    )
    bench.add_argument(
        "--reps", type=_positive_int, default=None, help="timed runs (default 5 GPU, 3 CPU)"
    )
    bench.add_argument(
        "--warmup", type=_non_negative_int, default=None, help="default 2 GPU, 1 CPU"
    )
    bench.add_argument(
        "--warm-s",
        type=_non_negative_float,
        default=None,
        help="GPU: warm each timed call (floor included) up for at least S seconds, so "
        "that it is timed at the clock its sustained load settles to (default 1; 0: off)",
    )
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel degree; > 1 needs a torchrun launch with that many processes "
        "(torchrun --nproc-per-node N -m lp_kernels.cli bench --tp N): NCCL on GPUs, gloo on "
        "CPU; lp providers only",
    )
    bench.add_argument("--seed", type=int, default=0, help="default 0")
    bench.add_argument("--no-check", action="store_true", help="skip the reference and errors")
    bench.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="write bench.json (+ bench.png)"
    )
    bench.set_defaults(func=_cmd_bench)

    check = commands.add_parser(
        "check",
        help="self-test of the installed backends (parity, reproducibility, gloo TP=2)",
        description="For each available backend (torch; triton on CUDA, or on CPU under "
        "TRITON_INTERPRET=1): logprob/entropy/lse and both gradients against an fp64 "
        "reference on small awkward shapes, bitwise reproducibility run to run, and a gloo "
        "TP=2 run on CPU with uneven shards against the single-process result, and the same "
        "with deterministic=True, which must be bitwise equal to it. One "
        "PASS/FAIL line per check; exit status 1 on any failure.",
    )
    check.add_argument("--quick", action="store_true", help="one shape per backend only")
    check.add_argument("--no-tp", action="store_true", help="skip the gloo TP=2 check")
    check.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lp` console script. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
