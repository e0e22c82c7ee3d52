"""run_ranks: collectives, results, tracebacks, timeouts, cleanup.

Rank functions live at module level: the ranks import this module to find them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from lp_testing import InsufficientDevicesError, RankError, run_ranks, spawn
from lp_testing.dist import FunctionRef, function_ref

pytestmark = pytest.mark.timeout(120)


class Pair(NamedTuple):
    total: torch.Tensor
    rank: int


def all_reduce_rank(rank: int, world_size: int, offset: torch.Tensor, *, scale: float) -> Pair:
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert torch.get_num_threads() == 1
    t = (torch.tensor([float(rank)]) + offset) * scale
    dist.all_reduce(t)
    return Pair(t, rank)


def test_all_reduce_two_ranks() -> None:
    results = run_ranks(all_reduce_rank, 2, torch.tensor([1.0]), scale=2.0, timeout=60)
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert isinstance(r, Pair) and torch.equal(r.total, torch.tensor([6.0]))


def test_all_reduce_three_ranks_with_spawn_alias() -> None:
    results = spawn(all_reduce_rank, 3, torch.tensor([0.0]), scale=1.0, timeout=60)
    assert [float(r.total) for r in results] == [3.0, 3.0, 3.0]


def environment_and_views(rank: int, world_size: int) -> dict[str, object]:
    big = torch.arange(1_000_000.0)
    gathered = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    return {
        "probe": os.environ.get("LP_TESTING_PROBE"),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "view": big[rank : rank + 3],  # must come back as 3 elements, not the 4 MB base
        "gathered": gathered,
        "grad": torch.ones(2, requires_grad=True) * 2,  # non-leaf: detached on the way
    }


def test_environment_and_tensor_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LP_TESTING_PROBE", "set after the forkserver started")
    results = run_ranks(environment_and_views, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["probe"] == "set after the forkserver started"
        assert r["env"] == (str(rank), "2")
        assert torch.equal(r["view"], torch.arange(rank, rank + 3.0))
        assert r["view"].untyped_storage().nbytes() == 12
        assert [g.tolist() for g in r["gathered"]] == [[0.0, 0.0], [1.0, 1.0]]
        assert not r["grad"].requires_grad


def fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"bad shard on rank {rank}")
    dist.barrier()  # rank 0 waits for rank 1, which is gone: gloo reports the lost peer


def test_child_exception_reaches_parent_with_traceback() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(fail_on_rank_one, 2, timeout=60)
    err = info.value
    assert 1 in err.failures
    text = err.failures[1]
    assert "Traceback (most recent call last)" in text
    assert "fail_on_rank_one" in text and "ValueError: bad shard on rank 1" in text
    assert "--- rank 1 ---" in str(err) and "ValueError: bad shard on rank 1" in str(err)
    assert "first to fail: rank 1" in str(err)


def fail_everywhere(rank: int, world_size: int) -> None:
    raise RuntimeError(f"rank {rank} of {world_size} failed")


def test_all_failures_are_reported() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(fail_everywhere, 3, timeout=60)
    assert sorted(info.value.failures) == [0, 1, 2]
    for rank in range(3):
        assert f"RuntimeError: rank {rank} of 3 failed" in str(info.value)


def crash_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def test_crashed_rank_is_reported() -> None:
    with pytest.raises(RankError, match=r"rank 1 exited \(exit code 7\) without reporting"):
        run_ranks(crash_rank_one, 2, timeout=60)


def hang_in_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)  # never joins the all_reduce
    dist.all_reduce(torch.zeros(1))


@pytest.fixture
def warm_forkserver() -> None:
    """Start the forkserver first, so that timing assertions exclude its one-time start."""
    run_ranks(scaled_rank, 1, 0, timeout=60)


def test_hang_becomes_timeout(warm_forkserver: None) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(hang_in_collective, 2, timeout=3)
    assert time.monotonic() - start < 15  # 3 s, 1 s for the stack dumps, cleanup
    message = str(info.value)
    assert "ranks [0, 1] of 2 did not finish within 3 s" in message
    assert "they were killed" in message
    assert "in hang_in_collective" in message and "all_reduce" in message  # stack dumps


def slow_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_timeout_names_only_unfinished_ranks() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish .*finished: \[0\]"):
        run_ranks(slow_rank_one, 2, timeout=2)


def return_lambda(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_result_is_an_error() -> None:
    with pytest.raises(RankError, match="return value of fn cannot be pickled"):
        run_ranks(return_lambda, 1, timeout=60)


def skip_on_every_rank(rank: int, world_size: int) -> None:
    pytest.skip("no such hardware")


def test_skip_in_ranks_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="rank 0: no such hardware"):
        run_ranks(skip_on_every_rank, 2, timeout=60)


def scaled_rank(rank: int, world_size: int, factor: int) -> int:
    return rank * factor


def test_partial_and_single_rank() -> None:
    assert run_ranks(functools.partial(scaled_rank, factor=10), 2, timeout=60) == [0, 10]
    assert run_ranks(scaled_rank, 1, 3, timeout=60) == [0]


def test_bad_calls_fail_before_starting_ranks() -> None:
    with pytest.raises(TypeError, match="module level"):
        run_ranks(lambda rank, world_size: rank, 2)

    def nested(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises(TypeError, match="module level"):
        run_ranks(nested, 2)
    with pytest.raises(TypeError, match="cannot send"):
        run_ranks(scaled_rank, 2, lambda: 0)
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(scaled_rank, 0)
    with pytest.raises(ValueError, match="backend"):
        run_ranks(scaled_rank, 1, backend="mpi")  # type: ignore[arg-type]


def test_nccl_without_enough_gpus_is_skippable() -> None:
    too_many = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    with pytest.raises(InsufficientDevicesError, match="one CUDA GPU per rank"):
        run_ranks(scaled_rank, too_many, 1, backend="nccl")


def test_function_from_a_module_not_on_sys_path(tmp_path: Path) -> None:
    # pytest --import-mode=importlib imports test modules under names the ranks cannot import.
    source = """
        import torch.distributed as dist

        def world(rank, world_size):
            return (rank, dist.get_world_size())
    """
    path = tmp_path / "lp_probe_module.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("tests_lp_probe.module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    try:
        ref = function_ref(module.world)
        assert isinstance(ref, FunctionRef) and ref.file == str(path)
        assert run_ranks(module.world, 2, timeout=60) == [(0, 2), (1, 2)]
    finally:
        del sys.modules[spec.name]
    try:
        assert ref.resolve().__name__ == "world"  # from the file alone
    finally:
        sys.modules.pop(spec.name, None)


def nccl_all_reduce(rank: int, world_size: int) -> torch.Tensor:
    assert torch.cuda.current_device() == rank
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return t


@pytest.mark.multigpu
def test_nccl_all_reduce(rank_runner) -> None:  # type: ignore[no-untyped-def]
    results = rank_runner(nccl_all_reduce, 2, backend="nccl", timeout=120)
    for t in results:
        assert t.device.type == "cpu" and torch.equal(t, torch.full((4,), 3.0))


def _host_hop_rank(rank: int, world_size: int) -> tuple:
    from lp_testing import gloo_cuda_via_host

    before = (dist.all_gather_into_tensor, dist.all_reduce)
    with gloo_cuda_via_host():
        patched = (dist.all_gather_into_tensor, dist.all_reduce) != before
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)  # host tensors pass straight through
        out = torch.empty(world_size, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([rank * 10]))
    restored = (dist.all_gather_into_tensor, dist.all_reduce) == before
    return patched, restored, t, out


def test_gloo_cuda_via_host_passes_host_tensors_and_restores() -> None:
    """The test-only host hop patches the two collectives inside, leaves host tensors'
    results as they were and restores the originals on exit (its CUDA path runs in the
    GPU suite: test_deterministic_tp_layouts_sharing_one_gpu)."""
    for patched, restored, t, out in run_ranks(_host_hop_rank, 2, timeout=60):
        assert patched and restored
        assert torch.equal(t, torch.tensor([3.0]))
        assert torch.equal(out, torch.tensor([0, 10]))
