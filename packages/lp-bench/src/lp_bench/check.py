"""``lp check``: a short self-test of the installed backends, one PASS/FAIL line per check.

- parity: logprob / entropy / lse and both gradients against lp-testing's fp64 reference
  (:func:`lp_testing.reference.reference_all`) on small awkward shapes (padded vocabulary,
  ignored rows, temperature), for each available backend;
- bitwise reproducibility run to run;
- gloo TP=2 on CPU (two spawned processes, uneven shards) against the single-process
  result: the default path within tolerance, ``deterministic=True`` bitwise.

The TP ranks are timed on their work only. Each rank imports torch and lp, makes one tiny
call (so that lazy imports happen now), joins the process group and then reports "ready";
the parent gives start-up a generous allowance (:data:`TP_STARTUP_S`: on a loaded 2-core
machine importing torch in two fresh processes can take minutes) and only then starts the
check's own timeout. A machine that is merely busy does not fail the check.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from lp_bench.environment import triton_interpreting

CHECK_IGNORE = -100
# (name, N, H, V real, V padded rows, dtype, temperature)
CHECK_SHAPES = (
    ("7x13x257 pad+ign T=0.7", 7, 13, 257, 263, torch.float32, 0.7),
    ("33x64x1000 T=1", 33, 64, 1000, 1000, torch.float32, 1.0),
    ("5x8x130 bf16 T=1.3", 5, 8, 130, 136, torch.bfloat16, 1.3),
)
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Max abs error over max(1, max |fp64 reference|) (per output / gradient) for PASS."""
TP_TIMEOUT_S = 60.0
"""Seconds the TP ranks may take for the check's work, once every rank is ready."""
TP_STARTUP_S = 900.0
"""Seconds every TP rank may take to start (imports, a first call, the process group)."""
TP_SPLIT = 128  # rank 0 holds vocabulary rows [0, 128), rank 1 the rest: uneven shards
KEYS = ("logprob", "entropy", "lse", "grad_hidden", "grad_weight")


@dataclass
class CheckResult:
    """One line of ``lp check``."""

    name: str
    passed: bool
    detail: str


