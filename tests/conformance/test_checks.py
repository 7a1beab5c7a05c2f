"""The checks can fail: a deliberately broken HBONE terminator (real TLS, real HTTP/2 frames) breaks the rules a
conforming peer keeps, and each broken rule must come out FAIL, with what was seen.

The broken server accepts clients without a certificate, answers 200 to every request (GET, no :authority, a host
without a port), advertises a limit of 4 concurrent streams and then opens a fifth, and echoes without looking at
flow-control windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from hyperframe.frame import DataFrame

from ztunnel.conformance import originator
from ztunnel.conformance.checks import Check, Outcome, Skip, Verdict, judge, run_checks, select
from ztunnel.conformance.originator import Driver, OriginSpec, run_originator
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


@contextlib.asynccontextmanager
async def broken_originator(hbone: tuple[str, int], ca: LocalCA, tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """A TCP entry that tunnels each connection to ``hbone`` badly: SNI sent, :scheme and :path on the CONNECT,
    DATA sent with no regard for windows, and the downstream FIN never passed on (no END_STREAM)."""
    cert = ca.issue(CLIENT, timedelta(hours=1))
    (tmp_path / "o.pem").write_text(cert.chain_pem())
    (tmp_path / "o.key").write_text(cert.key_pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=ca.root_pem())
    ctx.load_cert_chain(tmp_path / "o.pem", tmp_path / "o.key")
    ctx.set_alpn_protocols(["h2"])
    tasks: set[asyncio.Task[None]] = set()

    async def tunnel(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        reader, writer = await asyncio.open_connection(*hbone, ssl=ctx, server_hostname="bad.example")
        wire = Wire(reader, writer, client=True, tls=tls_facts(writer))
        wire.start()
        stream = wire.open_stream()
        headers = [(":method", "CONNECT"), (":scheme", "https"), (":path", "/"), (":authority", "10.0.0.1:8080")]
        wire.send_headers(stream, headers)
        sent = 0

        def more() -> bool:
            return len(stream.data) > sent or stream.ended

        async def back() -> None:
            nonlocal sent
            while not wire.closed:
                await wire.wait_for(more, 30)
                if len(stream.data) > sent:
                    down_w.write(bytes(stream.data[sent:]))
                    sent = len(stream.data)
                if stream.ended:
                    down_w.write_eof()
                    return

        task = asyncio.get_running_loop().create_task(back(), name="broken-originator-back")
        try:
            while chunk := await down_r.read(16384):
                wire.send_frame(DataFrame(stream.id, data=chunk))  # windows? never heard of them
            await asyncio.sleep(30)  # the downstream FIN goes nowhere
        finally:
            task.cancel()
            await wire.close()
            down_w.close()

    def start(down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(tunnel(down_r, down_w), name="broken-originator")
        tasks.add(task)

    server = await asyncio.start_server(start, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


ORIGIN_SHOULD = {
    "origin.connect.request": (Verdict.FAIL, "extra pseudo-headers [':path', ':scheme']"),
    "origin.flow.respects_window": (Verdict.FAIL, "beyond the stream window"),
    "origin.data.echo_half_close": (Verdict.FAIL, "then timeout"),
    "origin.tls.no_sni": (Verdict.DIFF, "SNI 'bad.example'"),
    "origin.headers.traceparent": (Verdict.DIFF, "no traceparent header"),
    "origin.h2.settings.enable_push": (Verdict.DIFF, "not sent (RFC default 1)"),
    "origin.tls.client_identity": (Verdict.PASS, str(CLIENT)),
}


async def test_a_broken_originator_fails(tmp_path: Path, ca_files: tuple[LocalCA, Path, Path]) -> None:
    ca, _, _ = ca_files
    server = ca.issue(SERVER, timedelta(hours=1))
    (tmp_path / "srv.pem").write_text(server.chain_pem())
    (tmp_path / "srv.key").write_text(server.key_pem())
    listener = socket.create_server(("127.0.0.1", 0))
    async with broken_originator(listener.getsockname()[:2], ca, tmp_path) as entry:
        spec = OriginSpec(
            ca=tmp_path / "ca" / "root-cert.pem",
            cert=tmp_path / "srv.pem",
            key=tmp_path / "srv.key",
            expect_identity=str(CLIENT),
            driver=Driver("tcp", *entry),
            timeout=3,
        )
        checks = select(originator.CHECKS, list(ORIGIN_SHOULD), [])
        results = {r.check.id: r.outcome for r in await run_originator(spec, listener, checks)}
    for cid, (verdict, seen) in ORIGIN_SHOULD.items():
        assert results[cid].verdict is verdict and seen in results[cid].observed, (cid, results[cid])
