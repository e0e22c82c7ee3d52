"""Importing a trainer (TRL, SkyRL, verl, OpenRLHF) in an adapter test.

The trainers are optional: the workspace's own venv does not install them, and the CPU
session skips their adapter tests. The ``adapters`` nox session installs them and sets
:data:`REQUIRED_ENV` to 1, so that there a missing or broken trainer fails the test
instead of skipping it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["REQUIRED_ENV", "import_trainer"]

REQUIRED_ENV = "LP_TRAINERS_REQUIRED"
"""Environment variable: ``1`` makes :func:`import_trainer` raise instead of skipping."""


def import_trainer(name: str) -> ModuleType:
    """Import module ``name`` of a trainer, or skip the calling test when it is missing.

    With ``LP_TRAINERS_REQUIRED=1`` the import error propagates (the test fails).

    Example:
        >>> trl = import_trainer("trl")  # doctest: +SKIP
    """
    if os.environ.get(REQUIRED_ENV) == "1":
        return importlib.import_module(name)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"{name} is not installed ({exc}); the adapters nox session installs it")