def check_problem(n: int, h: int, v: int, v_pad: int, dtype: torch.dtype, seed: int = 0):
    """hidden [n, h], weight [v_pad, h] (rows >= v are padding), targets with ignored rows,
    upstream grads ``[3, n]`` for logprob, entropy, lse."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v_pad, h, generator=gen) * (2.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[1::3] = CHECK_IGNORE
    targets[-1] = v - 1  # the last real token
    grads = torch.randn(3, n, generator=gen)
    return hidden, weight, targets, grads


def check_reference(hidden, weight, targets, grads, *, temperature: float, vocab_size: int):
    """The fp64 truth of the check's problem (lp-testing's reference)."""
    from lp_testing.reference import reference_all

    return reference_all(
        hidden,
        weight,
        targets,
        grad_logprob=grads[0],
        grad_entropy=grads[1],
        grad_lse=grads[2],
        temperature=temperature,
        ignore_index=CHECK_IGNORE,
        vocab_size=vocab_size,
    )


def lp_run(hidden, weight, targets, grads, *, temperature, vocab_size, backend, **kw) -> dict:
    """linear_logprob forward + backward with all three outputs; results detached."""
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
    return dict(zip(KEYS[:3], (o.detach() for o in outs), strict=True)) | {
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
    }


def max_err(res: dict, ref: dict) -> tuple[float, str]:
    """Worst (max abs error / max(1, max |ref|)) over the keys of ``ref``, and which key."""
    worst, which = 0.0, ""
    for k, truth in ref.items():
        err = float((res[k].double().cpu() - truth.double().cpu()).abs().max())
        scaled = err / max(float(truth.abs().max()), 1.0)
        if scaled > worst or not which:
            worst, which = scaled, k
    return worst, which


def check_backends(device: str) -> list[str]:
    """torch always; triton on CUDA, or on CPU under TRITON_INTERPRET=1."""
    names = ["torch"]
    if importlib.util.find_spec("triton") is not None and (
        device == "cuda" or triton_interpreting()
    ):
        names.append("triton")
    return names


def check_parity(backend: str, device: str, shapes=CHECK_SHAPES) -> list[CheckResult]:
    """Parity against fp64 and run-to-run bits of ``backend`` on each shape."""
    results = []
    for name, n, h, v, v_pad, dtype, temp in shapes:
        hidden, weight, targets, grads = check_problem(n, h, v, v_pad, dtype)
        ref = check_reference(hidden, weight, targets, grads, temperature=temp, vocab_size=v)
        dev = [x.to(device) for x in (hidden, weight, targets)]
        kw = dict(temperature=temp, vocab_size=v, backend=backend)
        try:
            first = lp_run(*dev, grads, **kw)
            second = lp_run(*dev, grads, **kw)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            results.append(CheckResult(f"{backend} parity {name}", False, msg))
            continue
        err, which = max_err(first, {k: ref[k] for k in KEYS})
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


# ----------------------------------------------------------------------------- TP ranks


def _send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message))


def _tp_worker(rank: int, world: int, store_path: str, payload: bytes, conn) -> None:
    """One gloo rank of the TP=2 check: start up, say "ready", then its shard's results."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        hidden, weight, targets, grads, temp, v, deterministic = pickle.loads(payload)
        # Start-up: a tiny local call imports what the first real call would (the autograd
        # engine's lazy imports, lp's backends), so that none of it counts as work.
        tiny = check_problem(2, 4, 8, 8, torch.float32)
        lp_run(*tiny, temperature=1.0, vocab_size=8, backend="torch")
        timeout = timedelta(seconds=TP_STARTUP_S + TP_TIMEOUT_S)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        _send(conn, ("ready", None))
        try:
            bounds = [0, TP_SPLIT, weight.shape[0]]
            shard = weight[bounds[rank] : bounds[rank + 1]]
            res = lp_run(
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
            result: tuple[str, object] = ("ok", res)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the check
        import traceback

        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    _send(conn, result)
    conn.close()


def _gather(conns: list, procs: list, deadline: float, expect: str, what: str) -> list:
    """One message from every rank before ``deadline`` (monotonic), in rank order.

    Raises RuntimeError at once when a rank sends an error instead of ``expect`` or dies,
    and TimeoutError naming the ranks still silent at the deadline (``what`` says what
    they did not do).
    """
    from multiprocessing.connection import wait

    got: dict[int, object] = {}
    while len(got) < len(conns):
        pending = [r for r in range(len(conns)) if r not in got]
        left = deadline - time.monotonic()
        if left > 0:
            wait([w for r in pending for w in (conns[r], procs[r].sentinel)], timeout=left)
        progressed = False
        for r in pending:
            if conns[r].poll():
                try:
                    status, value = pickle.loads(conns[r].recv_bytes())
                except EOFError:
                    raise RuntimeError(f"TP rank {r} died without a result") from None
                if status != expect:
                    raise RuntimeError(f"TP rank {r} failed: {value}")
                got[r], progressed = value, True
            elif not procs[r].is_alive():
                raise RuntimeError(f"TP rank {r} died (exit code {procs[r].exitcode})")
        if not progressed and time.monotonic() >= deadline:
            late = ", ".join(str(r) for r in range(len(conns)) if r not in got)
            raise TimeoutError(f"TP rank {late} {what}")
    return [got[r] for r in range(len(conns))]


def run_tp_ranks(
    payload: bytes,
    world: int = 2,
    timeout: float = TP_TIMEOUT_S,
    startup: float = TP_STARTUP_S,
    on_ready: Callable[[float], None] | None = None,
) -> list:
    """Spawn ``world`` gloo ranks of :func:`_tp_worker`; results in rank order.

    ``startup`` bounds the ranks' start-up (until every rank is ready); ``timeout`` then
    bounds their work; ``on_ready`` gets the seconds start-up took. Raises RuntimeError on
    a rank's error or death and TimeoutError past either limit; every child is reaped
    (killed if need be), the rendezvous removed.
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
            what = f"did not start within {startup:.0f} s"
            began = time.monotonic()
            _gather(conns, procs, began + startup, "ready", what)
            if on_ready is not None:
                on_ready(time.monotonic() - began)
            what = f"did not finish within {timeout:.0f} s of starting work"
            results = _gather(conns, procs, time.monotonic() + timeout, "ok", what)
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


def check_tp(
    timeout: float = TP_TIMEOUT_S, *, deterministic: bool = False, startup: float = TP_STARTUP_S
) -> CheckResult:
    """gloo TP=2 on CPU, uneven shards: outputs and gradients match the single process;
    with ``deterministic=True`` they must be bitwise equal to it. ``timeout`` bounds the
    ranks' work, ``startup`` their start-up."""
    name, n, h, v, v_pad, dtype, temp = CHECK_SHAPES[0]
    mode = "deterministic, bitwise" if deterministic else "uneven shards"
    label = f"torch gloo TP=2 {mode} {name}"
    hidden, weight, targets, grads = check_problem(n, h, v, v_pad, dtype)
    single = lp_run(
        hidden, weight, targets, grads, temperature=temp, vocab_size=v, backend="torch",
        deterministic=deterministic,
    )  # fmt: skip
    payload = pickle.dumps((hidden, weight, targets, grads, temp, v, deterministic))
    started: list[float] = []
    try:
        ranks = run_tp_ranks(payload, 2, timeout, startup, on_ready=started.append)
    except (RuntimeError, TimeoutError) as exc:
        return CheckResult(label, False, str(exc).splitlines()[0])
    untimed = f"; start-up {started[0]:.0f} s, untimed"
    if deterministic:
        differ = [
            f"{key} (rank {rank})"
            for rank, res in enumerate(ranks)
            for key in KEYS[:4]
            if not torch.equal(res[key], single[key])
        ]
        grad_w = torch.cat([r["grad_weight"] for r in ranks])
        if not torch.equal(grad_w, single["grad_weight"]):
            differ.append("grad_weight")
        detail = "all 5 equal to TP=1" if not differ else f"differ: {', '.join(differ)}"
        return CheckResult(label, not differ, detail + untimed)
    worst, which = 0.0, ""
    for rank, res in enumerate(ranks):
        combined = dict(res)
        if rank == 0:  # the shard gradients together are the full weight gradient
            combined["grad_weight"] = torch.cat([r["grad_weight"] for r in ranks])
        else:
            combined.pop("grad_weight")
        err, key = max_err(combined, {k: single[k] for k in combined})
        if err > worst or not which:
            worst, which = err, f"{key}, rank {rank}"
    tol = 1e-5
    return CheckResult(
        label,
        worst <= tol,
        f"max rel err vs TP=1 {worst:.2e} ({which}), tol {tol:.0e}{untimed}",
    )


def run_checks(
    *,
    quick: bool = False,
    tp: bool = True,
    tp_timeout: float = TP_TIMEOUT_S,
    report: Callable[[CheckResult], None] = print,
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
            res = check_tp(tp_timeout, deterministic=deterministic)
            report(res)
            results.append(res)
    return results
