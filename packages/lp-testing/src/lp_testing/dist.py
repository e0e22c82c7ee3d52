"""Run a function on several ranks of a fresh ``torch.distributed`` job.

Data flow of one :func:`run_ranks` call::

    parent                                   child r (one per rank, forked by the forkserver)
    ------                                   -------------------------------------------------
    pickle (fn, args, kwargs) ----bytes----> set_num_threads(1); apply the parent's environment
    temp dir: FileStore file, stack files    init_process_group(backend, FileStore, rank, world)
                                             wait on the store until every rank's init returned
    wait(result pipes, sentinels, deadline)  value = fn(r, world_size, *args, **kwargs)
                                             destroy_process_group()            (in a finally)
    <-------------- bytes: ("ok", value with tensors moved to CPU) | ("error", traceback text)
    results in rank order | RankError | TimeoutError; every child reaped, temp dir removed

Design notes:

- Start method. ``fork`` deadlocks once the parent has run a multi-threaded torch op (the
  child hangs in OpenMP) and ``spawn`` re-imports torch in every rank (~5 s on 2 cores). A
  ``forkserver`` with torch preloaded forks ranks from a clean single-threaded process that
  already imported torch: ~1 s per call after a one-time start. Because the forkserver is
  started once, a child would otherwise see the environment of that moment; the parent's
  current ``os.environ`` is therefore sent along and applied in the child before any user
  code runs (CUDA is not initialised in the forkserver, so ``CUDA_VISIBLE_DEVICES`` still
  takes effect). NCCL ranks use ``spawn``: a preloaded module (megatron.core on a GPU host)
  can initialise CUDA in the forkserver, after which a forked child cannot use CUDA.
- Rendezvous on a ``FileStore`` in a fresh temp directory: no port is ever chosen, so two
  concurrent test sessions cannot collide.
- Arguments and results cross the process boundary as plain ``pickle`` bytes, so tensors
  travel by value (no shared-memory file descriptors that die with the sender).
- A failure anywhere becomes an exception in the parent: a child's exception as
  :class:`RankError` with every failing rank's formatted traceback; a rank that does not
  finish before ``timeout`` as :class:`TimeoutError`, with a ``faulthandler`` dump of where
  it was stuck. After the first failing rank, the others get :data:`FAILURE_GRACE_S` seconds
  to finish or fail in turn (a peer blocked in a collective usually errors out at once),
  then are killed.
- Children die with the parent: each watches a pipe that the parent holds open and exits
  when it closes, so a parent killed by a test timeout leaves no orphan rank behind.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = [
    "FAILURE_GRACE_S",
    "InsufficientDevicesError",
    "RankError",
    "gloo_cuda_via_host",
    "run_ranks",
    "set_forkserver_preload",
    "spawn",
]

Backend = Literal["gloo", "nccl"]

FAILURE_GRACE_S: float = 5.0
"""Seconds the other ranks get to finish after one rank failed, before they are killed."""

_GROUP_TIMEOUT_SLACK_S = 30.0  # process-group timeout = run timeout + this (a backstop only)
_STACK_DUMP_WAIT_S = 1.0  # time given to hung ranks to write their faulthandler dump
_JOIN_S = 5.0  # time given to finished ranks to exit before they are killed
_STACK_TAIL_LINES = 60

# Always preloaded: torch; the module that the first autograd call with an explicit
# gradient imports (it pulls in sympy: ~5 s per rank that runs a backward otherwise); and
# pytest, which every test module imports (~1 s per rank otherwise).
_DEFAULT_PRELOAD = ("torch", "torch.fx.experimental.symbolic_shapes", "pytest")
# The forkserver is process-global: its preload list is read once, when it starts.
_preload_modules: list[str] = list(_DEFAULT_PRELOAD)


class RankError(RuntimeError):
    """One or more ranks raised; carries every failing rank's formatted traceback.

    Attributes:
        failures: rank -> full formatted traceback text from the child, earliest failure
            first (by the child's clock: the first is usually the root cause, the others
            often peers whose collective broke because of it).
        killed: ranks still running after the failure that were killed.
    """

    def __init__(self, fn_name: str, world_size: int, failures: dict[int, str], killed: list[int]):
        self.failures = dict(failures)
        self.killed = sorted(killed)
        ranks = ", ".join(str(r) for r in sorted(self.failures))
        first = next(iter(self.failures))
        lines = [
            f"{len(self.failures)} of {world_size} ranks failed in {fn_name} "
            f"(ranks {ranks}; first to fail: rank {first})"
        ]
        if self.killed:
            lines.append(f"ranks {self.killed} were still running and were killed")
        for rank, text in self.failures.items():
            lines.append(f"--- rank {rank} ---")
            lines.append(text.rstrip())
        super().__init__("\n".join(lines))


class InsufficientDevicesError(RuntimeError):
    """The requested backend needs more devices than this machine has (a test should skip)."""


def set_forkserver_preload(modules: Iterable[str]) -> None:
    """Add modules to import once in the forkserver, before the ranks are forked from it.

    ``torch``, ``torch.fx.experimental.symbolic_shapes`` (imported by the first autograd
    call with an explicit gradient, ~5 s) and ``pytest`` are always preloaded. Preloading
    a heavy module (``megatron.core``, ~9 s; ``lp_kernels`` with triton) likewise makes
    every rank start in ~1 s instead of paying the import in each. The forkserver keeps
    the environment of its start: set variables read at import (``TRITON_INTERPRET``)
    before the first :func:`run_ranks`. Call it before the first :func:`run_ranks` of the process:
    the forkserver reads the list when it starts and ignores later changes. A module that
    fails to import is skipped silently by the forkserver.

    Args:
        modules: importable module names, e.g. ``["megatron.core"]``.
    """
    extra = [m for m in modules if m not in _DEFAULT_PRELOAD]
    _preload_modules[:] = [*_DEFAULT_PRELOAD, *dict.fromkeys(extra)]


@dataclass(frozen=True)
class FunctionRef:
    """Pickle-safe reference to a module-level function, resolvable without its module on path.

    pytest may import a test module under a name that the child cannot import (e.g.
    ``--import-mode=importlib``); the file path is the fallback.
    """

    module: str
    qualname: str
    file: str | None

    def resolve(self) -> Callable[..., Any]:
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError:
                if self.file is None:
                    raise
                module = _load_module_from_file(self.module, self.file)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _load_module_from_file(name: str, file: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def function_ref(fn: Callable[..., Any]) -> Callable[..., Any] | FunctionRef:
    """Check that ``fn`` can reach a child, and return what to pickle for it."""
    if not callable(fn):
        raise TypeError(f"run_ranks: fn must be callable, got {type(fn).__name__}")
    if not isinstance(fn, types.FunctionType):
        return fn  # functools.partial, callable instances: plain pickle decides
    if "<lambda>" in fn.__qualname__ or "<locals>" in fn.__qualname__:
        raise TypeError(
            f"run_ranks: fn must be defined at module level so that the rank processes can "
            f"import it; got {fn.__module__}.{fn.__qualname__}. Move it to the top level of "
            f"its module (or wrap a module-level function with functools.partial)."
        )
    if fn.__module__ == "__main__":
        return fn  # multiprocessing re-imports the main script as __mp_main__ in the child
    return FunctionRef(fn.__module__, fn.__qualname__, fn.__code__.co_filename)


@dataclass(frozen=True)
class _ChildSpec:
    """Everything a rank needs, identical for all ranks."""

    world_size: int
    backend: str
    store_path: str
    stack_dir: str
    group_timeout_s: float
    payload: bytes  # pickle of (fn or FunctionRef, args, kwargs)
    environ: dict[str, str]


def _to_cpu(value: Any) -> Any:
    """Detach and copy tensors to CPU through lists, tuples, named tuples and dicts."""
    if isinstance(value, torch.Tensor):
        # clone: a CPU view would otherwise pickle its whole base storage
        return value.detach().cpu().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _watch_parent(alive: Connection) -> None:
    """Exit this rank as soon as the parent closes its end of ``alive`` (or dies)."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv_bytes()
    os._exit(3)


