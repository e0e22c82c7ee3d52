"""Nox sessions for lp.

    cpu     (default, what CI runs)  install the workspace from uv.lock, run the CPU tests
    gpu-tp  the GPU and multi-GPU tests; also runs offline against an installed env (--no-venv)
    lint    ruff check + black --check
    bench   the main-job command (`lp bench`)

Each session gets its own uv virtualenv under .nox/ and installs the workspace into it with
`uv sync --locked`, so the tests run exactly what uv.lock pins.

With `--no-venv` (nox's alias for `--force-venv-backend none`) nox runs commands in the
environment it was started from. There, `session.install` raises and `session.run_install`
would still run `uv sync` against that environment, so every session checks
`session.venv_backend == "none"` first: it installs nothing and runs the workspace from
source via PYTHONPATH, with the interpreter nox itself runs on (sys.executable). That is how
a GPU machine with its own torch and triton and no network runs the GPU tests:
`python3 -m nox -s gpu-tp --no-venv`. Without nox, the same thing is:

    PYTHONPATH=$(printf '%s:' packages/*/src) \\
        python3 -m pytest -p lp_testing.plugin -m "gpu or multigpu"
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.10.9"
nox.options.sessions = ["cpu"]
nox.options.default_venv_backend = "uv"
# A session whose interpreter is missing must fail, not be skipped (a skip exits 0).
nox.options.error_on_missing_interpreters = True

PYTHON = "3.12"
ROOT = Path(__file__).parent
SRC_DIRS = [
    ROOT / "packages" / pkg / "src"
    for pkg in ("lp-kernels", "lp-testing", "lp-megatron", "lp-hf", "lp-bench")
]
CPU_TESTS = "not gpu and not multigpu"
GPU_TESTS = "gpu or multigpu"
GPU_CHECK = (
    "import sys, torch; n = torch.cuda.device_count(); print(f'torch sees {n} CUDA device(s)');"
    "sys.exit(0 if n else 'gpu-tp needs a CUDA GPU')"
)


def _no_venv(session: nox.Session) -> bool:
    """True under `--no-venv` / `--force-venv-backend none`: use the current environment."""
    return session.venv_backend == "none"


def _uv_sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into this session's venv; a no-op under --no-venv."""
    if _no_venv(session):
        session.log("--no-venv: installing nothing, using the current environment")
        return
    session.run_install(
        "uv",
        "sync",
        "--locked",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _python(session: nox.Session) -> str:
    """The session's interpreter: the venv's, or under --no-venv the one running nox."""
    return sys.executable if _no_venv(session) else "python"


def _source_env() -> dict[str, str]:
    """PYTHONPATH that imports the workspace packages from source (used under --no-venv)."""
    paths = [*map(str, SRC_DIRS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _pytest(session: nox.Session, marker: str) -> None:
    """Run pytest on the `marker` selection; exit code 5 (no tests collected) fails."""
    env = {"OMP_NUM_THREADS": "1"}  # fork after a threaded torch op hangs in OpenMP otherwise
    if not _no_venv(session):
        session.run("pytest", "-m", marker, *session.posargs, env=env)
        return
    # Load the plugin by module name, unless lp-testing is installed: then its pytest11
    # entry point loads it, and a second `-p lp_testing.plugin` makes pytest refuse to start.
    installed = session.run(
        _python(session),
        "-c",
        "from importlib.metadata import entry_points as e;"
        "print(any(p.name == 'lp_testing' for p in e(group='pytest11')))",
        silent=True,
    )
    plugin = [] if str(installed).strip().endswith("True") else ["-p", "lp_testing.plugin"]
    env |= _source_env()
    session.run(_python(session), "-m", "pytest", *plugin, "-m", marker, *session.posargs, env=env)


@nox.session(python=PYTHON)
def cpu(session: nox.Session) -> None:
    """CPU tests (torch backend, Triton interpreter, gloo ranks). What CI runs."""
    _uv_sync(session, "--all-packages")
    _pytest(session, CPU_TESTS)


@nox.session(name="gpu-tp", python=PYTHON)
def gpu_tp(session: nox.Session) -> None:
    """GPU and multi-GPU (NCCL tensor-parallel) tests. Offline: `nox -s gpu-tp --no-venv`."""
    _uv_sync(session, "--all-packages")
    # Without a visible GPU every test would skip and the session would pass: refuse instead.
    session.log("checking that torch sees a CUDA GPU")
    session.run(_python(session), "-c", GPU_CHECK, log=False)
    _pytest(session, GPU_TESTS)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and black --check over the whole repository."""
    _uv_sync(session, "--only-group", "dev")  # ruff and black at their locked versions
    session.run("ruff", "check", ".")
    session.run("black", "--check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The main-job command, `lp bench`; extra arguments go to it (`nox -s bench -- --reps 1`)."""
    _uv_sync(session, "--all-packages")
    if _no_venv(session):
        lp, env = [_python(session), "-m", "lp_bench.cli"], _source_env()
    else:
        lp, env = ["lp"], {}
    session.run(*lp, "bench", *session.posargs, env=env)
