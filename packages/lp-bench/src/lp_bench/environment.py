"""Where a run happened: device, versions, commit, date; and the one read of TRITON_INTERPRET."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version

import torch

PEER_DISTS = {"liger": "liger-kernel", "cce": "cut-cross-entropy", "trl": "trl"}
"""Peer provider -> its distribution (for the versions of a run)."""


def triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``): lp-bench's only read."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dist_version(dist: str) -> str | None:
    """Installed version of distribution ``dist``, or None."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """``$LP_COMMIT`` if set (a copied checkout whose git metadata is stale), else
    ``git rev-parse --short HEAD`` of the working directory, or None."""
    if os.environ.get("LP_COMMIT"):
        return os.environ["LP_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_name(device: str) -> str:
    """The GPU's name on ``cuda``, else the CPU's."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def environment(device: str = "cuda", commit: str | None = None) -> dict:
    """The header of a results file: device, versions, commit, UTC date."""
    cuda = device == "cuda"
    return {
        "device": device,
        "device_name": device_name(device),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": dist_version("triton"),
        "cuda": torch.version.cuda,
        "lp_kernels": dist_version("lp-kernels"),
        "lp_bench": dist_version("lp-bench"),
        "peers": {name: dist_version(dist) for name, dist in PEER_DISTS.items()},
        "python": platform.python_version(),
        "commit": commit or git_commit() or "unknown",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
