"""Every documented setting has its effect, or says it has none: the configuration tables (docs/configuration.md), the
registry in
``ztunnel/config.py`` (``SETTINGS``) and the code are checked against each other, so a setting that is parsed and
then ignored cannot come back unnoticed.

* docs <-> registry: every row of the tables under "## Environment variables" in docs/configuration.md is one
  registry entry with the same variable names, and vice versa; rows of settings without effect say "no effect", rows of refused settings say "refused".
* registry <-> Config: every ``Config`` field is set by some entry (or is a declared derived field); every field of an
  implemented entry is read somewhere in ``ztunnel/`` outside ``config.py`` (found with the AST: an attribute of that
  name, or a ``Config`` property reading it that is itself read), and no field of a no-effect or refused entry is (a
  stale registry).
* registry -> behaviour: each variable declared as warning or refused, set alone, gives its warning (naming it, its
  value and "no effect") or a ``ConfigError`` naming it; a running ztunnel logs the warnings at startup.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ztunnel.config import DERIVED_FIELDS, SETTINGS, Config, ConfigError, Setting, Support, from_env
from ztunnel.testing import TwoNodeMesh, running_app

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
PACKAGE = ROOT / "ztunnel"
NAME = re.compile(r"`([A-Z][A-Z0-9_]*(?:<K>|\*)?)`")


def doc_rows(text: str | None = None) -> list[tuple[frozenset[str], str]]:
    """(variable names of the first cell, whole row) for every table row under docs/configuration.md's
    "## Environment variables"."""
    if text is None:
        text = CONFIGURATION.read_text(encoding="utf-8")
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        first = line.split("|")[1]
        if first.strip() == "Variable":
            continue
        names = frozenset(NAME.findall(first))
        assert names, f"docs/configuration.md row without a variable name: {line}"
        rows.append((names, line))
    return rows


def test_doc_parser_finds_the_rows() -> None:
    table = (
        "\n## Environment variables\n\n| Variable | Default | Meaning |\n|---|---|---|\n| `A_B` / `C_<K>` | 1 | x |\n"
    )
    assert doc_rows(table + "\n## Next\n| `Z` | | |\n") == [
        (frozenset({"A_B", "C_<K>"}), "| `A_B` / `C_<K>` | 1 | x |")
    ]


def entry_of(names: frozenset[str]) -> Setting | None:
    return next((s for s in SETTINGS if frozenset(s.names) == names), None)


def test_every_documented_row_is_in_the_registry_and_back() -> None:
    rows = doc_rows()
    missing = [sorted(names) for names, _ in rows if entry_of(names) is None]
    assert missing == [], f"docs/configuration.md rows without a registry entry (ztunnel/config.py SETTINGS): {missing}"
    documented = {names for names, _ in rows}
    undocumented = [s.names for s in SETTINGS if frozenset(s.names) not in documented]
    assert undocumented == [], f"registry entries without a docs/configuration.md row: {undocumented}"
    assert len(documented) == len(rows), "two docs/configuration.md rows with the same variables"


def test_doc_rows_say_what_has_no_effect_and_what_is_refused() -> None:
    for names, row in doc_rows():
        entry = entry_of(names)
        assert entry is not None
        if entry.warns_when:
            assert "no effect" in row, f"docs/configuration.md must say {sorted(names)} has no effect: {row}"
        if entry.refused_when:
            assert "refused" in row, f"docs/configuration.md must say {sorted(names)} is refused: {row}"
        if entry.support is Support.IMPLEMENTED and not entry.warns_when:
            assert "no effect" not in row, (
                f"docs/configuration.md says {sorted(names)} has no effect, the registry does not: {row}"
            )


def test_registry_is_consistent() -> None:
    field_names = {f.name for f in dataclasses.fields(Config)}
    for s in SETTINGS:
        assert set(s.fields) <= field_names, (s.names, set(s.fields) - field_names)
        if s.support is Support.WARNS:
            assert s.warns_when and set(s.warns_when) == set(s.names), s.names  # every variable of the row warns
        if s.support is Support.REFUSED:
            assert s.refused_when and set(s.refused_when) == set(s.names), s.names
        assert set(s.warns_when or {}) | set(s.refused_when or {}) <= set(s.names), s.names
    covered = {f for s in SETTINGS for f in s.fields} | set(DERIVED_FIELDS)
    assert field_names - covered == set(), f"Config fields no setting sets: {field_names - covered}"


def attributes_read(paths: list[Path]) -> set[str]:
    """Names of every attribute read (``x.name``) in these files."""
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute):
                out.add(node.attr)
    return out


def fields_read_by_properties() -> dict[str, set[str]]:
    """For each ``Config`` property: the ``self.<field>`` it reads (in ``config.py``)."""
    tree = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
    out: dict[str, set[str]] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list
        ):
            out[fn.name] = {
                n.attr
                for n in ast.walk(fn)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            }
    return out


def fields_used_outside_config() -> set[str]:
    paths = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "config.py" and "testing" not in p.parts]
    read = attributes_read(paths)
    for prop, fields in fields_read_by_properties().items():
        if prop in read:
            read |= fields
    return read


def test_implemented_settings_are_read_and_the_others_are_not() -> None:
    used = fields_used_outside_config()
    unused = sorted(
        (f, s.names) for s in SETTINGS if s.support is Support.IMPLEMENTED for f in s.fields if f not in used
    )
    assert unused == [], f"settings declared implemented whose Config field nothing reads: {unused}"
    stale = sorted(
        (f, s.names) for s in SETTINGS if s.support is not Support.IMPLEMENTED for f in s.fields if f in used
    )
    assert stale == [], (
        f"settings declared without effect whose field is read (update SETTINGS and docs/configuration.md): {stale}"
    )


def test_the_ast_check_can_fail(tmp_path: Path) -> None:
    # The check above sees reads through properties and misses a field nobody reads.
    assert {"instance_ip", "pod_name"} <= fields_used_outside_config()  # via Config.node_id (the xDS client)
    module = tmp_path / "m.py"
    module.write_text("def f(cfg):\n    return cfg.tls12_enabled\n")
    assert attributes_read([module]) == {"tls12_enabled"}


WARNINGS = [(name, value) for s in SETTINGS for name, value in (s.warns_when or {}).items()]
REFUSALS = [(name, value) for s in SETTINGS for name, value in (s.refused_when or {}).items()]


def test_a_setting_without_effect_warns() -> None:
    # Since issues 16-19 every documented setting has its effect or is refused, so no row warns; a row added with
    # warns_when is checked here (a loop, not a parametrization, so that an empty list is not a skip).
    for name, value in WARNINGS:
        cfg = from_env({name: value})
        (message,) = [w for w in cfg.warnings if w.startswith((f"{name}=", f"{name} "))]
        assert "has no effect yet: " in message
        # The value: as given, or for PROXY_CONFIG the field that has no effect.
        assert ("concurrency=4" if name == "PROXY_CONFIG" else repr(value)) in message
    assert from_env({}).warnings == ()  # nothing set, nothing said


@pytest.mark.parametrize(("name", "value"), REFUSALS)
def test_a_refused_setting_fails_with_its_name(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(name)) as e:
        from_env({name: value})
    assert "refused" in str(e.value)


@pytest.mark.parametrize(("name", "value"), REFUSALS)
def test_the_cli_refuses_in_one_line(name: str, value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ztunnel", "proxy"],
        env={"PATH": os.environ.get("PATH", ""), name: value},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: invalid configuration: {name}") and "refused" in line, line


WORKER_SETTINGS = {
    "ZTUNNEL_WORKER_THREADS": "4",
    "ZTUNNEL_CPU_LIMIT": "4",
    "ZTUNNEL_RESOURCE_CPU_LIMIT": "4",
    "ZTUNNEL_RESOURCE_CPU_REQUEST": "500m",
    "PROXY_CONFIG": '{"concurrency": 4}',
}


def test_the_lists_are_what_the_issues_say() -> None:
    # So a parametrization above cannot shrink silently.
    # Issue 18: LOCALHOST_APP_TUNNEL routes the PROXY app tunnel now (tests/proxy/test_app_tunnel.py), so it is quiet.
    assert "LOCALHOST_APP_TUNNEL" not in {name for name, _ in WARNINGS}
    assert {"COMPLIANCE_POLICY"} <= {name for name, _ in REFUSALS}


@pytest.mark.parametrize(("name", "value"), WORKER_SETTINGS.items())
def test_the_worker_settings_have_their_effect_without_a_warning(name: str, value: str) -> None:
    # Issue 16: they size the worker processes now (tests/workers/ runs them), so they are implemented and quiet.
    (entry,) = [s for s in SETTINGS if name in s.names]
    assert entry.support is Support.IMPLEMENTED and not entry.warns_when
    cfg = from_env({name: value}, cpu_count=2)
    assert cfg.warnings == ()
    # 500m rounds up to 1 CPU, below the default floor of 2 workers.
    assert cfg.worker_threads == (2 if name == "ZTUNNEL_RESOURCE_CPU_REQUEST" else 4)


async def test_a_running_ztunnel_logs_each_warning_at_startup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = TwoNodeMesh(tmp_path)
    caplog.set_level(logging.WARNING)
    async with running_app(m.env_a(**dict(WARNINGS))):
        pass
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "no effect" in r.getMessage()]
    # Each one named in exactly one line.
    for name, _ in WARNINGS:
        assert len([m for m in logged if re.search(rf"(^|, ){name}[= ]", m)]) == 1, (name, logged)
    assert len(logged) == len(WARNINGS), logged
