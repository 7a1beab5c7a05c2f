"""docs/compatibility.md names, for every difference from upstream it claims, the test that holds it.
This checks that each row names at least one test and that every test named exists (``file::function``; a bare
``::function`` is in the file named before it in the same row), so the tables cannot drift from the suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPATIBILITY = ROOT / "docs" / "compatibility.md"
REF = re.compile(r"`((?:tests/[\w/]+\.py)?)::(\w+)`")


def compatibility_rows(text: str) -> list[str]:
    """The rows of every table in the page (header and separator rows left out)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith("|")
        and not set(line) <= set("|-: ")
        and not line.startswith("| Behaviour")
        and not line.startswith("| Upstream capability")
    ]


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_row_names_tests_that_exist() -> None:
    rows = compatibility_rows(COMPATIBILITY.read_text(encoding="utf-8"))
    assert len(rows) >= 10, rows
    missing = []
    for row in rows:
        refs = REF.findall(row)
        assert refs, f"docs/compatibility.md row names no test: {row}"
        current = ""
        for file, name in refs:
            current = file or current
            assert current, f"'::{name}' without a file before it: {row}"
            path = ROOT / current
            if not path.is_file() or name not in functions_in(path):
                missing.append(f"{current}::{name}")
    assert not missing, f"docs/compatibility.md names tests that do not exist: {missing}"


def test_the_check_can_fail() -> None:
    text = "# Compatibility with upstream\n\n| Behaviour | Upstream | Tested by |\n|---|---|---|\n| x | y | `tests/test_docs_compatibility.py::nope` |\n"
    rows = compatibility_rows(text)
    assert len(rows) == 1
    file, name = REF.findall(rows[0])[0]
    assert name not in functions_in(ROOT / file)
