"""What the platform offers the backends: whether triton is installed, and whether it runs its
CPU interpreter (the one place lp reads ``TRITON_INTERPRET``)."""

from __future__ import annotations

import importlib.util
import os


def triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    """Whether the triton package is installed (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None
