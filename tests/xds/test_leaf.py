"""``xds`` is a leaf: the .proto files, their generated modules and the generator, importing nothing else of the
project (not ``ztunnel``, ``bench`` or ``tests``), so the protocol definitions can be used, built and checked on
their own and every other package may depend on them without a cycle.

Checked twice: statically (every import statement of every module under ``xds/``, lazy ones included), and by
importing every module of ``xds`` in a fresh interpreter in which the rest of the project cannot be imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("ztunnel", "bench", "tests")  # the project's other top-level packages

# Imports every module of the package named in argv[1] (found under the directory argv[2]) with the project's other
# packages made unimportable; prints one "module: error" line per module that fails.
_IMPORT_ALL = """
import importlib, importlib.abc, pkgutil, sys

BLOCKED = set(sys.argv[3].split(","))

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked: the leaf package must not import it", name=name)
        return None

sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[2])
package = importlib.import_module(sys.argv[1])
failed = 0
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except Exception as e:
        failed += 1
        print(f"{info.name}: {type(e).__name__}: {e}")
sys.exit(1 if failed else 0)
"""


def project_imports(package_dir: Path, blocked: tuple[str, ...] = PROJECT) -> list[str]:
    """``file:line: module`` for every absolute import under ``package_dir`` of a package in ``blocked``."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in sorted(
            (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)), key=lambda n: n.lineno
        ):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(package_dir.parent)}:{node.lineno}"
            found += [f"{where}: {name}" for name in names if name.partition(".")[0] in blocked]
    return found


def import_all_blocked(
    package: str, where: Path, blocked: tuple[str, ...] = PROJECT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, package, str(where), ",".join(blocked)],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_xds_source_imports_nothing_of_the_project() -> None:
    assert project_imports(ROOT / "xds") == []


def test_every_xds_module_imports_with_the_rest_of_the_project_blocked() -> None:
    result = import_all_blocked("xds", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    # The walk reached the generated modules (an empty walk would pass vacuously).
    listed = subprocess.run(
        [sys.executable, "-c", "import pkgutil, xds; print(len(list(pkgutil.walk_packages(xds.__path__, 'xds.'))))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(listed.stdout) >= 8  # the eight *_pb2 / *_pb2_grpc modules at least


def test_both_checks_catch_a_project_import(tmp_path: Path) -> None:
    leaf = tmp_path / "leafpkg"
    (leaf / "sub").mkdir(parents=True)
    (leaf / "__init__.py").write_text("")
    (leaf / "sub" / "__init__.py").write_text("")
    (leaf / "sub" / "mod.py").write_text(
        textwrap.dedent(
            """
            def lazy():
                from ztunnel.config import from_env
                return from_env
            import ztunnel.tasks
            """
        )
    )
    assert project_imports(leaf) == ["leafpkg/sub/mod.py:3: ztunnel.config", "leafpkg/sub/mod.py:5: ztunnel.tasks"]
    result = import_all_blocked("leafpkg", tmp_path)
    assert result.returncode == 1 and "leafpkg.sub.mod: ModuleNotFoundError: ztunnel is blocked" in result.stdout
