"""The repository's code-layout rules, checked on the source (ast only: nothing imported).

(a) No module imports another module's private (underscore) name, counting lp's own
    modules (``lp_*``) only, dunders exempt; a private *module* (``lp_kernels.core.stats``) is
    imported only from inside its own top-level package (its ``src`` or its tests).
(b) No import cycle among ``lp_kernels`` modules, function-level (lazy) imports included.
(c) Nothing in ``lp_kernels`` calls ``print``.

Packages are found by globbing ``packages/*/src`` and ``packages/*/tests``, so a new
package is covered as soon as it exists; ``benchmarks/`` and ``examples/`` too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SRC_ROOTS = sorted(ROOT.glob("packages/*/src"))
TEST_DIRS = sorted(ROOT.glob("packages/*/tests"))


# Files that leave lp-kernels for the lp-bench package (another branch moves them out):
# only files that still exist are skipped, so this is a no-op once they are gone.
@dataclass(frozen=True)
class Source:
    path: Path
    module: str | None
    """Dotted name for a file under a ``src`` root, else None (tests, scripts)."""
    owner: str | None
    """The top-level package whose source or tests this file belongs to (``lp_kernels``)."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(src_root: Path, path: Path) -> str:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[Source]:
    out = []
    for root in SRC_ROOTS:
        for path in sorted(root.rglob("*.py")):
            module = _module_name(root, path)
            out.append(Source(path, module, module.split(".")[0]))
    for tests in TEST_DIRS:
        owners = sorted(p.name for p in (tests.parent / "src").glob("lp_*") if p.is_dir())
        for path in sorted(tests.rglob("*.py")):
            out.append(Source(path, None, owners[0] if owners else None))
    for folder in ("benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            out.append(Source(path, None, None))
    return out


SOURCES = _sources()
MODULES = {s.module for s in SOURCES if s.module}


def _tree(source: Source) -> ast.Module:
    return ast.parse(source.path.read_text(), filename=str(source.path))


def _resolve(source: Source, node: ast.ImportFrom) -> str:
    """The absolute module of ``from X import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = (source.module or "").split(".")
    is_package = source.path.name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(source: Source):
    """``(module, name or None, node)`` for every import, at any depth of the file."""
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node, alias.asname
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(source, node)
            for alias in node.names:
                yield mod, alias.name, node, alias.asname


def _lp(module: str) -> bool:
    return module.split(".")[0].startswith("lp_")


def _private_module(module: str) -> bool:
    return any(_private(part) for part in module.split(".")[1:])


def _where(source: Source, node: ast.AST) -> str:
    return f"{source.path.relative_to(ROOT)}:{node.lineno}"


def test_no_private_names_across_modules():
    bad = []
    for source in SOURCES:
        aliases: dict[str, str] = {}  # local name -> lp module it names
        for module, name, node, asname in _imports(source):
            if not _lp(module):
                continue
            target = module if name is None else f"{module}.{name}"
            is_module = target in MODULES
            if name is not None and _private(name) and not is_module:
                bad.append(f"{_where(source, node)}: from {module} import {name}")
            mod = target if (name is None or is_module) else module
            if _private_module(mod) and source.owner != mod.split(".")[0]:
                bad.append(f"{_where(source, node)}: private module {mod} outside its package")
            if name is None:
                aliases[asname or module.split(".")[0]] = module if asname else module.split(".")[0]
            elif is_module:
                aliases[asname or name] = target
        for node in ast.walk(_tree(source)):  # x._y with x an imported lp module
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
            ):
                bad.append(f"{_where(source, node)}: {node.value.id}.{node.attr}")
            if isinstance(node, ast.Attribute) and _private(node.attr):  # x.y._z chains
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases and len(chain) > 1:
                    dotted = ".".join([aliases[value.id], *reversed(chain[1:])])
                    if dotted in MODULES and f"{dotted}.{node.attr}" not in MODULES:
                        bad.append(f"{_where(source, node)}: {dotted}.{node.attr}")
    assert not bad, "private names imported across modules:\n" + "\n".join(sorted(set(bad)))


def _graph() -> dict[str, set[str]]:
    """Import edges among lp_kernels modules (a ``from pkg import sub`` names ``pkg.sub``)."""
    edges: dict[str, set[str]] = {}
    for source in SOURCES:
        if not (source.module or "").startswith("lp_kernels"):
            continue
        deps = edges.setdefault(source.module, set())
        for module, name, _, _ in _imports(source):
            target = module if name is None else f"{module}.{name}"
            target = target if target in MODULES else module
            if target in MODULES and target.startswith("lp_kernels") and target != source.module:
                deps.add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_lp_kernels():
    edges = _graph()
    assert "lp_kernels.ops" in edges  # the scan found the package
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_check_sees_a_lazy_import():
    """The checker itself: a function-level import closes a cycle too."""
    edges = {"a": {"b"}, "b": {"a"}}
    assert _cycle(edges) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "source", [s for s in SOURCES if s.owner == "lp_kernels" and s.module], ids=lambda s: s.module
)
def test_lp_kernels_never_prints(source):
    calls = [
        _where(source, node)
        for node in ast.walk(_tree(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]
    assert not calls, calls


def test_no_package_init_shadows_a_module_it_uses_with_a_subpackage():
    """A subpackage named like a top-level module (``backends/torch``) binds that name in its
    parent package's namespace once imported, so code in the parent's ``__init__`` that uses
    the module (``torch.cuda``) would reach the subpackage instead: such an ``__init__``
    must import nothing of that name."""
    for init in sorted(ROOT.glob("packages/*/src/**/__init__.py")):
        subpackages = {p.parent.name for p in init.parent.glob("*/__init__.py")}
        tree = ast.parse(init.read_text())
        imported = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        clash = sorted(imported & subpackages)
        assert not clash, f"{init.relative_to(ROOT)} imports {clash}, also its subpackage names"


# ----------------------------------------------------------------------------- lp_kernels' shape

KERNELS = ROOT / "packages" / "lp-kernels" / "src" / "lp_kernels"
MAX_FUNCTION_LINES = 80
"""The most lines of code (its docstring, blank and comment lines aside) of a function in
lp_kernels that is not a ``@triton.jit`` / ``@gluon.jit`` kernel."""
MAX_SOFTCAP_FILES = 4
"""The files of lp_kernels that may name the softcap: the logit transform is one abstraction
(``core.transform`` on the host, ``backends.triton.softmax`` in the kernels)."""


def _is_kernel(node: ast.FunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _code_lines(path: Path, node: ast.FunctionDef) -> int:
    body = node.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(
        getattr(first, "value", None), ast.Constant
    )
    start = (
        (body[1].lineno if len(body) > 1 else node.end_lineno + 1) if docstring else first.lineno
    )
    lines = path.read_text().splitlines()[start - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_functions_are_short():
    """Host code is plain functions that read top to bottom: none longer than
    MAX_FUNCTION_LINES lines of code. Split a longer one into named steps."""
    long = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and not _is_kernel(node):
                n = _code_lines(path, node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "functions over the limit:\n" + "\n".join(long)


def test_function_length_counts_code_only(tmp_path):
    """The counter itself: the docstring, blank lines and comments do not count."""
    src = 'def f():\n    """doc\n\n    more"""\n    # note\n\n    a = 1\n    return a\n'
    path = tmp_path / "m.py"
    path.write_text(src)
    node = ast.parse(src).body[0]
    assert _code_lines(path, node) == 2 and not _is_kernel(node)


def test_softcap_lives_in_few_files():
    """A logit option is one abstraction, not a flag threaded through every kernel: the
    word is in at most MAX_SOFTCAP_FILES files of lp_kernels (the public ops, the host's
    transform, the kernels' transform helpers)."""
    files = sorted(
        str(p.relative_to(KERNELS)) for p in KERNELS.rglob("*.py") if "softcap" in p.read_text()
    )
    assert len(files) <= MAX_SOFTCAP_FILES, files


# Layers of lp_kernels, bottom to top; a module imports only from its own layer or below.
# The backends are siblings: neither imports the other (``backends.resolve`` chooses
# between them, and ``backends.platform`` is shared).
LAYERS = {"core": 0, "distributed": 1, "backends": 2}
TOP = 3


def _layer(module: str) -> tuple[int, str | None]:
    """``(layer, backend)`` of an lp_kernels module."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP, None
    backend = parts[2] if parts[1] == "backends" and len(parts) > 2 else None
    return LAYERS[parts[1]], backend if backend in ("torch", "triton") else None


def test_layers_import_downward():
    bad = []
    for module, deps in _graph().items():
        layer, backend = _layer(module)
        for dep in deps:
            dep_layer, dep_backend = _layer(dep)
            if dep_layer > layer:
                bad.append(f"{module} imports {dep} (a layer above it)")
            elif backend and dep_backend and backend != dep_backend:
                bad.append(f"{module} imports {dep} (another backend)")
    assert not bad, "\n".join(sorted(bad))


def test_layer_check_sees_upward_and_sibling_imports():
    assert _layer("lp_kernels.core.stats") == (0, None)
    assert _layer("lp_kernels.backends.triton.loss") == (2, "triton")
    assert _layer("lp_kernels.backends.resolve") == (2, None)
    assert _layer("lp_kernels.ops") == (TOP, None)
