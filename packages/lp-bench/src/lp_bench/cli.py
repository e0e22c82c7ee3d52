"""``lp``: the command line of lp-bench (the project's main job).

    lp bench   [--grid] [--mode train,fwd,loss,distill] [--entropy [off|on|both]]
               [--kind reverse_kl,forward_kl,jsd] [--beta B] [--teacher-scale 1,2]
               [--shapes S1,..|NxHxV]
               [--backends ...] [--dtype ...] [--temperature T] [--softcap C] [--bias]
               [--reps R] [--warmup W]
               [--warm-s S] [--device auto|cpu|cuda] [--tp N] [--seed S] [--no-check]
               [--out DIR]
    lp check   [--quick] [--no-tp] [--tp-timeout S]
    lp demo    [--n N] [--h H] [--v V] [--dtype bf16|fp16|fp32|both] [--seed S] [--json PATH]
    lp report  BENCH_JSON [--plot [PNG]]

This module parses arguments and prints; the work is in :mod:`lp_bench.protocol`,
:mod:`lp_bench.check`, :mod:`lp_bench.demo` and :mod:`lp_bench.report`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lp_bench import protocol
from lp_bench.distill import DISTILL_SHAPES, KINDS, TEACHER_SCALES
from lp_bench.environment import device_name, dist_version, environment
from lp_bench.providers import (
    ALL_PROVIDERS,
    LP_LOSS_PROVIDERS,
    LP_PROVIDERS,
    default_providers,
    provider_available,
)
from lp_bench.table import print_table

ENTROPY_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


# ----------------------------------------------------------------------------- argument types


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _vocab_size(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"the vocabulary needs at least 2 tokens, got {value}")
    return value


def _finite_float(text: str, *, low: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    ok = (value > low if strict else value >= low) and value != float("inf")
    if not ok:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(
            f"must be a finite number {'>' if strict else '>='} {low:g}, got {text}"
        )
    return value


def _temperature_arg(text: str) -> float:
    return _finite_float(text, low=0.0, strict=True)


def _non_negative_float(text: str) -> float:
    return _finite_float(text, low=0.0, strict=False)


def _positive_float(text: str) -> float:
    return _finite_float(text, low=0.0, strict=True)


def _shapes_arg(text: str):
    try:
        return protocol.parse_shapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _modes_arg(text: str):
    try:
        return protocol.parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kinds_arg(text: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if kinds == ("all",):
        return KINDS
    for kind in kinds:
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(
                f"unknown kind {kind!r}; choose from {', '.join(KINDS)}"
            )
    if not kinds:
        raise argparse.ArgumentTypeError("no kind given")
    return kinds


def _scales_arg(text: str) -> tuple[int, ...]:
    try:
        scales = tuple(dict.fromkeys(int(s) for s in text.split(",") if s.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not scales or min(scales) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return scales


def _beta_arg(text: str) -> float:
    value = _finite_float(text, low=0.0, strict=True)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"jsd's beta must be in (0, 1), got {text}")
    return value


def _backends_arg(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError("no backend given")
    for name in names:
        if name not in ALL_PROVIDERS:
            raise argparse.ArgumentTypeError(
                f"unknown backend {name!r}; choose from {', '.join(ALL_PROVIDERS)}"
            )
    return tuple(dict.fromkeys(names))


# ----------------------------------------------------------------------------- lp bench


def _init_tp(tp: int, device: str, parser: argparse.ArgumentParser) -> int:
    """Join the torchrun launch of ``lp bench --tp N``; returns this process's rank."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        parser.error(
            f"argument --tp: {tp} needs a torchrun launch with {tp} processes (WORLD_SIZE is "
            f"{world}), e.g. torchrun --nproc-per-node {tp} -m lp_bench.cli bench --tp {tp}"
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
        # down while a peer is still finishing can abort that peer at exit.
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


