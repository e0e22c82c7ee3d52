"""lp-kernels test configuration.

Without a GPU the Triton backend runs in Triton's CPU interpreter. The interpreter
is chosen by ``TRITON_INTERPRET=1``, which ``@triton.jit`` reads when a kernel module
is imported, so it is set here, before any test imports ``lp_kernels`` kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both backends; triton on CPU tensors runs only under the interpreter."""
    device = request.getfixturevalue("device") if "device" in request.fixturenames else "cpu"
    if request.param == "triton":
        if device == "cpu" and not _interpreting():
            pytest.skip("triton on CPU needs TRITON_INTERPRET=1 (set when no GPU is present)")
        if device == "cuda" and _interpreting():
            pytest.skip("TRITON_INTERPRET=1 is set: the CUDA triton path is not compiled")
    return request.param


# Hypothesis profiles: "ci" (default) is bounded and derandomized so CI is reproducible;
# LP_HYPOTHESIS_PROFILE=long explores more (a GPU host or a nightly job).
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a dev dependency; the property tests skip without it
    pass
else:
    settings.register_profile(
        "ci",
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("long", max_examples=400, deadline=None)
    settings.register_profile(  # the GPU run of the device tool (a few minutes)
        "gpu",
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile(os.environ.get("LP_HYPOTHESIS_PROFILE", "ci"))
