"""Package boundaries: lp-kernels stands alone; lp_bench uses public names only, no cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
BENCH_SRC = PACKAGES / "lp-bench" / "src" / "lp_bench"
KERNELS_SRC = PACKAGES / "lp-kernels" / "src" / "lp_kernels"
NOT_IN_KERNELS = ("rich", "matplotlib", "lp_testing", "lp_bench", "lp_megatron", "pytest")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_lp_kernels_source_imports_no_bench_or_test_dependency():
    bad = [
        f"{path.relative_to(KERNELS_SRC)}: {module}"
        for path in KERNELS_SRC.rglob("*.py")
        for module, _ in _imports(path)
        if module.split(".")[0] in NOT_IN_KERNELS
    ]
    assert not bad, bad
    assert not (KERNELS_SRC / "bench.py").exists() and not (KERNELS_SRC / "cli.py").exists()


def test_lp_kernels_imports_and_runs_with_rich_matplotlib_lp_testing_blocked():
    """What a clean `pip install lp-kernels` (torch only) gets: import and one call work."""
    code = f"""
import sys
BLOCKED = {NOT_IN_KERNELS!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: not a dependency of lp-kernels")
sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
import torch
from lp_kernels import linear_logprob
h = torch.randn(3, 4, requires_grad=True)
out = linear_logprob(h, torch.randn(7, 4), torch.tensor([0, 6, 2]), backend="torch")
out.logprob.sum().backward()
print("ok", tuple(h.grad.shape))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok (3, 4)" in proc.stdout, proc.stderr[-3000:]


def test_lp_bench_uses_no_private_name_of_another_module():
    bad = []
    for path in BENCH_SRC.rglob("*.py"):
        for module, names in _imports(path):
            parts = module.split(".")
            if parts[0] == "lp_kernels" and (len(parts) > 1):
                bad.append(f"{path.name}: import of lp_kernels submodule {module}")
            if parts[0] in ("lp_bench", "lp_kernels", "lp_testing"):
                bad += [f"{path.name}: {module}.{n}" for n in names if n.startswith("_")]
                bad += [f"{path.name}: {module}" for p in parts if p.startswith("_")]
    assert not bad, bad


def test_lp_bench_has_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for path in BENCH_SRC.glob("*.py"):
        deps = set()
        for module, names in _imports(path):
            if module == "lp_bench":
                deps |= {n for n in names if (BENCH_SRC / f"{n}.py").exists()}
            elif module.startswith("lp_bench."):
                deps.add(module.split(".")[1])
        graph[path.stem] = deps - {path.stem}

    def visit(node: str, stack: list[str]) -> None:
        assert node not in stack, " -> ".join([*stack, node])
        for dep in graph.get(node, ()):
            visit(dep, [*stack, node])

    for node in graph:
        visit(node, [])
    assert graph["timing"] == set() and "cli" not in set().union(*graph.values())
