"""DESIGN.md's GPU performance protocol: lp against the matmul floor, measured in one run.

For each shape (N tokens, H hidden, V vocab), bf16 inputs, a per-token logprob with
a random upstream gradient, forward + backward:

- floor: 4 x the median time of one cuBLAS bf16 ``[N, H] x [H, V]`` matmul (forward
  logits, backward recompute, two gradient GEMMs), measured in the same process;
- each provider: median of ``--reps`` timed runs after ``--warmup`` runs (CUDA
  events), peak memory above the inputs (``torch.cuda.max_memory_allocated``, the
  returned gradients included), and errors against an fp32 reference (norm-wise
  relative error of logprob, grad_hidden, grad_weight; max abs error of logprob).

The fp32 reference is computed independently of lp: row chunks of fp32 logits
(TF32 off), ``log_softmax``, and the closed-form gradient ``g * (onehot - softmax)``.

Usage (on a GPU host)::

    python benchmarks/protocol.py --shapes S1,S2,S3,S4 --providers lp-torch,materialized \
        --out results/ --commit $(git rev-parse --short HEAD)

Prints a table last and writes ``protocol.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {
    "S1": (8192, 4096, 151936),
    "S2": (16384, 2048, 248320),
    "S3": (32768, 4096, 128256),
    "S4": (16384, 2048, 62080),
}


def make_inputs(n: int, h: int, v: int, *, seed: int = 0, device: str = "cuda"):
    """bf16 hidden/weight with LM-like logit magnitudes (std about 2), targets, upstream grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device, torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad_out = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, grad_out


def time_cuda(fn: Callable[[], object], *, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after ``warmup`` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


@torch.no_grad()
def fp32_reference(hidden, weight, targets, grad_out, *, rows: int = 2048):
    """(logprob, grad_hidden, grad_weight) in fp32, chunked over rows, independent of lp."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w32 = weight.float()
        n = hidden.shape[0]
        logprob = torch.empty(n, device=hidden.device)
        grad_h = torch.empty(hidden.shape, device=hidden.device)
        grad_w = torch.zeros(w32.shape, device=hidden.device)
        for r0 in range(0, n, rows):
            h32 = hidden[r0 : r0 + rows].float()
            ls = torch.log_softmax(h32 @ w32.T, dim=-1)
            t = targets[r0 : r0 + rows]
            logprob[r0 : r0 + rows] = ls.gather(1, t[:, None]).squeeze(1)
            g = grad_out[r0 : r0 + rows]
            dz = ls.exp_().mul_(-g[:, None])
            dz[torch.arange(len(t), device=t.device), t] += g
            grad_h[r0 : r0 + rows] = dz @ w32
            grad_w.addmm_(dz.T, h32)
            del ls, dz
        return logprob, grad_h, grad_w
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def provider_lp(backend: str) -> Callable:
    from lp_kernels import linear_logprob

    def run(hidden, weight, targets, grad_out):
        out = linear_logprob(hidden, weight, targets, backend=backend, validate=False)
        out.logprob.backward(grad_out)
        return out.logprob

    return run


def provider_materialized(hidden, weight, targets, grad_out):
    """What a naive trainer does: bf16 logits, fp32 log_softmax, gather."""
    logits = hidden @ weight.T
    logprob = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    logprob.backward(grad_out)
    return logprob


PROVIDERS: dict[str, Callable[[], Callable]] = {
    "lp-torch": lambda: provider_lp("torch"),
    "lp-auto": lambda: provider_lp("auto"),
    "lp-triton": lambda: provider_lp("triton"),
    "materialized": lambda: provider_materialized,
}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def bench_shape(
    name: str, providers: list[str], *, warmup: int, reps: int, check: bool
) -> list[dict]:
    n, h, v = SHAPES[name]
    hidden, weight, targets, grad_out = make_inputs(n, h, v)
    mm_ms = statistics.median(time_cuda(lambda: hidden @ weight.T, warmup=warmup, reps=reps))
    floor = 4 * mm_ms
    ref = fp32_reference(hidden, weight, targets, grad_out) if check else None
    rows = []
    for prov in providers:
        fn = PROVIDERS[prov]()
        hl = hidden.detach().requires_grad_()
        wl = weight.detach().requires_grad_()

        def step(fn=fn, hl=hl, wl=wl):
            hl.grad = wl.grad = None
            return fn(hl, wl, targets, grad_out)

        row = {"shape": name, "N": n, "H": h, "V": v, "provider": prov, "floor_ms": floor}
        try:
            times = time_cuda(step, warmup=warmup, reps=reps)
            hl.grad = wl.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            logprob = step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            row.update(
                ms=statistics.median(times),
                ms_all=times,
                x_floor=statistics.median(times) / floor,
                peak_gib=peak / 2**30,
            )
            if ref is not None:
                row.update(
                    err_logprob=rel_err(logprob.detach(), ref[0]),
                    maxabs_logprob=float((logprob.detach().float() - ref[0]).abs().max()),
                    err_grad_hidden=rel_err(hl.grad, ref[1]),
                    err_grad_weight=rel_err(wl.grad, ref[2]),
                )
            del logprob
        except torch.OutOfMemoryError as exc:
            row.update(error=f"OOM: {str(exc).splitlines()[0]}")
        hl.grad = wl.grad = None
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)
    return rows


def environment(commit: str | None) -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit or os.environ.get("LP_COMMIT", "unknown"),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'shape':5} {'provider':13} {'ms':>8} {'floor':>8} {'x floor':>7} {'GiB':>6} "
        f"{'err lp':>9} {'err gh':>9} {'err gw':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:5} {r['provider']:13} {r['error']}")
            continue
        errs = " ".join(
            f"{r.get(k, float('nan')):9.2e}"
            for k in ("err_logprob", "err_grad_hidden", "err_grad_weight")
        )
        print(
            f"{r['shape']:5} {r['provider']:13} {r['ms']:8.2f} {r['floor_ms']:8.2f} "
            f"{r['x_floor']:7.3f} {r['peak_gib']:6.2f} {errs}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p!r}; choose from {sorted(PROVIDERS)}")
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


if __name__ == "__main__":
    raise SystemExit(main())
