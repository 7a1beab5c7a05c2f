"""Reading and trying the project's imports: every import statement of a source tree (statically), and importing
every module of a package in a fresh interpreter in which some modules cannot be imported.

Used by tests/xds/test_leaf.py, tests/test_package_graph.py, tests/test_packaging.py, tests/proxy/test_imports.py
and tests/test_docs.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

# argv: a comma-separated list of packages, the directory to import them from, a comma-separated list of blocked
# modules (each with everything below it). The development install's editable finder is removed, so a module that
# is not under the directory is not found elsewhere in the checkout. Prints one "module: error" line per module
# that fails to import, and "file: ..." lines naming where each package came from.
_IMPORT_ALL = """
import importlib, importlib.abc, pkgutil, sys

packages, where, blocked = sys.argv[1].split(","), sys.argv[2], [b for b in sys.argv[3].split(",") if b]

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ModuleNotFoundError(f"{name} is blocked here", name=name)
        return None

sys.meta_path[:] = [Blocker()] + [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
sys.path.insert(0, where)
failed = 0
for name in packages:
    package = importlib.import_module(name)
    print(f"file: {name} {package.__file__}")
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failed += 1
            print(f"{info.name}: {type(e).__name__}: {e}")
        else:
            print(f"imported: {info.name}")
sys.exit(1 if failed else 0)
"""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path, known: Collection[str] = ()) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``path`` (a module under ``root``), lazy and
    ``TYPE_CHECKING`` ones included, in line order; relative imports are resolved against the module's package.

    With ``known`` (module names), ``from pkg import name`` is ``pkg.name`` when that is a known module (a submodule
    imported from its package), else ``pkg``."""
    module = module_name(path, root)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)), key=lambda n: n.lineno)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
            continue
        if node.level:
            base = ".".join([*package[: len(package) - (node.level - 1)], *([node.module] if node.module else [])])
        elif node.module:
            base = node.module
        else:
            continue
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        yield from ((node.lineno, sub) for sub in subs)
        if len(subs) < len(node.names):
            yield node.lineno, base


def modules(root: Path, package: str) -> dict[str, Path]:
    """{module name: file} for every module of ``package`` under ``root``."""
    return {module_name(p, root): p for p in sorted((root / package.replace(".", "/")).rglob("*.py"))}


def graph(root: Path, package: str, prefix: str | None = None) -> dict[str, set[str]]:
    """The import graph of ``package``'s modules (those within ``prefix``, default all): each module's imports of
    other modules of the package, submodules resolved."""
    known = modules(root, package)
    return {
        name: {dep for _, dep in imports(path, root, known) if dep in known and dep != name}
        for name, path in known.items()
        if within(name, prefix or package)
    }


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def within(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or below it."""
    return name == prefix or name.startswith(prefix + ".")


def import_all(packages: Sequence[str], where: Path, blocked: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Import every module of ``packages`` from the directory ``where`` in a fresh interpreter in which ``blocked``
    modules (and everything below them) cannot be imported. Exit status 1 when any module failed; stdout has one
    ``module: error`` line per failure, ``imported: module`` per success and ``file: package path`` per package."""
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, ",".join(packages), str(where), ",".join(blocked)],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
