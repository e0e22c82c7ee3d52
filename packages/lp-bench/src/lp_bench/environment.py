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


CARD_QUERY = ("clocks.max.sm", "clocks.sm", "power.limit", "power.max_limit", "driver_version")
"""``nvidia-smi --query-gpu`` fields of :func:`card` (SM clocks in MHz, power in W)."""


def card(index: int | None = None) -> dict:
    """The CUDA card a run used: name, compute capability, SMs, memory, and from
    ``nvidia-smi`` (None where it is missing) its SM clocks and power limits, so that figures
    from different cards (or one card under other limits) are never mixed."""
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    out = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }
    try:
        text = subprocess.run(
            [
                "nvidia-smi",
                f"--id={index}",
                f"--query-gpu={','.join(CARD_QUERY)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        values = [v.strip() for v in text.splitlines()[0].split(",")]
    except (OSError, subprocess.SubprocessError, IndexError):
        values = [None] * len(CARD_QUERY)
    out.update(zip(CARD_QUERY, values, strict=False))
    return out


def card_line(env: dict) -> str | None:
    """One line naming a record's card and its limits (``env["card"]``), or None."""
    c = env.get("card")
    if not c:
        return None
    clock = c.get("clocks.max.sm")
    power = c.get("power.limit")
    return (
        f"{c['name']} (sm_{c['capability'].replace('.', '')}, {c['sms']} SMs, "
        f"{c['memory_gib']} GiB; max SM clock {clock or '?'} MHz, power limit "
        f"{power or '?'} W, driver {c.get('driver_version') or '?'})"
    )


def environment(device: str = "cuda", commit: str | None = None) -> dict:
    """The header of a results file: device, versions, commit, UTC date."""
    cuda = device == "cuda"
    return {
        "device": device,
        "device_name": device_name(device),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "card": card() if cuda else None,
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
