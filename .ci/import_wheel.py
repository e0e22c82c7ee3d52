"""Import every module of an installed wheel, in the venv it was installed into alone.

    VENV/bin/python .ci/import_wheel.py path/to/NAME-VERSION-*.whl

Checks that the installed distribution is that wheel's version, that each of its modules
imports and comes from the venv (not a source tree), and for lp-kernels that it works with
torch alone: the optional or test-only packages are not importable, and a small
``linear_logprob`` forward and backward on CPU matches ``log_softmax``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import zipfile
from pathlib import Path

# Not dependencies of lp-kernels: it must not need them (rich and matplotlib are optional
# extras of the `lp` command; the rest belong to the other packages or the tests).
NOT_WITH_LP_KERNELS = (
    "rich",
    "matplotlib",
    "lp_testing",
    "lp_megatron",
    "megatron",
    "pytest",
    "hypothesis",
)


def modules_of(wheel: Path) -> list[str]:
    """Dotted names of the wheel's Python modules (packages by their ``__init__``)."""
    names = []
    with zipfile.ZipFile(wheel) as zf:
        for path in zf.namelist():
            parts = path.split("/")
            if not path.endswith(".py") or ".dist-info" in parts[0] or ".data" in parts[0]:
                continue
            parts[-1] = parts[-1][: -len(".py")]
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return sorted(names)


def check_torch_only() -> None:
    present = [m for m in NOT_WITH_LP_KERNELS if importlib.util.find_spec(m) is not None]
    if present:
        raise SystemExit(f"lp-kernels installed alone, yet these import: {present}")
    import torch
    import torch.nn.functional as F

    from lp_kernels import linear_logprob

    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    out = linear_logprob(hidden, weight, targets, backend="torch")
    out.logprob.sum().backward()
    got = (out.logprob.detach(), hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    ref = F.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None])[:, 0]
    ref.sum().backward()
    want = (ref.detach(), hidden.grad, weight.grad)
    for name, a, b in zip(("logprob", "grad_hidden", "grad_weight"), got, want, strict=True):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"lp-kernels with torch alone: {name} differs from log_softmax")
    absent = ", ".join(NOT_WITH_LP_KERNELS)
    print(f"lp-kernels computes with torch {torch.__version__} alone (none of {absent})")


def main(argv: list[str]) -> int:
    wheel = Path(argv[0])
    dist_name, version = wheel.name.split("-")[:2]
    installed = importlib.metadata.version(dist_name)
    if installed != version:
        raise SystemExit(f"{dist_name} {installed} is installed, not the wheel's {version}")
    prefix = Path(sys.prefix).resolve()
    modules = modules_of(wheel)
    for name in modules:
        module = importlib.import_module(name)
        origin = Path(module.__file__ or "").resolve()
        if prefix not in origin.parents:
            raise SystemExit(f"{name} was imported from {origin}, outside the venv {prefix}")
    print(f"{dist_name} {version}: imported {len(modules)} modules: {', '.join(modules)}")
    if dist_name == "lp_kernels":
        check_torch_only()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
