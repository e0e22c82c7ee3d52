"""pytest plugin of lp-testing: hardware markers and fixtures.

Loaded automatically through the ``pytest11`` entry point ``lp_testing`` when the package
is installed; with the sources only on ``PYTHONPATH``, load it with
``-p lp_testing.plugin`` (both at once are fine, see :func:`pytest_addhooks`).

Markers (also declared by the workspace's root pyproject; declaring twice is harmless):

- ``gpu``: needs a CUDA GPU; skipped with the reason when there is none.
- ``multigpu`` / ``multigpu(n)``: needs at least ``n`` CUDA GPUs (default 2); skipped
  otherwise.
- ``slow``: longer CPU tests (declared only, never skipped here).

Fixtures: ``restore_torch_globals``, ``nan_poison``, ``device`` (cpu, and cuda as a
``gpu`` test), ``rank_runner``.

torch is imported lazily, inside hooks and fixtures, so that loading the plugin costs
nothing for pytest runs that never touch torch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_ENTRY_POINT = "lp_testing"  # name of the pytest11 entry point in pyproject.toml

_MARKERS = (
    "gpu: needs a CUDA GPU (skipped when torch.cuda.is_available() is False)",
    "multigpu(n=2): needs at least n CUDA GPUs (NCCL tensor-parallel tests)",
    "slow: longer CPU tests",
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Let ``-p lp_testing.plugin`` and the installed entry point coexist.

    ``-p`` registers this module under the name ``lp_testing.plugin`` before the entry
    points are loaded; the entry point would then register the same module a second time
    under ``lp_testing`` and pluggy refuses ("already registered under a different name").
    Blocking the entry point's name, only in that case, skips the duplicate.
    """
    name = pluginmanager.get_name(sys.modules[__name__])
    if name != _ENTRY_POINT and pluginmanager.get_plugin(_ENTRY_POINT) is None:
        pluginmanager.set_blocked(_ENTRY_POINT)


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers (for ``--strict-markers`` outside this workspace too)."""
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


@functools.cache
def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needed_gpus(item: pytest.Item) -> int:
    """GPUs an item's markers ask for (0 if none)."""
    needed = 0
    if item.get_closest_marker("gpu") is not None:
        needed = 1
    multi = item.get_closest_marker("multigpu")
    if multi is not None:
        count = multi.args[0] if multi.args else multi.kwargs.get("n", 2)
        needed = max(needed, int(count))
    return needed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` / ``multigpu`` tests on machines without enough CUDA GPUs."""
    for item in items:
        needed = _needed_gpus(item)
        if needed == 0:
            continue
        found = _cuda_device_count()
        if found < needed:
            what = "a CUDA GPU" if needed == 1 else f"{needed} CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {what}; found {found}"))


@pytest.fixture
def restore_torch_globals() -> Iterator[None]:
    """Undo, after the test, changes to torch's global numerics settings.

    Matmul precision and TF32 flags, deterministic algorithms, default dtype, thread count
    (see :func:`lp_testing.state.preserved_torch_globals`).
    """
    from lp_testing.state import preserved_torch_globals

    with preserved_torch_globals():
        yield


@pytest.fixture
def nan_poison() -> Callable[..., Any]:
    """The function :func:`lp_testing.problems.nan_tensor`: ``nan_poison(shape, dtype=, device=)``.

    Use it for scratch or ``out=`` buffers so that an unwritten element fails loudly.
    """
    from lp_testing.problems import nan_tensor

    return nan_tensor


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Runs the test on ``"cpu"`` and on ``"cuda"`` (the latter skipped without a GPU).

    A test module's own ``device`` fixture or ``parametrize("device", ...)`` overrides it.
    """
    return request.param


def _run_ranks_or_skip(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list:
    from lp_testing.dist import InsufficientDevicesError, run_ranks

    try:
        return run_ranks(fn, world_size, *args, **kwargs)
    except InsufficientDevicesError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def rank_runner() -> Callable[..., list]:
    """:func:`lp_testing.dist.run_ranks`, skipping the test when NCCL lacks GPUs.

    Example:
        >>> def test_sum(rank_runner):  # doctest: +SKIP
        ...     assert rank_runner(my_module_level_fn, 2, timeout=60) == [...]
    """
    return _run_ranks_or_skip
