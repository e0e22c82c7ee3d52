"""The pytest plugin: markers and auto-skips, fixtures, loading with ``-p``."""

from __future__ import annotations

import pytest
import torch

from lp_testing import preserved_torch_globals

pytest_plugins = ["pytester"]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_markers_skip_without_hardware(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.gpu
        def test_gpu():
            pass

        @pytest.mark.multigpu
        def test_two_gpus():
            pass

        @pytest.mark.multigpu(4)
        def test_four_gpus():
            pass

        @pytest.mark.slow
        def test_cpu():
            pass
        """)
    # -p next to the installed entry point: both must load without a conflict.
    result = pytester.runpytest("-p", "lp_testing.plugin", "--strict-markers", "-rs")
    expected_skips = (GPUS < 1) + (GPUS < 2) + (GPUS < 4)
    result.assert_outcomes(passed=4 - expected_skips, skipped=expected_skips)
    if GPUS == 0:
        result.stdout.fnmatch_lines(
            [
                "SKIPPED*:3: needs a CUDA GPU; found 0",
                "SKIPPED*:7: needs 2 CUDA GPUs; found 0",
                "SKIPPED*:11: needs 4 CUDA GPUs; found 0",
            ]
        )


def test_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import torch
        from lp_testing.dist import run_ranks

        # (torch.use_deterministic_algorithms is restored too, but calling it imports
        # torch._inductor and triton: ~10 s on 2 cores.)
        def test_change_globals(restore_torch_globals):
            torch.set_float32_matmul_precision("medium")
            torch.set_default_dtype(torch.float64)
            torch.set_num_threads(1)
            torch.utils.deterministic.fill_uninitialized_memory = False

        def test_globals_were_restored():
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.get_default_dtype() == torch.float32
            assert torch.utils.deterministic.fill_uninitialized_memory

        def test_nan_poison(nan_poison):
            buf = nan_poison((3, 2), dtype=torch.bfloat16)
            assert buf.dtype == torch.bfloat16 and buf.isnan().all()

        def test_device(device):
            assert torch.zeros(1, device=device).device.type == device

        def test_rank_runner(rank_runner):
            assert rank_runner is not run_ranks
            rank_runner(print, 1024, backend="nccl")  # not enough GPUs: skips
        """)
    threads = torch.get_num_threads()
    result = pytester.runpytest("-p", "lp_testing.plugin", "-rs")
    gpu = GPUS > 0
    result.assert_outcomes(passed=4 + gpu, skipped=2 - gpu)
    result.stdout.fnmatch_lines(["SKIPPED*needs one CUDA GPU per rank: 1024 ranks*"])
    assert torch.get_num_threads() == threads


def test_preserved_torch_globals_restores_only_changes() -> None:
    def snapshot() -> tuple[object, ...]:
        new_api = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        return (
            torch.get_float32_matmul_precision(),
            new_api,
            torch.get_default_dtype(),
            torch.get_num_threads(),
            torch.backends.cudnn.benchmark,
        )

    before = snapshot()
    with preserved_torch_globals():
        torch.set_float32_matmul_precision("high")
        if hasattr(torch.backends, "fp32_precision"):
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    assert snapshot() == before


def test_package_exports_submodules_all_without_importing_torch() -> None:
    """``import lp_testing`` (the plugin's parent package) imports no torch; every name in a
    submodule's ``__all__`` is exported, on first use, as that submodule's object."""
    import importlib
    import subprocess
    import sys

    code = "import sys, lp_testing; print('torch' in sys.modules, len(lp_testing.__all__))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    import lp_testing

    assert out == ["False", str(len(lp_testing.__all__))]
    expected: set[str] = set()
    for module in ("compare", "dist", "megatron_cpu", "problems", "reference", "state", "trainers"):
        mod = importlib.import_module(f"lp_testing.{module}")
        expected.update(mod.__all__)
        for name in mod.__all__:
            assert getattr(lp_testing, name) is getattr(mod, name), name
    assert sorted(expected) == lp_testing.__all__
    assert set(lp_testing.__all__) <= set(dir(lp_testing))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lp_testing.nope  # noqa: B018
