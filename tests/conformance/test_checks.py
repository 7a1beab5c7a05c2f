"""The checks can fail: a deliberately broken HBONE terminator (real TLS, real HTTP/2 frames) breaks the rules a
conforming peer keeps, and each broken rule must come out FAIL, with what was seen.

The broken server accepts clients without a certificate, answers 200 to every request (GET, no :authority, a host
without a port), advertises a limit of 4 concurrent streams and then opens a fifth, and echoes without looking at
flow-control windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from hyperframe.frame import DataFrame

from ztunnel.conformance.checks import Check, Outcome, Skip, Verdict, judge, run_checks, select
from ztunnel.conformance.target import CHECKS, TargetSpec, run_target
from ztunnel.conformance.wire import INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, Stream, Wire, tls_facts
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity

CLIENT = Identity("cluster.local", "default", "client")
SERVER = Identity("cluster.local", "default", "server")


async def careless_echo(wire: Wire, stream: Stream) -> None:
    """200, then echo in 16 KiB DATA frames as fast as bytes come, never asking whether the window allows it."""
    wire.send_headers(stream, [(":status", "200")])
    sent = 0

    def more() -> bool:
        return len(stream.data) > sent or stream.ended

    while not wire.closed and stream.reset is None:
        await wire.wait_for(more, 5)
        while sent < len(stream.data):
            chunk = bytes(stream.data[sent : sent + 16384])
            wire.send_frame(DataFrame(stream.id, data=chunk))
            sent += len(chunk)
        if stream.ended:
            wire.send_frame(DataFrame(stream.id, data=b"", flags=["END_STREAM"]))
            return


@contextlib.asynccontextmanager
async def broken_terminator(tmp_path: Path, ca: LocalCA) -> AsyncIterator[tuple[str, int]]:
    cert = ca.issue(SERVER, timedelta(hours=1))
    (tmp_path / "s.pem").write_text(cert.chain_pem())
    (tmp_path / "s.key").write_text(cert.key_pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "s.pem", tmp_path / "s.key")
    ctx.load_verify_locations(cadata=ca.root_pem())
    ctx.verify_mode = ssl.CERT_OPTIONAL  # broken: a client without a certificate gets in
    ctx.set_alpn_protocols(["h2"])
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        settings = {INITIAL_WINDOW_SIZE: 4 * 1024 * 1024, MAX_CONCURRENT_STREAMS: 4}
        wire = Wire(reader, writer, client=False, tls=tls_facts(writer), settings=settings)

        def on_stream(stream: Stream) -> None:
            task = asyncio.get_running_loop().create_task(careless_echo(wire, stream), name="careless-echo")
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        wire.on_stream = on_stream
        wire.start()
        await wire.wait_for(lambda: wire.closed, 120)
        await wire.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()


@pytest.fixture
def ca_files(tmp_path: Path) -> tuple[LocalCA, Path, Path]:
    ca = LocalCA.load_or_create(tmp_path / "ca", "cluster.local")
    client = ca.issue(CLIENT, timedelta(hours=1))
    (tmp_path / "c.pem").write_text(client.chain_pem())
    (tmp_path / "c.key").write_text(client.key_pem())
    return ca, tmp_path / "c.pem", tmp_path / "c.key"


SHOULD_FAIL = {
    "tls.no_client_cert": "accepted",
    "connect.no_authority": "a tunnel was opened",
    "connect.authority_without_port": "a tunnel was opened",
    "connect.get": "status 200",
    "connect.post": "status 200",
    "flow.stalled_reader": "sent into a 65535-byte window",
    "streams.over_limit": "stream 5 of a 4 limit: status 200",
}


async def test_a_broken_terminator_fails(tmp_path: Path, ca_files: tuple[LocalCA, Path, Path]) -> None:
    ca, chain, key = ca_files
    async with broken_terminator(tmp_path, ca) as (host, port):
        spec = TargetSpec(
            host=host,
            port=port,
            ca=tmp_path / "ca" / "root-cert.pem",
            cert=chain,
            key=key,
            expect_identity=str(SERVER),
            authority="10.0.0.1:8080",
            ca_key=tmp_path / "ca" / "ca-key.pem",
            timeout=5,
        )
        checks = select(CHECKS, [*SHOULD_FAIL, "connect.ok", "data.echo_half_close", "h2.settings."], [])
        results = {r.check.id: r.outcome for r in await run_target(spec, checks)}
    for cid, seen in SHOULD_FAIL.items():
        assert results[cid].verdict is Verdict.FAIL and seen in results[cid].observed, (cid, results[cid])
    # What it does right is still seen as right: the checks are not just failing everything.
    assert results["connect.ok"].verdict is Verdict.PASS
    assert results["data.echo_half_close"].verdict is Verdict.PASS
    assert results["h2.settings.max_concurrent_streams"].verdict is Verdict.DIFF  # 4, not upstream's 200


async def test_runner_verdicts_and_errors() -> None:
    """The runner turns a Skip into SKIP, a stuck check into ERROR at its limit, and a crash into ERROR."""

    async def ok(_: object) -> Outcome:
        return judge("fine", like_upstream=True)

    async def skip(_: object) -> Outcome:
        raise Skip("needs --ca-key")

    async def stuck(_: object) -> Outcome:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def crash(_: object) -> Outcome:
        raise KeyError("oops")

    checks = [Check(n, n, "", "", "", f) for n, f in (("a", ok), ("b", skip), ("c", stuck), ("d", crash))]
    results = await run_checks(checks, object(), limit=0.2)
    assert [(r.check.id, r.outcome.verdict) for r in results] == [
        ("a", Verdict.PASS),
        ("b", Verdict.SKIP),
        ("c", Verdict.ERROR),
        ("d", Verdict.ERROR),
    ]
    assert results[1].outcome.observed == "needs --ca-key" and "KeyError" in results[3].outcome.observed


def test_every_check_is_documented() -> None:
    """docs/conformance.md names every check of both modes, and no check that does not exist."""
    import re

    from ztunnel.conformance import originator, target

    text = (Path(__file__).resolve().parents[2] / "docs" / "conformance.md").read_text()
    ids = {c.id for c in target.CHECKS} | {c.id for c in originator.CHECKS}
    named = set(re.findall(r"`((?:tls|identity|h2|connect|data|flow|streams|origin)\.[a-z0-9_.]+)`", text))
    assert ids - named == set(), "checks missing from docs/conformance.md"
    assert named - ids == set(), "docs/conformance.md names checks that do not exist"
    assert f"{len(target.CHECKS)} checks" in text and f"{len(originator.CHECKS)} checks" in text