def bench_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, device: str
) -> protocol.BenchConfig:
    """The run that the ``lp bench`` arguments ask for (``--grid`` fills what is not given)."""
    cuda = device == "cuda"
    modes = args.mode or (("train", "fwd") if args.grid else ("train",))
    if args.backends is None:
        providers = tuple(default_providers(device, grid=args.grid, modes=modes))
        if args.tp > 1:  # single-device providers have no sharded counterpart
            providers = tuple(p for p in providers if p in (*LP_PROVIDERS, *LP_LOSS_PROVIDERS))
    else:
        providers = args.backends
        for name in providers:
            why = provider_available(name, device)
            if why is not None:
                parser.error(f"argument --backends: {name} is not available here: {why}")
    shapes = args.shapes
    if shapes is None:
        table = protocol.SHAPES if cuda else protocol.CPU_SHAPES
        if cuda and "distill" in modes:  # the teacher doubles the work: four shapes
            table = {k: protocol.SHAPES[k] for k in DISTILL_SHAPES}
        shapes = tuple((k, *v) for k, v in table.items())
    if args.dtype is None:
        dtypes = protocol.default_dtypes(device)
    else:
        dtypes = ("fp32", "bf16") if args.dtype == "both" else (args.dtype,)
    entropy = ENTROPY_CHOICES[args.entropy or ("both" if args.grid else "off")]
    try:
        return protocol.BenchConfig(
            shapes=shapes,
            providers=providers,
            dtypes=dtypes,
            device=device,
            modes=modes,
            entropy=entropy,
            temperature=args.temperature,
            reps=args.reps if args.reps is not None else (5 if cuda else 3),
            warmup=args.warmup if args.warmup is not None else (2 if cuda else 1),
            warm_s=(args.warm_s if args.warm_s is not None else 1.0) if cuda else 0.0,
            check=not args.no_check,
            seed=args.seed,
            tp=args.tp,
            softcap=args.softcap,
            bias=args.bias,
            kinds=args.kind,
            beta=args.beta,
            teacher_scales=args.teacher_scale,
        )
    except ValueError as exc:  # a combination the run cannot make
        parser.error(str(exc))


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str, rank: int):
    """``lp bench`` on this process (rank 0 of a TP launch prints and writes; all ranks time)."""
    cfg = bench_config(args, parser, device)
    cuda = device == "cuda"
    say = print if rank == 0 else (lambda *a, **k: None)
    env = environment(device)
    ref = "fp32 (TF32 off)" if cuda else "fp64"
    say(
        f"lp bench: {device} ({env['device_name']}), torch {env['torch']}, "
        f"triton {env['triton'] or '-'}, commit {env['commit']}"
    )
    floors = ", ".join(
        f"{m} {k} matmul{'s' if k > 1 else ''}"
        + (" (4 student, 2 teacher)" if m == "distill" else "")
        for m, k in protocol.FLOOR_MATMULS.items()
        if m in cfg.modes
    )
    floors = f"floor: {floors}; " if cuda else ""
    entropy = "/".join("on" if e else "off" for e in cfg.entropy)
    say(
        f"modes {', '.join(cfg.modes)}; entropy {entropy}; "
        f"providers {', '.join(cfg.providers)}; dtypes {', '.join(cfg.dtypes)}; "
        f"T={cfg.temperature}"
        + (f"; {protocol.options_label(cfg.softcap, cfg.bias)}" if cfg.softcap or cfg.bias else "")
        + (
            f"; distill: {', '.join(cfg.kinds)} (jsd beta {cfg.beta:g}), teacher H_t = "
            + ", ".join(f"{s}H" for s in cfg.teacher_scales)
            if "distill" in cfg.modes
            else ""
        )
        + f"; median of {cfg.reps} after {cfg.warmup} warm-up"
        + (f" (and >= {cfg.warm_s:g} s: steady clocks)" if cfg.warm_s else "")
        + f"; {floors}errors vs the {ref} reference"
        + (
            f"; TP={cfg.tp}: per-rank head shards, floor of one rank's shard, slowest rank's time"
            if cfg.tp > 1
            else ""
        ),
        flush=True,
    )
    config = asdict(cfg) | {
        "shapes": [dict(zip(("name", "N", "H", "V"), s, strict=True)) for s in cfg.shapes],
    }
    path = None if args.out is None else args.out / "bench.json"

    def write(rows: list[dict]) -> None:
        """bench.json with every row so far (rewritten after each problem)."""
        doc = {"command": "bench", "env": env, "config": config, "rows": rows}
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    if path is not None and rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(cfg.size) if rank == 0 else None
    try:
        rows = protocol.run_bench(
            cfg,
            env=env,
            on_row=progress.advance if progress else None,
            on_problem=progress.describe if progress else None,
            on_rows=write if path is not None and rank == 0 else None,
        )
    finally:
        if progress:
            progress.close()
    failed = [r for r in rows if r["error"]]
    if rank != 0:
        return 1 if failed else 0
    if path is not None:
        write(rows)
        print(f"wrote {path}")
        _plot(rows, args.out / "bench.png", device)
    print()
    from lp_bench.report import bench_table

    head, cells = bench_table(rows)
    print_table(head, cells, left=4)
    return 1 if failed else 0