def _is_skip(exc: BaseException) -> bool:
    """Whether ``exc`` is pytest's skip outcome (``pytest.skip(...)`` inside ``fn``)."""
    outcomes = sys.modules.get("_pytest.outcomes")
    return outcomes is not None and isinstance(exc, outcomes.Skipped)


def _all_ranks_joined(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Return once every rank's ``init_process_group`` has returned.

    Gloo connects its full mesh inside ``init_process_group``, and a rank's init can return
    before its peers' have: a rank whose ``fn`` returns at once would then destroy its group
    while a peer is still connecting to it ("connectFullMesh ... Connection closed by
    peer"). A key per rank on the job's own store (outside the group's key prefix) orders
    every teardown after every init, without a collective and for every backend.
    """
    store.set(f"lp_testing/joined/{rank}", "1")
    store.wait([f"lp_testing/joined/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def _child_main(spec: _ChildSpec, rank: int, conn: Connection, alive: Connection) -> None:
    """Entry point of one rank (runs in the child process)."""
    torch.set_num_threads(1)  # first: 2 cores shared by all ranks; no OpenMP oversubscription
    for key in set(os.environ) - set(spec.environ):
        del os.environ[key]
    os.environ.update(spec.environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True).start()
    stack_file = open(os.path.join(spec.stack_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    failed_at: float | None = None  # when fn raised, before teardown lets peers fail too
    try:
        fn_ref, args, kwargs = pickle.loads(spec.payload)
        fn = fn_ref.resolve() if isinstance(fn_ref, FunctionRef) else fn_ref
        store = dist.FileStore(spec.store_path, spec.world_size)
        init_kwargs: dict[str, Any] = {}
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
            init_kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.group_timeout_s),
            **init_kwargs,
        )
        _all_ranks_joined(store, rank, spec.world_size, spec.group_timeout_s)
        try:
            value = fn(rank, spec.world_size, *args, **kwargs)
        except BaseException:
            failed_at = time.time()
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            data = pickle.dumps(
                ("ok", _to_cpu(value), time.time()), protocol=pickle.HIGHEST_PROTOCOL
            )
        except Exception as exc:
            raise TypeError(f"rank {rank}: the return value of fn cannot be pickled") from exc
    except BaseException as exc:  # everything, SystemExit and pytest outcomes included
        kind = "skip" if _is_skip(exc) else "error"
        text = str(exc) if kind == "skip" else "".join(traceback.format_exception(exc))
        data = pickle.dumps((kind, text, failed_at or time.time()))
    conn.send_bytes(data)
    conn.close()


def _context(backend: str = "gloo") -> mp.context.BaseContext:
    # NCCL ranks are spawned: a preloaded module may have initialised CUDA in the forkserver
    # (megatron.core does on a GPU host), and CUDA cannot be used in a forked child then.
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_preload_modules))
    return ctx


def _check_backend(backend: str, world_size: int) -> None:
    if not dist.is_available():
        raise RuntimeError("run_ranks: this torch build has no torch.distributed")
    if backend == "gloo":
        return
    if backend != "nccl":
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world_size:
        raise InsufficientDevicesError(
            f"run_ranks(backend='nccl') needs one CUDA GPU per rank: {world_size} ranks, "
            f"{found} GPUs visible"
        )
    if not dist.is_nccl_available():
        raise InsufficientDevicesError("run_ranks(backend='nccl'): this torch has no NCCL")


def _read_stack(stack_dir: str, rank: int) -> str:
    path = os.path.join(stack_dir, f"rank{rank}.stack")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_STACK_TAIL_LINES:])


def _dump_stacks(procs: Sequence[mp.process.BaseProcess], ranks: Iterable[int]) -> None:
    """Ask the given ranks to write their Python stacks (faulthandler on SIGUSR1)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    sent = False
    for rank in ranks:
        pid = procs[rank].pid
        if pid is not None and procs[rank].is_alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
                sent = True
    if sent:
        time.sleep(_STACK_DUMP_WAIT_S)


def _stuck_report(stack_dir: str, rank: int) -> str:
    stack = _read_stack(stack_dir, rank)
    return f"rank {rank} stack when killed:\n{stack}" if stack else f"rank {rank}: no stack dump"


def _reap(procs: Sequence[mp.process.BaseProcess]) -> None:
    """Let finished ranks exit, kill the others, and release their resources."""
    deadline = time.monotonic() + _JOIN_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_JOIN_S)
    for proc in procs:
        with contextlib.suppress(ValueError):
            proc.close()


def _collect(
    procs: Sequence[mp.process.BaseProcess],
    conns: Sequence[Connection],
    timeout: float,
) -> tuple[dict[int, Any], dict[int, str], dict[int, str], list[int]]:
    """Wait for every rank's message.

    Returns:
        (results, errors earliest first, skips, ranks that did not report in time).
    """
    pending = dict(enumerate(conns))
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failure_times: dict[int, float] = {}
    skips: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [*pending.values(), *(procs[r].sentinel for r in pending)]
        wait(waitables, timeout=remaining)
        for rank, conn in list(pending.items()):
            if not conn.poll():  # poll() is also True at EOF
                continue
            del pending[rank]
            try:
                kind, value, stamp = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=_JOIN_S)
                kind, stamp, value = (
                    "error",
                    time.time(),
                    (
                        f"rank {rank} exited (exit code {procs[rank].exitcode}) without reporting "
                        f"a result: killed by a signal, os._exit, or a crash in native code"
                    ),
                )
            if kind == "ok":
                results[rank] = value
            else:
                (skips if kind == "skip" else errors)[rank] = value
                failure_times[rank] = stamp
                failed_at = failed_at if failed_at is not None else time.monotonic()
    errors = {rank: errors[rank] for rank in sorted(errors, key=failure_times.__getitem__)}
    return results, errors, skips, sorted(pending)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Backend = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh ranks.

    Each rank is a process with an initialised default process group (``gloo`` on CPU,
    or ``nccl`` with GPU ``rank`` as its device). The group is destroyed when ``fn``
    returns or raises.

    Args:
        fn: module-level function ``fn(rank, world_size, *args, **kwargs)`` (a lambda or a
            nested function cannot reach the child processes; ``functools.partial`` of a
            module-level function can). In a plain script, guard the script's entry point
            with ``if __name__ == "__main__":``, since each rank re-imports the main module.
        world_size: number of ranks, >= 1.
        *args: extra positional arguments for ``fn``, pickled by value (pass CPU tensors;
            move them to ``f"cuda:{rank}"`` inside ``fn``).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, ``cuda:rank``).
        timeout: seconds the ranks may run (counted once they have all started); also sets
            the process-group timeout to ``timeout + 30`` s as a backstop.
        **kwargs: extra keyword arguments for ``fn``.

    Returns:
        The ranks' return values in rank order. Tensors (also inside lists, tuples, named
        tuples and dicts) are detached and copied to CPU.

    Raises:
        RankError: one or more ranks raised; the message holds each failing rank's full
            traceback.
        TimeoutError: some ranks did not finish within ``timeout``; names them and shows
            where they were stuck. They are killed.
        InsufficientDevicesError: ``backend="nccl"`` with fewer GPUs than ranks.
        TypeError: ``fn`` or the arguments cannot be sent to the ranks.

    If every failing rank called ``pytest.skip``, the parent skips with the same reason.

    Example:
        >>> import torch, torch.distributed as dist
        >>> def total(rank, world_size):  # at module level
        ...     t = torch.tensor([float(rank)])
        ...     dist.all_reduce(t)
        ...     return t
        >>> run_ranks(total, 2)  # doctest: +SKIP
        [tensor([1.]), tensor([1.])]
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"run_ranks: timeout must be > 0 seconds, got {timeout}")
    _check_backend(backend, world_size)
    fn_name = getattr(fn, "__qualname__", repr(fn))
    try:
        payload = pickle.dumps((function_ref(fn), args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"run_ranks: cannot send fn/args/kwargs to the ranks: {exc}") from exc

    ctx = _context(backend)
    with tempfile.TemporaryDirectory(prefix="lp-ranks-") as tmp:
        spec = _ChildSpec(
            world_size=world_size,
            backend=backend,
            store_path=os.path.join(tmp, "store"),
            stack_dir=tmp,
            group_timeout_s=timeout + _GROUP_TIMEOUT_SLACK_S,
            payload=payload,
            environ=dict(os.environ),
        )
        alive_r, alive_w = ctx.Pipe(duplex=False)
        procs: list[mp.process.BaseProcess] = []
        conns: list[Connection] = []
        collected = False
        try:
            for rank in range(world_size):
                result_r, result_w = ctx.Pipe(duplex=False)
                conns.append(result_r)
                proc = ctx.Process(
                    target=_child_main,
                    args=(spec, rank, result_w, alive_r),
                    name=f"lp-rank{rank}",
                    daemon=True,
                )
                try:
                    proc.start()
                finally:
                    result_w.close()  # the child holds the only write end: EOF if it dies
                procs.append(proc)
            alive_r.close()
            results, errors, skips, unfinished = _collect(procs, conns, timeout)
            _dump_stacks(procs, unfinished)
            stuck = {rank: _stuck_report(tmp, rank) for rank in unfinished}
            for rank in unfinished:
                procs[rank].kill()
            collected = True
        finally:
            if not collected:  # interrupted (KeyboardInterrupt, pytest-timeout): kill at once
                for proc in procs:
                    with contextlib.suppress(ValueError):
                        proc.kill()
            alive_w.close()  # ranks that linger after reporting exit through their watchdog
            alive_r.close()
            _reap(procs)
            for conn in conns:
                conn.close()

    if errors:
        for rank in unfinished:
            errors[rank] = f"still running after another rank failed; killed.\n{stuck[rank]}"
        raise RankError(fn_name, world_size, errors, unfinished)
    if skips:  # ranks left waiting for a skipped peer were killed: not a timeout
        import pytest

        pytest.skip("; ".join(f"rank {r}: {reason}" for r, reason in sorted(skips.items())))
    if unfinished:
        done = sorted(results)
        raise TimeoutError(
            f"run_ranks({fn_name}): ranks {unfinished} of {world_size} did not finish within "
            f"{timeout:g} s (finished: {done}); they were killed.\n"
            + "\n".join(stuck[rank] for rank in unfinished)
        )
    return [results[rank] for rank in range(world_size)]


spawn = run_ranks
"""Alias of :func:`run_ranks`."""


class _Done:
    """The pending work of a collective that has already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def gloo_cuda_via_host() -> Iterator[None]:
    """Test-only: gloo collectives on CUDA tensors go through host copies.

    Lets several gloo ranks share one GPU (a TP layout on a machine with fewer GPUs than
    ranks): inside, ``dist.all_gather_into_tensor`` (synchronous calls, what lp makes) and
    ``dist.all_reduce`` (also ``async_op=True``, which returns finished work) copy CUDA
    arguments to the host, run the collective there and copy the result back;
    ``dist.batch_isend_irecv`` (deterministic=True's halo rows) runs its sends and receives
    on host copies and returns when they are done. Copies move bytes, so every result is
    the one the collective would give on host tensors. Apply inside each rank.
    """
    gather, reduce = dist.all_gather_into_tensor, dist.all_reduce

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if not output.is_cuda or async_op:
            return gather(output, input, group=group, async_op=async_op)
        host = output.cpu()
        gather(host, input.cpu(), group=group)
        output.copy_(host)
        return None

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not tensor.is_cuda:
            return reduce(tensor, op=op, group=group, async_op=async_op)
        host = tensor.cpu()
        reduce(host, op=op, group=group)
        tensor.copy_(host)
        return _Done() if async_op else None  # an async call has finished on return

    batch = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        """Runs the batch on host copies and waits for it: returns no pending work."""
        host_ops, back = [], []
        for op in p2p_op_list:
            t = op.tensor.cpu() if op.tensor.is_cuda else op.tensor
            if op.tensor.is_cuda and op.op is dist.irecv:
                back.append((op.tensor, t))
            host_ops.append(dist.P2POp(op.op, t, group=op.group, group_peer=op.group_peer))
        for work in batch(host_ops):
            work.wait()
        for dst, host in back:
            dst.copy_(host)
        return []

    dist.all_gather_into_tensor, dist.all_reduce = all_gather_into_tensor, all_reduce
    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.all_gather_into_tensor, dist.all_reduce = gather, reduce
        dist.batch_isend_irecv = batch
