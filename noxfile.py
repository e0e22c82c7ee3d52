"""Nox sessions for lp.

    cpu           (default, what CI runs)  install the workspace from uv.lock, run the CPU tests
    adapters      the trainer adapter tests (lp_hf.trl ...) with the trainers installed
    compat        a fast CPU subset on every supported Python (compat-3.10 ... compat-3.13)
    compat-floor  the same subset on Python 3.10 with the lowest torch/triton lp declares
    wheels        build every package (wheel + sdist), check them, install each alone, import it
    gpu-tp        the GPU and multi-GPU tests; also offline against an installed env (--no-venv)
    lint          ruff check + black --check
    bench         the main-job command (`lp bench`)

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
import shutil
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.10.9"
nox.options.sessions = ["cpu"]
nox.options.default_venv_backend = "uv"
# A session whose interpreter is missing must fail, not be skipped (a skip exits 0).
nox.options.error_on_missing_interpreters = True

PYTHON = "3.12"
# Every Python lp supports; pyenv provides them here (.python-version lists them, 3.12 first).
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# The lowest torch lp-kernels declares (pyproject: torch>=2.10) and the triton it pins.
# triton.tools.tensor_descriptor, which the Triton backend imports, arrived in triton 3.4, but
# the interpreters of 3.4 and 3.5 reject the descriptors of lp's unaligned test shapes
# ("stride must be 16-byte aligned"); 3.6 passes.
TORCH_FLOOR, TRITON_FLOOR = "2.10.0", "3.6.0"
ROOT = Path(__file__).parent
# Every workspace member, found by globbing: a new packages/* member is built and checked too.
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
SRC_DIRS = [package / "src" for package in PACKAGES]
KERNEL_TESTS = "packages/lp-kernels/tests"
# The compat subset (~2-4 min per Python on 2 cores): both backends (the Triton one in the
# interpreter at small sizes), argument errors, the fused loss and its ready-made losses,
# autocast and torch.compile glue (inductor
# included), two gloo tensor-parallel runs, lp-testing's own tests and one Megatron TP=2 parity
# test (megatron-core 0.16.1 on 3.10/3.11, 0.19.x on 3.12+).
COMPAT_TESTS = [
    f"{KERNEL_TESTS}/test_linear_parity.py",
    f"{KERNEL_TESTS}/test_errors.py",
    f"{KERNEL_TESTS}/test_vocab_parallel_logprob.py",
    f"{KERNEL_TESTS}/test_amp.py",
    f"{KERNEL_TESTS}/test_compile.py",
    # the Gluon kernel compiles for sm_90 with each Triton (its API moves between releases)
    f"{KERNEL_TESTS}/test_pingpong.py::test_pingpong_kernel_compiles_for_sm90",
    f"{KERNEL_TESTS}/test_losses.py",
    f"{KERNEL_TESTS}/test_linear_logprob_loss.py::test_matches_linear_logprob_composed",
    f"{KERNEL_TESTS}/test_linear_logprob_loss.py::test_errors",
    f"{KERNEL_TESTS}/test_tensor_parallel.py::test_linear_logprob_tp_matches_single_process[2-torch]",
    f"{KERNEL_TESTS}/test_tensor_parallel.py::test_linear_logprob_tp_matches_single_process[3-triton]",
    "packages/lp-testing/tests",
    "packages/lp-megatron/tests/test_megatron_head.py::test_parity_with_stock_logits[tp2]",
]
# Trainers of the adapter tests: wheels installed with `uv pip install --no-deps` over the locked
# workspace (their own dependency trees are heavy or GPU-only; the tests need only these).
TRAINER_WHEELS = {
    "trl": [
        "trl==1.16.0",
        "accelerate==1.16.0",
        "datasets==5.2.0",
        "dill==0.4.1",
        "multiprocess==0.70.19",
        "pandas==3.1.1",
        "psutil==7.2.2",
        "pyarrow==26.0.1",
        "xxhash==4.1.0",
    ],
    "openrlhf": ["openrlhf==0.11.2", "pylatexenc==2.10"],
    "skyrl-train": [
        "skyrl-train==0.3.1",
        "loguru==0.8.0",
        "jaxtyping==0.3.11",
        "wadler-lindig==0.1.8",
        "omegaconf==2.3.0",
        "antlr4-python3-runtime==4.9.3",
    ],
    # SkyRL's Megatron fused LM-head seam is in skyrl 0.4 (skyrl-train 0.3 has none); the two
    # share no top-level package
    "skyrl": ["skyrl==0.4.0", "cloudpathlib==0.26.0"],
    # verl imports omegaconf 2.3 and antlr4 too (pinned with skyrl-train above)
    "verl": [
        "verl==0.9.1",
        "tensordict==0.15.3",
        "pyvers==0.2.3",
        "cloudpickle==3.1.3",
        "codetiming==1.4.0",
        "orjson==3.13.0",
    ],
}
# The adapter tests: they skip where their trainer is missing (the cpu session), and fail
# there under LP_TRAINERS_REQUIRED=1 (the adapters session; lp_testing.trainers reads it).
ADAPTER_TESTS = [
    "packages/lp-hf/tests/test_trl.py",
    "packages/lp-hf/tests/test_trl_distill.py",
    "packages/lp-hf/tests/test_trl_fused_loss.py",
    "packages/lp-hf/tests/test_openrlhf.py",
    "packages/lp-hf/tests/test_openrlhf_fused_loss.py",
    "packages/lp-hf/tests/test_skyrl.py",
    "packages/lp-hf/tests/test_skyrl_fused_loss.py",
    "packages/lp-hf/tests/test_verl.py",
    "packages/lp-hf/tests/test_verl_fused_loss.py",
    "packages/lp-megatron/tests/test_megatron_skyrl.py",
    "packages/lp-megatron/tests/test_megatron_verl.py",
    "packages/lp-bench/tests/test_trl_provider.py",
]
TRAINERS_REQUIRED = {"LP_TRAINERS_REQUIRED": "1"}
VERSIONS = (
    "import sys, torch, triton; print(f'python {sys.version.split()[0]}, torch {torch.__version__},"
    " triton {triton.__version__}')"
)
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
        # The venv's own interpreter: without it uv would replace a 3.10 venv with the
        # .python-version default (3.12).
        "--python",
        _venv_python(session),
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _venv_python(session: nox.Session) -> str:
    return str(Path(session.virtualenv.bin) / "python")


def _needs_venv(session: nox.Session) -> None:
    if _no_venv(session):
        session.error(f"{session.name} installs into its own venvs: run it without --no-venv")


def _python(session: nox.Session) -> str:
    """The session's interpreter: the venv's, or under --no-venv the one running nox."""
    return sys.executable if _no_venv(session) else "python"


def _source_env() -> dict[str, str]:
    """PYTHONPATH that imports the workspace packages from source (used under --no-venv)."""
    paths = [*map(str, SRC_DIRS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _pytest(
    session: nox.Session, marker: str, *paths: str, env: dict[str, str] | None = None
) -> None:
    """Run pytest on the `marker` selection (of `paths`, default the configured testpaths),
    with `env` added; exit code 5 (no tests collected) fails."""
    # fork after a threaded torch op hangs in OpenMP otherwise
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if not _no_venv(session):
        session.run("pytest", "-m", marker, *paths, *session.posargs, env=env)
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
    session.run(
        _python(session), "-m", "pytest", *plugin, "-m", marker, *paths, *session.posargs, env=env
    )


@nox.session(python=PYTHON)
def cpu(session: nox.Session) -> None:
    """CPU tests (torch backend, Triton interpreter, gloo ranks). What CI runs."""
    _uv_sync(session, "--all-packages")
    _pytest(session, CPU_TESTS)


@nox.session(python=PYTHON)
def adapters(session: nox.Session) -> None:
    """The trainer adapter tests, with the trainers of TRAINER_WHEELS installed: a missing or
    broken trainer fails them instead of skipping."""
    _needs_venv(session)
    _uv_sync(session, "--all-packages")
    wheels = [pin for pins in TRAINER_WHEELS.values() for pin in pins]
    session.run_install(
        "uv", "pip", "install", "--python", _venv_python(session), "--no-deps", *wheels
    )
    _pytest(session, CPU_TESTS, *ADAPTER_TESTS, env=TRAINERS_REQUIRED)


@nox.session(python=PYTHONS)
def compat(session: nox.Session) -> None:
    """A fast CPU subset of the tests on each supported Python, installed from uv.lock."""
    _needs_venv(session)
    _uv_sync(session, "--all-packages")
    session.run("python", "-c", VERSIONS)
    _pytest(session, CPU_TESTS, *COMPAT_TESTS)


@nox.session(name="compat-floor", python=PYTHONS[0])
def compat_floor(session: nox.Session) -> None:
    """The compat subset on the oldest Python with the lowest declared torch and its triton."""
    _needs_venv(session)
    _uv_sync(session, "--all-packages")
    # PyPI's torch wheel pins its triton (2.10.0 -> 3.6.0) and its CUDA 12 libraries.
    session.run_install(
        "uv",
        "pip",
        "install",
        "--python",
        _venv_python(session),
        f"torch=={TORCH_FLOOR}",
        f"triton=={TRITON_FLOOR}",
    )
    check = (
        f"import torch, triton; assert torch.__version__.split('+')[0] == {TORCH_FLOOR!r}, "
        f"torch.__version__; assert triton.__version__ == {TRITON_FLOOR!r}, triton.__version__"
    )
    session.run("python", "-c", check)
    session.run("python", "-c", VERSIONS)
    _pytest(session, CPU_TESTS, *COMPAT_TESTS)


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Build every package's wheel and sdist, check them, install each wheel alone, import it;
    then, as a new TRL user would, `lp-hf[trl]` from the wheels and examples/trl_grpo.py.

    Each wheel goes into a fresh `uv venv`, its dependencies resolved from the wheels just
    built (`--find-links`) and PyPI, constrained to uv.lock's versions so that uv's cache
    serves torch. lp-kernels must import, and compute, with torch alone."""
    _needs_venv(session)
    _uv_sync(session, "--only-group", "dev")  # packaging and trove-classifiers for the checks
    tmp = Path(session.create_tmp())
    dist, venvs = tmp / "dist", tmp / "venvs"
    for path in (dist, venvs):
        shutil.rmtree(path, ignore_errors=True)
    for package in PACKAGES:
        # sdist first, then the wheel from the sdist: proves the sdist is complete.
        session.run("uv", "build", "--out-dir", str(dist), str(package), external=True)
    session.run("python", str(ROOT / ".ci" / "check_dists.py"), str(dist))
    constraints = tmp / "constraints.txt"
    session.run(
        "uv",
        "export",
        "--locked",
        "--all-packages",
        "--no-emit-workspace",
        "--no-default-groups",
        "--no-hashes",
        "--no-header",
        "--quiet",
        "--output-file",
        str(constraints),
        external=True,
    )
    wheel_files = sorted(dist.glob("*.whl"))
    if len(wheel_files) != len(PACKAGES):
        session.error(f"{len(PACKAGES)} packages but {len(wheel_files)} wheels in {dist}")

    def fresh_venv(name: str, requirement: str) -> str:
        """A new venv with ``requirement`` resolved from the built wheels and PyPI (pinned
        to uv.lock's versions); its python."""
        venv = venvs / name
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(venv), external=True)
        python = str(venv / "bin" / "python")
        session.run(
            *("uv", "pip", "install", "--python", python, "--find-links", str(dist)),
            *("--constraints", str(constraints), requirement),
            # uv caches a --find-links wheel by its path, and the dist folder's path is the
            # same on every run: without a refresh an older build of a package is installed
            *(arg for package in PACKAGES for arg in ("--refresh-package", package.name)),
            external=True,
        )
        return python

    for wheel in wheel_files:
        python = fresh_venv(wheel.name.split("-")[0], str(wheel))
        # PYTHONPATH unset: only what the wheel installed may be imported.
        session.run(
            python,
            str(ROOT / ".ci" / "import_wheel.py"),
            str(wheel),
            external=True,
            env={"PYTHONPATH": ""},
        )
    # A new user of a trainer adapter: the built wheels with lp-hf's trl extra in a fresh venv,
    # then the example that trains with TRL's GRPOTrainer and `lp_hf.trl.use_lp(trainer)`.
    hf_wheel = next(w for w in wheel_files if w.name.startswith("lp_hf-"))
    python = fresh_venv("trl-user", f"lp-hf[trl] @ {hf_wheel.resolve().as_uri()}")
    session.run(
        python,
        str(ROOT / "examples" / "trl_grpo.py"),
        external=True,
        env={"PYTHONPATH": "", "OMP_NUM_THREADS": "1"},
    )


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