def _plot(rows: list[dict], path: Path, device: str, file=None) -> None:
    """Draw bench.png; say what happened on ``file`` (stdout by default)."""
    from lp_bench.plot import write_plot

    try:
        if write_plot(rows, path, device):
            print(f"wrote {path}", file=file)
        else:
            print("no plot: matplotlib is not importable (pip install lp-bench[plot])", file=file)
    except Exception as exc:  # the figures are already on disk; a plot is a bonus
        print(f"no plot: {type(exc).__name__}: {exc}", file=file)


class Progress:
    """A rich progress bar on a terminal; elsewhere (a CI log, a pipe) one line per row."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.what = total, 0, ""
        self._bar = None
        if sys.stdout.isatty() and importlib.util.find_spec("rich") is not None:
            from rich.progress import Progress as Bar

            self._bar = Bar(transient=True)
            self._bar.start()
            self._task = self._bar.add_task("lp bench", total=total)

    def describe(self, what: str) -> None:
        self.what = what
        if self._bar is not None:
            self._bar.update(self._task, description=what)

    def advance(self, row: dict) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
            return
        if row["ms"] is not None:
            status = f"{row['ms']:.2f} ms"
        else:
            status = row["error"] or f"skipped: {row['skipped']}"
        run = protocol.row_label(row)
        print(
            f"  [{self.done}/{self.total}] {self.what} {run} {row['provider']}: {status}",
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# ----------------------------------------------------------------------------- check, demo, report


def _cmd_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lp_bench import check

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = check.check_backends(device)
    print(
        f"lp check: backends {', '.join(backends)} on {device}, torch {torch.__version__}; "
        "errors are max abs error / max(1, max |fp64 reference|)",
        flush=True,
    )

    def report(res) -> None:
        print(f"{'PASS' if res.passed else 'FAIL'}  {res.name}: {res.detail}", flush=True)

    start = time.perf_counter()
    results = check.run_checks(
        quick=args.quick, tp=not args.no_tp, tp_timeout=args.tp_timeout, report=report
    )
    failed = sum(not r.passed for r in results)
    took = time.perf_counter() - start
    print(f"{len(results) - failed} passed, {failed} failed in {took:.1f} s")
    return 1 if failed else 0


def _cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lp_bench import demo

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda requested but CUDA is not available")
    cfg = demo.DemoConfig(
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
        "lp_kernels": dist_version("lp-kernels") or "unknown (not installed)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": cfg.device,
        "device_name": device_name(cfg.device),
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
        record = demo.run_demo(cfg, dtype_name)
        demo.print_record(cfg, record)
        records.append({k: v for k, v in record.items() if not k.startswith("_")})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": "demo", "config": asdict(cfg), "env": env, "runs": records}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lp_bench import report

    try:
        doc = report.load(args.results)
    except ValueError as exc:
        parser.error(f"argument BENCH_JSON: {exc}")
    sys.stdout.write(report.markdown(doc))
    if args.plot is not None:
        path = args.plot if args.plot != "" else args.results.with_suffix(".png")
        # On stderr: stdout is the markdown (`lp report bench.json --plot > bench.md`).
        _plot(doc["rows"], Path(path), doc.get("env", {}).get("device", "cpu"), sys.stderr)
    return 0


# ----------------------------------------------------------------------------- parser


def _add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    """``lp bench``'s options of the distill mode."""
    parser.add_argument(
        "--kind",
        type=_kinds_arg,
        default=("reverse_kl",),
        help="distill mode: the divergences, comma-separated: reverse_kl (KL(student || "
        "teacher)), forward_kl (KL(teacher || student)), jsd (generalized JSD, mixture "
        "beta teacher + (1 - beta) student) or all; default reverse_kl",
    )
    parser.add_argument(
        "--beta", type=_beta_arg, default=0.5, help="distill mode: jsd's beta (default 0.5)"
    )
    parser.add_argument(
        "--teacher-scale",
        type=_scales_arg,
        default=TEACHER_SCALES,
        help="distill mode: teacher hidden sizes in multiples of the student's H, "
        "comma-separated (default 1,2)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lp", description="lp: LM-head log-probs without materialized logits."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="time lp against the matmul floor and the materialized path (GPU: S1-S6)",
        description="The performance protocol. train: forward + backward of a per-token "
        "logprob with a random upstream gradient, floor = 4 cuBLAS matmuls of the shape; fwd: "
        "forward only under torch.no_grad, floor = 1 matmul; loss: forward + backward of a "
        "DAPO loss with a k3 KL penalty to reference log-probs, floor = train's 4 matmuls; "
        "distill: forward + backward of a divergence between the student head and a teacher "
        "head (--kind, --teacher-scale) with a per-row upstream gradient, floor = 6 matmuls "
        "(4 of the student's shape, 2 of the teacher's); the floors measured in the same run. "
        "On a GPU the S1-S6 shapes and errors against an "
        "fp32 reference; on CPU a small embedded problem timed with perf_counter, errors "
        "against fp64. Peers (liger-kernel, cut-cross-entropy, TRL's fused head) join "
        "when importable. --tp N under torchrun shards the head over N ranks. Exit status 1 "
        "if a provider failed.",
    )
    bench.add_argument(
        "--grid",
        action="store_true",
        help="the whole grid in one run: modes train,fwd x entropy off/on x lp's default and "
        "deterministic=True paths beside the materialized path and the peers (explicit "
        "--mode/--entropy/--backends override its parts)",
    )
    bench.add_argument(
        "--mode",
        type=_modes_arg,
        default=None,
        help="train (forward + backward), fwd (forward only, under no_grad), loss (forward + "
        "backward of a DAPO loss with a k3 KL penalty: linear_logprob_loss against lp's "
        "log-probs + the loss, the materialized path + the loss and liger's GRPO loss), "
        "distill (forward + backward of a student-teacher divergence with a per-row upstream "
        "gradient: linear_divergence, the materialized path, liger's fused linear JSD, TRL's "
        "chunked divergence; floor = 6 matmuls; GPU shapes S1, S2, S4, S5 unless --shapes) "
        "or a list, e.g. train,fwd; default train (--grid: train,fwd)",
    )
    bench.add_argument(
        "--entropy",
        nargs="?",
        const="on",
        choices=list(ENTROPY_CHOICES),
        default=None,
        help="on (bare --entropy): entropy too (train: gradient through logprob and entropy; "
        "loss: an entropy bonus in the loss); both: rows without and with; default off "
        "(--grid: both). Peers without entropy run logprob only, marked so (loss mode: "
        "skipped)",
    )
    _add_distill_arguments(bench)
    bench.add_argument(
        "--shapes",
        type=_shapes_arg,
        default=None,
        help="comma-separated names (S1..S6, cpu) or NxHxV; default S1-S6 on GPU, "
        "cpu (256x128x16003) on CPU",
    )
    bench.add_argument(
        "--backends",
        type=_backends_arg,
        default=None,
        help="comma-separated: lp-triton, lp-torch, lp-auto, lp-triton-det, lp-torch-det "
        "(deterministic=True, its default tile), lp-triton-det128 (the same with "
        "deterministic_tile=128), lp-loss-triton, lp-loss-torch, lp-loss-auto, "
        "lp-loss-triton-det, lp-loss-torch-det (linear_logprob_loss, loss mode only), "
        "materialized, liger, cce, trl; default: lp-triton, lp-torch, materialized and the "
        "importable peers (CPU: lp-torch, materialized); loss mode: lp-loss-triton, "
        "lp-loss-triton-det, lp-triton, materialized, liger, trl (CPU: the torch backend's)",
    )
    bench.add_argument(
        "--dtype",
        choices=[*protocol.DTYPES, "both"],
        default=None,
        help="default bf16 on GPU, both (fp32 + bf16) on CPU",
    )
    bench.add_argument("--temperature", type=_temperature_arg, default=1.0, help="default 1")
    bench.add_argument(
        "--softcap",
        type=_positive_float,
        default=None,
        metavar="C",
        help="final-logit softcapping, z = C tanh(l / C) / T (Gemma 2/3: 30), passed to every "
        "provider (lp: softcap=; materialized: on the logits in their dtype); default off",
    )
    bench.add_argument(
        "--bias",
        action="store_true",
        help="a random LM-head bias [V] in the input dtype (requiring grad in train mode), "
        "passed to every provider; rows gain err_grad_bias; default off",
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
        "(torchrun --nproc-per-node N -m lp_bench.cli bench --tp N): NCCL on GPUs, gloo on "
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
        "with deterministic=True, which must be bitwise equal to it. The TP ranks' start-up "
        "(importing torch) does not count against --tp-timeout. One PASS/FAIL line per "
        "check; exit status 1 on any failure.",
    )
    check.add_argument("--quick", action="store_true", help="one shape per backend only")
    check.add_argument("--no-tp", action="store_true", help="skip the gloo TP=2 checks")
    check.add_argument(
        "--tp-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="seconds the TP ranks may take for their work once started (default 60)",
    )
    check.set_defaults(func=_cmd_check)

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
        "--dtype",
        choices=[*protocol.DTYPES, "both"],
        default="both",
        help="default: both = bf16 + fp32",
    )
    demo.add_argument("--seed", type=int, default=0, help="default 0")
    demo.add_argument("--repeat", type=_positive_int, default=3, help="timed runs (default 3)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    demo.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    demo.add_argument("--chunk-size", type=_positive_int, default=None)
    demo.add_argument("--json", type=Path, default=None, metavar="PATH", help="write figures")
    demo.set_defaults(func=_cmd_demo)

    report = commands.add_parser(
        "report",
        help="markdown tables (and a plot) from a bench.json",
        description="Print the markdown tables of docs/benchmarks.md from one bench.json of "
        "`lp bench --out`: the run's header (device, torch, triton, commit, date), one table "
        "per mode x entropy (providers down, shapes across, time over the floor), a memory "
        "table and an error table.",
    )
    report.add_argument("results", type=Path, metavar="BENCH_JSON")
    report.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="also draw the plot (default path: BENCH_JSON with .png); needs matplotlib",
    )
    report.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lp`` console script. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
