"""The interop tier never passes silently: without a usable upstream binary it is skipped with the reason (a failure
under ``ZTUNNEL_UPSTREAM_TESTS=require``), and ``make interop-upstream`` refuses to start without one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ztunnel.testing import interop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(interop.UPSTREAM_BIN_ENV, raising=False)
    monkeypatch.delenv(interop.REQUIRE_ENV, raising=False)
    return monkeypatch


def test_skipped_when_the_variable_is_unset(env: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^ZTUNNEL_UPSTREAM_BIN is not set"):
        interop.require_upstream()


@pytest.mark.parametrize("kind", ["missing", "not executable", "directory"])
def test_skipped_when_the_binary_is_not_executable(env: pytest.MonkeyPatch, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ztunnel"
    if kind == "not executable":
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644)
    elif kind == "directory":
        path.mkdir()
    env.setenv(interop.UPSTREAM_BIN_ENV, str(path))
    with pytest.raises(pytest.skip.Exception, match=rf"^ZTUNNEL_UPSTREAM_BIN={path} is not executable$"):
        interop.require_upstream()


def test_required_turns_the_skip_into_a_failure(env: pytest.MonkeyPatch) -> None:
    env.setenv(interop.REQUIRE_ENV, "require")
    with pytest.raises(pytest.fail.Exception, match="ZTUNNEL_UPSTREAM_TESTS=require, but ZTUNNEL_UPSTREAM_BIN is not"):
        interop.require_upstream()


def test_make_target_refuses_to_start_without_the_binary() -> None:
    environ = {k: v for k, v in os.environ.items() if k != interop.UPSTREAM_BIN_ENV and not k.startswith("MAKE")}
    p = subprocess.run(
        ["make", "-s", "--no-print-directory", "interop-upstream"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "set ZTUNNEL_UPSTREAM_BIN to an upstream ztunnel binary" in p.stderr
    assert "pytest" not in p.stdout + p.stderr  # nothing ran
