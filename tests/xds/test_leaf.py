"""``xds`` is a leaf: the .proto files, their generated modules and the generator, importing nothing else of the
project (not ``ztunnel``, ``bench`` or ``tests``), so the protocol definitions can be used, built and checked on
their own and every other package may depend on them without a cycle.

Checked twice: statically (every import statement of every module under ``xds/``, lazy ones included), and by
importing every module of ``xds`` in a fresh interpreter in which the rest of the project cannot be imported.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.importcheck import import_all, imports, within

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("ztunnel", "bench", "tests")  # the project's other top-level packages


def project_imports(package_dir: Path) -> list[str]:
    """``file:line: module`` for every import under ``package_dir`` of one of the project's other packages."""
    root = package_dir.parent
    return [
        f"{path.relative_to(root)}:{line}: {name}"
        for path in sorted(package_dir.rglob("*.py"))
        for line, name in imports(path, root)
        if any(within(name, p) for p in PROJECT)
    ]


def test_xds_source_imports_nothing_of_the_project() -> None:
    assert project_imports(ROOT / "xds") == []


def test_every_xds_module_imports_with_the_rest_of_the_project_blocked() -> None:
    result = import_all(["xds"], ROOT, PROJECT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"file: xds {ROOT / 'xds' / '__init__.py'}" in result.stdout
    # The walk reached the generated modules (an empty walk would pass vacuously).
    assert "imported: xds.istio.workload.workload_pb2" in result.stdout
    assert "imported: xds.istio.workload.zds.zds_pb2" in result.stdout


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
    result = import_all(["leafpkg"], tmp_path, PROJECT)
    assert result.returncode == 1 and "leafpkg.sub.mod: ModuleNotFoundError: ztunnel is blocked" in result.stdout
