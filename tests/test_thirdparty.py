"""The third-party patches (ztunnel/thirdparty.py): importing ztunnel changes no other library, ``apply()`` does; a
patch outside its library's versions is skipped with a warning or, if correctness depends on it, fails; and one
test per patch fails when the internals it relies on change (each reads or drives the library, not ztunnel)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import hpack
import hpack.hpack
import pytest

from ztunnel import thirdparty

ROOT = Path(__file__).resolve().parent.parent

# What each process-wide patch replaces, as seen from a fresh interpreter.
_SNAPSHOT = """
import json, sys
import aiohttp.web_protocol, hpack.hpack

def snapshot():
    return {
        "hpack.hpack.log": id(hpack.hpack.log),
        "aiohttp.web_protocol.ERROR": repr(aiohttp.web_protocol.ERROR.version),
    }
"""


def _run(code: str) -> dict[str, dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT + code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, dict[str, object]] = json.loads(proc.stdout)
    return out


def test_importing_the_sans_io_core_changes_nothing_global() -> None:
    """The HBONE core, the HTTP servers and the app module import without touching hpack or aiohttp;
    ``apply()`` (what App.start runs) then does change each of them, so the snapshot compares what matters."""
    got = _run(
        "before = snapshot()\n"
        "import ztunnel.proxy.hbone.core, ztunnel.proxy.hbone.connection, ztunnel.http, ztunnel.app\n"
        "imported = snapshot()\n"
        "from ztunnel import thirdparty\n"
        "thirdparty.apply()\n"
        "print(json.dumps({'before': before, 'imported': imported, 'applied': snapshot()}))\n"
    )
    assert got["imported"] == got["before"]
    changed = {k for k in got["before"] if got["applied"][k] != got["before"][k]}
    assert changed == set(got["before"]), f"apply() left {set(got['before']) - changed} unpatched"


# -- the version guards -------------------------------------------------------------------------------------------


def test_installed_libraries_are_in_every_patch_range() -> None:
    """A dependency upgraded past a patch's range fails here first (then: check the internals, widen the range)."""
    for patch in thirdparty.PATCHES:
        version = thirdparty.installed_version(patch.distribution)
        assert patch.unsupported(version) is None, (patch.name, version)
        assert thirdparty.enabled(patch), patch.name


def test_a_version_outside_the_range_is_refused_with_the_reason() -> None:
    p = thirdparty.HPACK_DEBUG_LOG
    assert p.unsupported("4.0.0") is None and p.unsupported("4.9.1rc1") is None
    assert p.unsupported("5.0.0") == "hpack 5.0.0 is outside the versions it was written for (>=4.0,<5)"
    assert p.unsupported("3.0.0") == "hpack 3.0.0 is outside the versions it was written for (>=4.0,<5)"
    assert "version is unknown" in (p.unsupported(None) or "")


def _apply_with_versions(versions: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``thirdparty.apply()`` in a fresh interpreter whose package metadata reports ``versions``."""
    code = (
        _SNAPSHOT
        + "import importlib.metadata, logging\n"
        + f"fake = {versions!r}\n"
        + "real = importlib.metadata.version\n"
        + "importlib.metadata.version = lambda d: fake.get(d) or real(d)\n"
        + "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        + "from ztunnel import thirdparty\n"
        + "before = snapshot()\n"
        + "try:\n"
        + "    thirdparty.apply()\n"
        + "    thirdparty.apply()\n"  # idempotent: warns once
        + "except thirdparty.PatchError as e:\n"
        + "    print('PatchError:', e, file=sys.stderr)\n"
        + "after = snapshot()\n"
        + "print(json.dumps({k: after[k] != before[k] for k in before}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def test_a_speed_patch_outside_its_range_is_skipped_with_one_warning() -> None:
    proc = _apply_with_versions({"hpack": "5.0.0"})
    assert proc.returncode == 0, proc.stderr
    changed = json.loads(proc.stdout)
    # hpack's patch is not applied; the others are.
    assert changed == {
        "hpack.hpack.log": False,
        "aiohttp.web_protocol.ERROR": True,
    }
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, proc.stderr  # one, not one per apply()
    assert "hpack 5.0.0 is outside the versions it was written for (>=4.0,<5)" in warnings[0]
    assert "hpack.hpack.log" in warnings[0] and "DEBUG calls stay" in warnings[0]


def test_a_required_patch_outside_its_range_fails_before_anything_is_installed() -> None:
    proc = _apply_with_versions({"aiohttp": "4.0.0"})
    assert proc.returncode == 0, proc.stderr
    assert not any(json.loads(proc.stdout).values())  # nothing half-installed
    assert "PatchError: cannot apply aiohttp.web_protocol.ERROR" in proc.stderr
    assert "aiohttp 4.0.0 is outside the versions it was written for (>=3.9,<4)" in proc.stderr
    assert "correctness depends on it" in proc.stderr


# -- hpack.hpack.log ----------------------------------------------------------------------------------------------


def test_hpack_calls_only_debug_on_its_module_logger() -> None:
    """The no-op logger has only ``debug``: any other call hpack made on ``log`` would raise in every CONNECT."""
    source = inspect.getsource(hpack.hpack)
    assert re.search(r"^log = logging\.getLogger\(", source, re.M), "hpack no longer has a module logger `log`"
    assert set(re.findall(r"\blog\.(\w+)", source)) == {"debug"}


def test_hpack_logs_each_header_at_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the patch saves: without it, hpack calls ``log.debug`` for every field it encodes and decodes."""
    calls: list[str] = []

    class Recorder:
        def debug(self, msg: str, *args: object) -> None:
            calls.append(msg)

    monkeypatch.setattr(hpack.hpack, "log", Recorder())
    headers = [(":method", "CONNECT"), (":authority", "10.0.0.1:8080"), ("baggage", "k8s.cluster.name=c")]
    block = hpack.Encoder().encode(headers)
    encoded = len(calls)
    decoded: list[object] = [tuple(h) for h in hpack.Decoder().decode(block)]
    assert decoded == headers
    assert encoded >= len(headers) and len(calls) - encoded >= len(headers), calls


# -- aiohttp.web_protocol.ERROR -----------------------------------------------------------------------------------


async def _status_line_for_garbage() -> bytes:
    from aiohttp import web

    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"hello world\r\n\r\n")  # upstream's malicious_calls_inpod
        line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        return line
    finally:
        await runner.cleanup()


async def test_aiohttp_answers_unparsable_requests_in_the_placeholders_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch sets the version of ``web_protocol.ERROR``, the request aiohttp answers a bad one from: the status
    line must follow it (plain aiohttp, none of ztunnel's HTTP code)."""
    from aiohttp import web_protocol
    from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage

    assert isinstance(web_protocol.ERROR, RawRequestMessage)
    monkeypatch.setattr(web_protocol, "ERROR", web_protocol.ERROR._replace(version=HttpVersion10))
    assert (await _status_line_for_garbage()).startswith(b"HTTP/1.0 400 ")
    monkeypatch.setattr(web_protocol, "ERROR", web_protocol.ERROR._replace(version=HttpVersion11))
    assert (await _status_line_for_garbage()).startswith(b"HTTP/1.1 400 ")
