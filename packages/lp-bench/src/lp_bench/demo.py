"""``lp demo``: one embedded problem through lp, the materialized path and the fp64 truth.

The problem: hidden ``[N, H]``, weight ``[V, H]``, targets ``[N]`` with some rows at
ignore_index, and a random per-token upstream gradient on logprob, entropy and lse. Three
paths run forward + backward and are printed side by side:

    lp              linear_logprob(hidden, weight, targets, return_entropy, return_lse)
    materialized    logits = hidden @ weight.T in the input dtype -> fp32 log_softmax -> gather
    fp64 reference  lp-testing's reference_all: the truth the other two are measured against

Per path: median wall time of forward + backward, peak memory above the inputs, the part
of that peak that is neither an output nor a gradient (the logits scratch), max abs error
of every output and gradient against fp64, and whether repeated runs are bitwise equal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lp_bench.memory import LiveBytes, peak_bytes
from lp_bench.protocol import DTYPES
from lp_bench.providers import materialized_outputs
from lp_bench.table import print_table

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

Run = Callable[[], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class DemoConfig:
    """One ``lp demo`` run, as parsed from the command line."""

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


def _autograd_run(outputs_of, problem: dict[str, torch.Tensor]) -> Run:
    """Forward + backward of ``outputs_of(hidden, weight, targets) -> (logprob, entropy,
    lse)`` with the per-token upstream gradients; all results, detached."""

    def run() -> dict[str, torch.Tensor]:
        hidden = problem["hidden"].detach().requires_grad_()
        weight = problem["weight"].detach().requires_grad_()
        outputs = outputs_of(hidden, weight, problem["targets"])
        upstream = [problem[f"d_{name}"] for name in OUTPUTS]
        grads = torch.autograd.grad(outputs, (hidden, weight), upstream)
        return dict(zip(OUTPUTS + GRADS, [*(o.detach() for o in outputs), *grads], strict=True))

    return run


def paths(cfg: DemoConfig, problem: dict[str, torch.Tensor]) -> dict[str, Run]:
    """The three paths of the demo on ``problem``."""
    from lp_kernels import linear_logprob
    from lp_testing.reference import reference_all

    def lp(hidden, weight, targets):
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

    def materialized(hidden, weight, targets):
        out = materialized_outputs(
            hidden, weight, targets, ignore_index=IGNORE_INDEX, entropy=True, lse=True
        )
        return tuple(out[k] for k in OUTPUTS)

    def fp64() -> dict[str, torch.Tensor]:
        ref = reference_all(
            problem["hidden"],
            problem["weight"],
            problem["targets"],
            **{f"grad_{k}": problem[f"d_{k}"] for k in OUTPUTS},
            ignore_index=IGNORE_INDEX,
        )
        return {k: ref[k] for k in OUTPUTS + GRADS}

    return {
        "lp": _autograd_run(lp, problem),
        "materialized": _autograd_run(materialized, problem),
        "fp64": fp64,
    }


def measure(run: Run, cfg: DemoConfig) -> dict:
    """Warm-up, then up to ``repeat`` timed runs (fewer once TIME_BUDGET_S is spent).

    On CPU the warm-up run is also the memory run (the tracker slows it down; it is not
    timed); on CUDA memory gets its own run after the warm-up, so that one-time allocations
    (cuBLAS workspace, Triton compilation) are not counted. Returns the figures and the
    results of the last run.
    """
    cuda = cfg.device == "cuda"
    if cuda:
        results = [run()]
        peak = peak_bytes(run, "cuda")
    else:
        with LiveBytes() as tracker:
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


def errors(results: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
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
    figures = {name: measure(run, cfg) for name, run in paths(cfg, problem).items()}
    ref = figures["fp64"]["results"]
    for fig in figures.values():
        fig["max_abs_err"], fig["max_rel_err"] = errors(fig["results"], ref)
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def print_record(cfg: DemoConfig, rec: dict) -> None:
    """The figures of one dtype, then its first tokens, as tables."""
    figs = rec["paths"]
    rows: list[list[str]] = [
        [
            "time fwd+bwd, median (runs)",
            *[f"{figs[p]['time_s'] * 1e3:.1f} ms ({len(figs[p]['times_s'])})" for p in PATHS],
        ],
        ["peak memory above inputs", *[_mib(figs[p]["peak_bytes"]) for p in PATHS]],
        ["  scratch (peak - outputs - grads)", *[_mib(figs[p]["scratch_bytes"]) for p in PATHS]],
    ]
    for k in OUTPUTS + GRADS:
        errs = [f"{figs[p]['max_abs_err'][k]:.2e}" for p in PATHS[:2]]
        rows.append([f"max |err| {k} vs fp64", *errs, "-"])
    rows.append(
        ["bitwise equal run to run", *["yes" if figs[p]["reproducible"] else "NO" for p in PATHS]]
    )
    print()
    title = f"{rec['dtype']} ({rec['ignored_rows']} ignored rows)"
    print_table(["", *(HEADERS[p] for p in PATHS)], rows, title=title)
    print(
        f"[N, V] logits + their grad in {rec['dtype']}: {_mib(rec['logits_and_grad_bytes'])}"
        " (the materialized path also holds fp32 [N, V] softmax intermediates)",
    )

    res, targets = rec["_results"], rec["_targets"]
    names = ("logprob", "entropy")
    head = ["row", "target", *(f"{n} {p}" for n in names for p in PATHS)]
    cells = []
    for i in range(min(cfg.n, 5)):
        target = int(targets[i])
        label = "ignored" if target == IGNORE_INDEX else str(target)
        vals = [f"{float(res[p][n][i]):.6f}" for n in names for p in PATHS]
        cells.append([str(i), label, *vals])
    print()
    print_table(head, cells, left=2, title="first tokens")
