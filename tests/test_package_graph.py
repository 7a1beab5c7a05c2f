"""The import graph between the project's top-level packages, and around the stand-ins inside ``ztunnel``.

Top level, each package may import only the ones before it: ``xds`` (protos, a leaf) <- ``ztunnel`` <- ``bench`` <-
``tests``; so there is no cycle and each can be understood (and shipped: the wheel holds ``ztunnel`` and ``xds``)
without the ones after it.

Inside ``ztunnel``, the proxy never imports what only tests, the demo and the benchmark need: the stand-ins for istiod
and istio-cni (``ztunnel.standins``), the test toolkit (``ztunnel.testing``) and the demo. The stand-ins themselves
are built on the proxy's own modules (config, identity, state, the ZDS codec) and never on the test toolkit, which
uses them. The runtime image leaves these out (tests/test_packaging.py checks that it does).

Every import statement counts, also the lazy ones inside functions and the ``TYPE_CHECKING`` ones: each is a
dependency a reader has to follow.
"""

from __future__ import annotations

from pathlib import Path

from tests.importcheck import cycles, graph, imports, module_name, within

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("xds", "ztunnel", "bench", "tests")
# Inside ztunnel: what only tests, the demo and the benchmark use. A key may import the modules in its value.
NOT_FOR_THE_PROXY = ("ztunnel.standins", "ztunnel.testing", "ztunnel.demo")
MAY_IMPORT = {
    "ztunnel.standins": ("ztunnel.standins",),
    "ztunnel.testing": ("ztunnel.standins", "ztunnel.testing"),
    "ztunnel.demo": ("ztunnel.standins", "ztunnel.testing"),
}


def upward_imports(root: Path, order: tuple[str, ...] = ORDER) -> list[str]:
    """``file:line: a -> b`` for every import of a top-level package that comes later in ``order``."""
    found = []
    for rank, package in enumerate(order):
        later = order[rank + 1 :]
        for path in sorted((root / package).rglob("*.py")):
            for line, name in imports(path, root):
                target = name.partition(".")[0]
                if target in later:
                    found.append(f"{path.relative_to(root)}:{line}: {package} -> {target}")
    return found


def proxy_imports_of_standins(root: Path) -> list[str]:
    """``file:line: importer -> imported`` for every import in ``ztunnel`` that breaks the rules above."""
    found = []
    for path in sorted((root / "ztunnel").rglob("*.py")):
        importer = module_name(path, root)
        home = next((p for p in NOT_FOR_THE_PROXY if within(importer, p)), None)
        allowed = MAY_IMPORT[home] if home else ()
        for line, name in imports(path, root):
            target = next((p for p in NOT_FOR_THE_PROXY if within(name, p)), None)
            if target is not None and target not in allowed:
                found.append(f"{path.relative_to(root)}:{line}: {importer} -> {name}")
    return found


def test_top_level_packages_import_only_earlier_ones() -> None:
    assert upward_imports(ROOT) == []


def test_the_proxy_does_not_import_the_standins_the_test_toolkit_or_the_demo() -> None:
    assert proxy_imports_of_standins(ROOT) == []


def test_no_import_cycle_anywhere_in_ztunnel() -> None:
    # Every module of the package, lazy and TYPE_CHECKING imports included (tests/proxy/test_imports.py holds the
    # proxy's finer rules; tests/test_docs.py the layers).
    g = graph(ROOT, "ztunnel")
    assert len(g) > 80 and "ztunnel.proxy.hbone.core" in g["ztunnel.proxy.hbone.connection"]
    assert cycles(g) == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    for name, text in {
        "xds/__init__.py": "",
        "xds/leaf.py": "def f():\n    import bench.runner\n",
        "ztunnel/__init__.py": "",
        "ztunnel/app.py": "from .testing import EchoServer\nfrom ztunnel.standins.istiod import server\n",
        "ztunnel/testing/__init__.py": "from ..demo import main\n",
        "ztunnel/standins/__init__.py": "from ztunnel.testing import netns\n",
        "ztunnel/standins/cni/server.py": "from ztunnel.standins.cni.rules import Rule\nfrom ..istiod import ca\n",
        "bench/__init__.py": "import tests.fuzzing\n",
        "tests/__init__.py": "import bench\nimport xds\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert upward_imports(tmp_path) == ["xds/leaf.py:2: xds -> bench", "bench/__init__.py:1: bench -> tests"]
    assert proxy_imports_of_standins(tmp_path) == [
        "ztunnel/app.py:1: ztunnel.app -> ztunnel.testing",
        "ztunnel/app.py:2: ztunnel.app -> ztunnel.standins.istiod",
        "ztunnel/standins/__init__.py:1: ztunnel.standins -> ztunnel.testing",
        "ztunnel/testing/__init__.py:1: ztunnel.testing -> ztunnel.demo",
    ]
