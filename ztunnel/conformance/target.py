"""Checks of an HBONE *terminator* (a ztunnel's port 15008, a waypoint, Envoy): the checker is the client.

Every check opens its own connections (TLS 1.3 client, no SNI, like upstream's client) and closes them after.
Tunnels go to ``authority``, which must name a TCP echo service behind the target (it echoes every byte and answers
our FIN with its own after the echo, as ``socat``'s or ``ncat``'s echo modes do).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ztunnel.conformance.checks import Check, CheckError, Outcome, Result, Skip, Verdict, judge, run_checks
from ztunnel.conformance.wire import (
    CANCEL,
    ENABLE_PUSH,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    SETTING_NAMES,
    Stream,
    Wire,
    error_name,
    tls_facts,
)
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity

# Upstream's HBONE server (src/proxy/h2/server.rs::serve_connection, defaults from src/config.rs).
UPSTREAM_STREAM_WINDOW = 4 * 1024 * 1024  # HTTP2_STREAM_WINDOW_SIZE
UPSTREAM_CONNECTION_WINDOW = 16 * 1024 * 1024  # HTTP2_CONNECTION_WINDOW_SIZE
UPSTREAM_MAX_FRAME = 1024 * 1024  # HTTP2_FRAME_SIZE
UPSTREAM_SERVER_MAX_STREAMS = 200
UPSTREAM_SERVER_MAX_HEADER_LIST = 64 * 1024
UPSTREAM_POOL_STREAMS = 100  # POOL_MAX_STREAMS_PER_CONNECTION: what an upstream client puts on one connection

# Our side as upstream's client sets it (src/proxy/h2/client.rs), except the frame size: we keep the RFC's 16 KiB so
# a target that ignores our SETTINGS_MAX_FRAME_SIZE shows it.
CLIENT_SETTINGS = {ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: UPSTREAM_STREAM_WINDOW, MAX_HEADER_LIST_SIZE: 16 * 1024}
OTHER_TRUST_DOMAIN = "conformance.invalid"


@dataclass
class TargetSpec:
    """Where the target is and what we present to it (paths are PEM files)."""

    host: str
    port: int
    ca: Path  # roots that verify the target's certificate (and that the target trusts for ours)
    cert: Path  # our chain
    key: Path
    expect_identity: str  # the SPIFFE id the target must present
    authority: str  # CONNECT :authority of a TCP echo service behind the target
    ca_key: Path | None = None  # the root's key: lets identity checks sign certificates the target's root issued
    timeout: float = 10.0  # how long one wait (a response, a window, a close) may take


@dataclass
class TargetContext:
    spec: TargetSpec
    workdir: Path
    _wires: list[Wire] = field(default_factory=list)

    # -- TLS ----------------------------------------------------------------------------------------------------------

    def tls_context(
        self,
        cert: tuple[Path, Path] | None,
        *,
        max_version: ssl.TLSVersion | None = None,
        alpn: tuple[str, ...] = ("h2",),
    ) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # HBONE checks the URI SAN, never a DNS name (upstream: IdentityVerifier)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(self.spec.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # offer 1.2 too: the target must pick 1.3
        if max_version is not None:
            ctx.maximum_version = max_version
        if cert is not None:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        ctx.set_alpn_protocols(list(alpn))
        return ctx

    async def connect(
        self,
        *,
        cert: tuple[Path, Path] | str | None = "default",
        max_version: ssl.TLSVersion | None = None,
        alpn: tuple[str, ...] = ("h2",),
        settings: dict[int, int] | None = None,
        connection_window: int = UPSTREAM_CONNECTION_WINDOW,
        auto_release: bool = True,
        tracked: bool = True,
    ) -> Wire:
        """A TLS connection to the target (no SNI, as upstream's client), our preface and SETTINGS sent. A tracked
        connection is closed (and its violations reported) after the check; a background check closes its own."""
        chosen = (self.spec.cert, self.spec.key) if cert == "default" else cert
        assert not isinstance(chosen, str)
        ctx = self.tls_context(chosen, max_version=max_version, alpn=alpn)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.spec.host, self.spec.port, ssl=ctx, server_hostname=""),
            self.spec.timeout,
        )
        wire = Wire(
            reader,
            writer,
            client=True,
            tls=tls_facts(writer),
            settings=CLIENT_SETTINGS if settings is None else settings,
            connection_window=connection_window,
            auto_release=auto_release,
        )
        if tracked:
            self._wires.append(wire)
        wire.start()
        return wire

    async def finish(self) -> str | None:
        """Close the connections the last check opened; the HTTP/2 violations they saw, if any."""
        wires, self._wires = self._wires, []
        found = [v for w in wires for v in w.violations]
        for wire in wires:
            await wire.close()
        return "; ".join(dict.fromkeys(found)) or None

    # -- HTTP/2 helpers -----------------------------------------------------------------------------------------------

    async def barrier(self, wire: Wire) -> None:
        """A PING round trip: every frame the target queued before our PING has arrived when this returns."""
        payload = os.urandom(8)
        wire.send_ping(payload)
        if not await wire.wait_for(lambda: payload in wire.ping_acks, self.spec.timeout):
            raise CheckError(f"no PING ACK within {self.spec.timeout:g} s ({wire.close_reason or 'open'})")

    def connect_headers(self, authority: str | None = None) -> list[tuple[str, str]]:
        return [(":method", "CONNECT"), (":authority", authority or self.spec.authority)]

    async def request(self, wire: Wire, headers: list[tuple[str, str]], end_stream: bool = False) -> Stream:
        """Send ``headers`` on a new stream and wait for the answer: response headers, RST_STREAM, GOAWAY or close."""
        stream = wire.open_stream()
        wire.send_headers(stream, headers, end_stream=end_stream)
        await wire.wait_for(
            lambda: stream.headers is not None or stream.reset is not None or wire.goaway is not None,
            self.spec.timeout,
        )
        return stream

    async def tunnel(self, wire: Wire) -> Stream:
        """A CONNECT to the echo service that must succeed (200); CheckError otherwise."""
        stream = await self.request(wire, self.connect_headers())
        if stream.status != "200":
            raise CheckError(f"the baseline CONNECT to {self.spec.authority} got {answer(wire, stream)}")
        return stream

    async def echo(self, wire: Wire, stream: Stream, payload: bytes) -> None:
        """Send ``payload`` with END_STREAM and wait for the echo to end (END_STREAM, RST_STREAM or close)."""
        await wire.send_data(stream, payload, end_stream=True, timeout=self.spec.timeout)
        await wire.wait_for(
            lambda: stream.ended or stream.reset is not None or len(stream.data) > len(payload),
            self.spec.timeout + len(payload) / 1e6,  # plus 1 s per MB: slow machines, large echoes
        )

    # -- certificates for the identity checks -------------------------------------------------------------------------

    def own_identity(self) -> Identity:
        cert = x509.load_pem_x509_certificate(self.spec.cert.read_bytes())
        for uri in uris(cert):
            ident = Identity.try_parse(uri)
            if ident is not None:
                return ident
        raise CheckError(f"{self.spec.cert} carries no SPIFFE identity (URI SAN spiffe://<td>/ns/<ns>/sa/<sa>)")

    def signing_ca(self) -> LocalCA:
        if self.spec.ca_key is None:
            raise Skip("needs --ca-key (the key of --ca's root) to sign test certificates the target's root issued")
        root = x509.load_pem_x509_certificate(self.spec.ca.read_bytes())
        key = serialization.load_pem_private_key(self.spec.ca_key.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise CheckError(f"{self.spec.ca_key}: only EC and RSA CA keys are supported")
        return LocalCA(root_cert=root, root_key=key, trust_domain=self.own_identity().trust_domain)

    def write_cert(self, name: str, ca: LocalCA, identity: Identity, now: datetime | None = None) -> tuple[Path, Path]:
        cert = ca.issue(identity, timedelta(hours=1), now=now)
        chain, key = self.workdir / f"{name}-chain.pem", self.workdir / f"{name}-key.pem"
        chain.write_text(cert.chain_pem())
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cert.key_pem())
        return chain, key


def uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)]


def answer(wire: Wire, stream: Stream) -> str:
    """How the target answered a request, for the report."""
    if stream.headers is not None:
        return f"status {stream.status}"
    if stream.reset is not None:
        return f"RST_STREAM {error_name(stream.reset)}"
    if wire.goaway is not None:
        return f"GOAWAY {error_name(wire.goaway.error_code)}"
    if wire.closed:
        return f"connection closed ({wire.close_reason})"
    return "no answer"


# -- TLS ---------------------------------------------------------------------------------------------------------------


async def tls_version(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    version, cipher = wire.tls.version, wire.tls.cipher
    ok = version == "TLSv1.3"
    aes_gcm = cipher in ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
    observed = f"{version}, {cipher}"
    if ok and not aes_gcm:
        return Outcome(Verdict.DIFF, f"{observed}: upstream offers only the AES-GCM TLS 1.3 suites")
    return judge(observed, like_upstream=ok)


async def tls12_refused(ctx: TargetContext) -> Outcome:
    try:
        wire = await ctx.connect(max_version=ssl.TLSVersion.TLSv1_2)
    except (ssl.SSLError, ConnectionError) as e:
        return judge(f"refused: {e}", like_upstream=True)
    await ctx.barrier(wire)
    return judge(
        f"TLS 1.2 accepted ({wire.tls.cipher}); upstream does so only with TLS12_ENABLED=true",
        like_upstream=False,
        acceptable=True,
    )


async def alpn_h2(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    return judge(f"ALPN {wire.tls.alpn!r}", like_upstream=wire.tls.alpn == "h2")


async def alpn_without_h2(ctx: TargetContext) -> Outcome:
    try:
        wire = await ctx.connect(alpn=("http/1.1",))
    except (ssl.SSLError, ConnectionError) as e:
        return judge(f"handshake refused: {e}", like_upstream=True)
    await wire.wait_for(lambda: wire.frames_in > 0, ctx.spec.timeout)
    if wire.frames_in == 0:
        return judge(f"ALPN {wire.tls.alpn!r}, then closed: {wire.close_reason}", like_upstream=False, acceptable=True)
    return judge(
        f"ALPN {wire.tls.alpn!r}, and HTTP/2 served anyway", like_upstream=False, acceptable=wire.tls.alpn is None
    )


async def server_identity(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()  # the chain was verified against --ca, or the handshake failed
    der = wire.tls.peer_cert_der
    if der is None:
        return judge("no server certificate", like_upstream=False)
    found = uris(x509.load_der_x509_certificate(der))
    return judge(f"URI SANs {found}", like_upstream=ctx.spec.expect_identity in found)


async def refused(ctx: TargetContext, cert: tuple[Path, Path] | None, what: str) -> Outcome:
    """Connect presenting ``cert`` and try a CONNECT: the target must end the connection before any HTTP/2."""
    try:
        wire = await ctx.connect(cert=cert)
    except (ssl.SSLError, ConnectionError) as e:
        return judge(f"{what}: handshake refused: {e}", like_upstream=True)
    stream = wire.open_stream()
    wire.send_headers(stream, ctx.connect_headers())
    await wire.wait_for(lambda: wire.closed, ctx.spec.timeout)
    if wire.frames_in == 0 and wire.closed:
        return judge(f"{what}: closed before HTTP/2 ({wire.close_reason})", like_upstream=True)
    return judge(f"{what}: accepted, the CONNECT got {answer(wire, stream)}", like_upstream=False)


async def no_client_cert(ctx: TargetContext) -> Outcome:
    return await refused(ctx, None, "no client certificate")


async def unknown_root(ctx: TargetContext) -> Outcome:
    stranger = LocalCA.generate(ctx.own_identity().trust_domain)
    return await refused(ctx, ctx.write_cert("unknown-root", stranger, ctx.own_identity()), "another root")


async def wrong_trust_domain(ctx: TargetContext) -> Outcome:
    mine = ctx.own_identity()
    other = Identity(OTHER_TRUST_DOMAIN, mine.namespace, mine.service_account)
    return await refused(ctx, ctx.write_cert("other-td", ctx.signing_ca(), other), f"identity {other}")


async def expired(ctx: TargetContext) -> Outcome:
    past = datetime.now(UTC) - timedelta(days=2)
    cert = ctx.write_cert("expired", ctx.signing_ca(), ctx.own_identity(), now=past)
    return await refused(ctx, cert, "certificate expired a day ago")


# -- HTTP/2 connection -------------------------------------------------------------------------------------------------


async def preface(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    await ctx.barrier(wire)
    ok = wire.peer_settings_first_frame and wire.settings_acked
    return judge(
        f"first frame SETTINGS: {wire.peer_settings_first_frame}, our SETTINGS acknowledged: {wire.settings_acked}",
        like_upstream=ok,
    )


def setting_check(setting: int, upstream: int | None, rfc_default: int | None) -> Check[TargetContext]:
    name = SETTING_NAMES[setting]

    async def run(ctx: TargetContext) -> Outcome:
        wire = await ctx.connect()
        await ctx.barrier(wire)
        return judge_setting(wire, setting, name, upstream, rfc_default)

    return Check(
        id=f"h2.settings.{name.lower()}",
        title=f"SETTINGS_{name} as upstream advertises",
        sends="our preface and SETTINGS, then a PING (every frame sent before its ACK has arrived)",
        upstream=f"{name} = {upstream} (src/proxy/h2/server.rs::serve_connection)",
        rule="PASS if the target's first SETTINGS carries upstream's value; DIFF otherwise (a tuning choice)",
        run=run,
    )


def judge_setting(wire: Wire, setting: int, name: str, upstream: int | None, rfc_default: int | None) -> Outcome:
    """A SETTINGS value the peer sent first (or the RFC's default when it sent none) against upstream's: PASS on
    upstream's value, DIFF otherwise (a tuning choice, never a failure)."""
    sent = (wire.peer_settings or {}).get(setting)
    value = sent if sent is not None else rfc_default
    shown = f"{sent}" if sent is not None else f"not sent (RFC default {rfc_default or 'unlimited'})"
    return judge(f"{name} {shown}", like_upstream=value == upstream, acceptable=True)


async def connection_window(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    await ctx.barrier(wire)
    window = 65535 + sum(wire.connection_window_updates)
    return judge(
        f"connection receive window {window} (WINDOW_UPDATEs {wire.connection_window_updates})",
        like_upstream=window == UPSTREAM_CONNECTION_WINDOW,
        acceptable=True,
    )


async def ping(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    payload = b"hbone-ck"
    wire.send_ping(payload)
    ok = await wire.wait_for(lambda: payload in wire.ping_acks, ctx.spec.timeout)
    return judge(f"PING ACK {'with the same payload' if ok else 'missing'}", like_upstream=ok)


async def keepalive(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect(tracked=False)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        got = await wire.wait_for(lambda: wire.pings, 25.0)
    finally:
        await wire.close()
    if wire.violations:
        return judge(f"HTTP/2 violation: {'; '.join(wire.violations)}", like_upstream=False)
    if got:
        return judge(f"first PING after {loop.time() - start:.1f} s, acknowledged by us", like_upstream=True)
    return judge(f"no PING in 25 s ({wire.close_reason or 'connection open'})", like_upstream=False, acceptable=True)


# -- CONNECT validation ------------------------------------------------------------------------------------------------


def refusal_check(
    cid: str,
    title: str,
    headers: list[tuple[str, str]] | None,
    sends: str,
    upstream_answer: str,
    upstream_source: str,
) -> Check[TargetContext]:
    """A request the target must refuse: PASS when it answers as upstream (``upstream_answer``: ``status 400`` or
    ``RST_STREAM PROTOCOL_ERROR (0x1)``), DIFF for another refusal, FAIL if it opens a tunnel."""

    async def run(ctx: TargetContext) -> Outcome:
        wire = await ctx.connect()
        sent = headers if headers is not None else ctx.connect_headers()
        sent = [(k, ctx.spec.authority if v == "{authority}" else v) for k, v in sent]
        stream = await ctx.request(wire, sent)
        got = answer(wire, stream)
        if stream.status is not None and stream.status.startswith("2"):
            return judge(f"{got}: a tunnel was opened", like_upstream=False)
        refusal = stream.headers is not None or stream.reset is not None or wire.goaway is not None or wire.closed
        return judge(got, like_upstream=got == upstream_answer, acceptable=refusal)

    return Check(
        id=cid,
        title=title,
        sends=sends,
        upstream=f"{upstream_answer} ({upstream_source})",
        rule="PASS on upstream's answer; DIFF on another refusal (4xx, RST_STREAM, GOAWAY); FAIL on 2xx",
        run=run,
    )


async def connect_ok(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    stream = await ctx.request(wire, ctx.connect_headers())
    return judge(f"{answer(wire, stream)}, headers {stream.headers}", like_upstream=stream.status == "200")


# -- data --------------------------------------------------------------------------------------------------------------


def payload_of(size: int, seed: int = 0) -> bytes:
    block = bytes((i * 31 + seed * 7 + 1) & 0xFF for i in range(251))  # 251: prime, so no period lines up with frames
    return (block * (size // len(block) + 1))[:size]


def echo_verdict(wire: Wire, stream: Stream, payload: bytes, what: str) -> Outcome:
    got = bytes(stream.data)
    if stream.reset is not None:
        return judge(f"{what}: stream reset {error_name(stream.reset)} after {len(got)} bytes", like_upstream=False)
    if got != payload:
        same = next(
            (i for i, (a, b) in enumerate(zip(got, payload, strict=False)) if a != b), min(len(got), len(payload))
        )
        return judge(f"{what}: {len(got)} of {len(payload)} bytes back, equal up to byte {same}", like_upstream=False)
    if not stream.ended:
        return judge(f"{what}: all {len(got)} bytes back but no END_STREAM", like_upstream=False)
    return judge(f"{what}: {len(got)} bytes back intact, then END_STREAM", like_upstream=True)


async def echo_half_close(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    stream = await ctx.tunnel(wire)
    payload = payload_of(256 * 1024)
    await wire.send_data(stream, payload, end_stream=False, timeout=ctx.spec.timeout)
    # Half-close only once some of the echo is back, so the rest must cross the target after our END_STREAM.
    await wire.wait_for(lambda: len(stream.data) > 0, ctx.spec.timeout)
    before = len(stream.data)
    await wire.send_data(stream, b"", end_stream=True)
    await wire.wait_for(lambda: stream.ended or stream.reset is not None, ctx.spec.timeout)
    out = echo_verdict(wire, stream, payload, "256 KiB")
    return Outcome(out.verdict, f"{out.observed} ({len(stream.data) - before} of them after our END_STREAM)")


async def frame_size(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()  # we do not send SETTINGS_MAX_FRAME_SIZE: 16384 applies
    stream = await ctx.tunnel(wire)
    payload = payload_of(1024 * 1024, 1)
    await ctx.echo(wire, stream, payload)
    out = echo_verdict(wire, stream, payload, "1 MiB")
    if out.verdict is not Verdict.PASS:
        return out
    return judge(
        f"{stream.data_frames} DATA frames, the largest {stream.largest_frame} bytes (we allow 16384)",
        like_upstream=stream.largest_frame <= 16384,
    )


async def window_refill(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    stream = await ctx.tunnel(wire)
    size = min(3 * max(wire.peer_initial_window, 65535), 16 * 1024 * 1024)
    payload = payload_of(size, 2)
    await ctx.echo(wire, stream, payload)
    return echo_verdict(wire, stream, payload, f"{size} bytes ({size // max(wire.peer_initial_window, 1)}x its window)")


async def stalled_reader(ctx: TargetContext) -> Outcome:
    # Our stream window stays at the RFC's 65535 and we never release it: the target must stop there.
    settings = {ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: 65535}
    wire = await ctx.connect(settings=settings, auto_release=False)
    stream = await ctx.tunnel(wire)
    payload = payload_of(1024 * 1024, 3)
    sender = asyncio.get_running_loop().create_task(
        wire.send_data(stream, payload, end_stream=True, timeout=60), name="conformance-stalled-sender"
    )
    try:
        await wire.wait_for(lambda: len(stream.data) >= 65535 or wire.violations, ctx.spec.timeout)
        await ctx.barrier(wire)
        held = len(stream.data)
        if wire.violations or held > 65535:
            return judge(f"{held} bytes sent into a 65535-byte window", like_upstream=False)
        if wire.closed or stream.reset is not None:
            return judge(f"stalled stream ended: {answer(wire, stream)}", like_upstream=False)
        wire.release(stream, len(payload))  # now let it all through
        await wire.wait_for(lambda: stream.ended or stream.reset is not None, ctx.spec.timeout + 2)
        out = echo_verdict(wire, stream, payload, "1 MiB")
        return Outcome(out.verdict, f"held at {held} bytes while stalled; after release {out.observed}")
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender


async def stalled_isolated(ctx: TargetContext) -> Outcome:
    settings = {ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: 65535}
    wire = await ctx.connect(settings=settings, auto_release=False)
    stalled = await ctx.tunnel(wire)
    await wire.send_data(stalled, payload_of(256 * 1024, 4), timeout=ctx.spec.timeout)
    await wire.wait_for(lambda: len(stalled.data) >= 65535, ctx.spec.timeout)
    other = await ctx.tunnel(wire)
    payload = payload_of(32 * 1024, 5)
    await ctx.echo(wire, other, payload)
    out = echo_verdict(wire, other, payload, "a second stream, beside one stalled at its window")
    return out


# -- streams and connection control ------------------------------------------------------------------------------------


async def rst_cancel(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    first = await ctx.tunnel(wire)
    await wire.send_data(first, payload_of(1024, 6))
    await wire.wait_for(lambda: len(first.data) >= 1024, ctx.spec.timeout)
    wire.send_rst(first, CANCEL)
    await ctx.barrier(wire)
    if wire.goaway is not None or wire.closed:
        return judge(f"after RST_STREAM CANCEL: {answer(wire, first)}", like_upstream=False)
    second = await ctx.tunnel(wire)
    payload = payload_of(16 * 1024, 7)
    await ctx.echo(wire, second, payload)
    out = echo_verdict(wire, second, payload, "after RST_STREAM CANCEL on stream 1, a new stream")
    return out


async def goaway_from_client(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    stream = await ctx.tunnel(wire)
    first, rest = payload_of(64 * 1024, 8), payload_of(64 * 1024, 9)
    await wire.send_data(stream, first)
    await wire.wait_for(lambda: len(stream.data) >= len(first), ctx.spec.timeout)
    wire.send_goaway(0, NO_ERROR)  # we accept no pushed streams; ours goes on
    await wire.send_data(stream, rest, end_stream=True)
    await wire.wait_for(lambda: stream.ended or stream.reset is not None or wire.closed, ctx.spec.timeout)
    out = echo_verdict(wire, stream, first + rest, "stream 1 across our GOAWAY")
    if out.verdict is Verdict.FAIL:  # cut short: what upstream does
        return Outcome(Verdict.DIFF, f"{out.observed} ({answer(wire, stream)})")
    return out


async def concurrent_streams(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    await ctx.barrier(wire)
    limit = (wire.peer_settings or {}).get(MAX_CONCURRENT_STREAMS)
    count = min(UPSTREAM_POOL_STREAMS, limit) if limit else UPSTREAM_POOL_STREAMS
    streams = []
    for _ in range(count):
        stream = wire.open_stream()
        wire.send_headers(stream, ctx.connect_headers())
        streams.append(stream)
    await wire.wait_for(lambda: all(s.headers or s.reset is not None for s in streams), ctx.spec.timeout * 2)
    refused = [answer(wire, s) for s in streams if s.status != "200"]
    if refused:
        return judge(f"{len(refused)} of {count} CONNECTs not 200: {sorted(set(refused))}", like_upstream=False)
    payloads = [payload_of(16 * 1024, i) for i in range(count)]
    await asyncio.gather(
        *(
            wire.send_data(s, p, end_stream=True, timeout=ctx.spec.timeout)
            for s, p in zip(streams, payloads, strict=True)
        )
    )
    await wire.wait_for(lambda: all(s.ended or s.reset is not None for s in streams), ctx.spec.timeout * 2)
    bad = [s.id for s, p in zip(streams, payloads, strict=True) if bytes(s.data) != p or not s.ended]
    return judge(
        f"{count} tunnels on one connection, {count - len(bad)} echoed intact" + (f"; bad: {bad[:5]}" if bad else ""),
        like_upstream=not bad,
    )


async def over_limit(ctx: TargetContext) -> Outcome:
    wire = await ctx.connect()
    await ctx.barrier(wire)
    limit = (wire.peer_settings or {}).get(MAX_CONCURRENT_STREAMS)
    if limit is None or limit > 1000:
        raise Skip(f"SETTINGS_MAX_CONCURRENT_STREAMS is {limit or 'unlimited'}: too many streams to open here")
    streams = []
    for _ in range(limit):
        stream = wire.open_stream()
        wire.send_headers(stream, ctx.connect_headers())
        streams.append(stream)
    await wire.wait_for(lambda: all(s.headers or s.reset is not None for s in streams), ctx.spec.timeout * 3)
    opened = sum(1 for s in streams if s.status == "200")
    if opened != limit:
        raise CheckError(f"only {opened} of {limit} CONNECTs within the advertised limit got 200")
    extra = await ctx.request(wire, ctx.connect_headers())
    got = answer(wire, extra)
    for s in streams:  # let the echo service's connections go
        wire.send_rst(s, CANCEL)
    if extra.status == "200":
        return judge(f"stream {limit + 1} of a {limit} limit: {got}", like_upstream=False)
    refusal = extra.reset is not None or wire.goaway is not None
    return judge(
        f"stream {limit + 1} of a {limit} limit: {got}",
        like_upstream=extra.reset == REFUSED_STREAM,
        acceptable=refusal and (extra.reset in (REFUSED_STREAM, PROTOCOL_ERROR) or wire.goaway is not None),
    )


async def run_target(
    spec: TargetSpec,
    checks: list[Check[TargetContext]] | None = None,
    on_result: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Run ``checks`` (default: all) against the terminator ``spec`` names; certificates made for the identity
    checks live in a temporary directory for the run."""
    with tempfile.TemporaryDirectory(prefix="hbone-conformance-") as tmp:
        ctx = TargetContext(spec, Path(tmp))
        try:
            return await run_checks(
                checks if checks is not None else CHECKS,
                ctx,
                limit=max(60.0, 6 * spec.timeout),
                violations=ctx.finish,
                on_result=on_result,
            )
        finally:
            await ctx.finish()


# -- the suite ---------------------------------------------------------------------------------------------------------

_RST_PROTOCOL = f"RST_STREAM {error_name(PROTOCOL_ERROR)}"
_H2_MALFORMED = "h2 crate src/server.rs::convert_poll_message: a malformed request is a stream error"

CHECKS: list[Check[TargetContext]] = [
    Check(
        "tls.version",
        "TLS 1.3 is negotiated",
        "ClientHello offering TLS 1.2 and 1.3, ALPN h2, no SNI, our client certificate",
        "TLS 1.3 only, suites TLS13_AES_256_GCM_SHA384 and TLS13_AES_128_GCM_SHA256 (src/tls/lib.rs)",
        "PASS if TLS 1.3 with an AES-GCM suite; DIFF for another TLS 1.3 suite; FAIL for TLS 1.2",
        tls_version,
    ),
    Check(
        "tls.no_tls12",
        "TLS 1.2 is refused",
        "ClientHello offering only TLS 1.2",
        "refuses the handshake (TLS 1.2 only with TLS12_ENABLED=true, off by default)",
        "PASS if the handshake fails; DIFF if TLS 1.2 is accepted",
        tls12_refused,
    ),
    Check(
        "tls.alpn",
        "ALPN h2 is selected",
        "ClientHello with ALPN [h2]",
        "ALPN h2 on both sides (src/tls/workload.rs)",
        "PASS if the server selects h2, FAIL otherwise",
        alpn_h2,
    ),
    Check(
        "tls.alpn_without_h2",
        "a client that does not offer h2 is refused",
        "ClientHello with ALPN [http/1.1] only",
        "rustls refuses the handshake (no_application_protocol alert)",
        "PASS if the handshake fails; DIFF if the target closes after it or serves HTTP/2 with no ALPN; "
        "FAIL if it selects http/1.1 and serves HTTP/2",
        alpn_without_h2,
    ),
    Check(
        "tls.server_identity",
        "the server presents the expected SPIFFE identity",
        "ClientHello; the server chain is verified against --ca",
        "the served certificate is the local workload's (src/proxy/inbound.rs::InboundCertProvider)",
        "PASS if a URI SAN equals --expect-identity",
        server_identity,
    ),
    Check(
        "tls.no_client_cert",
        "a client without a certificate is refused",
        "handshake without a client certificate, then a CONNECT",
        "a client certificate is required (WebPkiClientVerifier); no HTTP/2 is spoken",
        "PASS if the connection ends before any HTTP/2 frame; FAIL if the target speaks HTTP/2",
        no_client_cert,
    ),
    Check(
        "identity.unknown_root",
        "a certificate from another root is refused",
        "a certificate with our identity signed by a fresh root, then a CONNECT",
        "the client chain must verify against the mesh roots (WebPkiClientVerifier)",
        "PASS if the connection ends before any HTTP/2 frame",
        unknown_root,
    ),
    Check(
        "identity.wrong_trust_domain",
        "a client of another trust domain is refused",
        f"a certificate for spiffe://{OTHER_TRUST_DOMAIN}/ns/<ns>/sa/<sa> signed by the mesh root (needs --ca-key)",
        "TrustDomainVerifier: the client's SPIFFE trust domain must equal the server's "
        "(tests/namespaced.rs::trust_domain_mismatch_rejected)",
        "PASS if the connection ends before any HTTP/2 frame",
        wrong_trust_domain,
    ),
    Check(
        "identity.expired",
        "an expired client certificate is refused",
        "our identity in a certificate that expired a day ago, signed by the mesh root (needs --ca-key)",
        "webpki rejects an expired chain",
        "PASS if the connection ends before any HTTP/2 frame",
        expired,
    ),
    Check(
        "h2.preface",
        "SETTINGS first, and ours acknowledged",
        "the client preface and SETTINGS, then a PING",
        "the h2 crate sends SETTINGS first and ACKs the client's",
        "PASS if the first frame is SETTINGS and ours is acknowledged (RFC 9113 §3.4)",
        preface,
    ),
    setting_check(INITIAL_WINDOW_SIZE, UPSTREAM_STREAM_WINDOW, 65535),
    setting_check(MAX_FRAME_SIZE, UPSTREAM_MAX_FRAME, 16384),
    setting_check(MAX_CONCURRENT_STREAMS, UPSTREAM_SERVER_MAX_STREAMS, None),
    setting_check(MAX_HEADER_LIST_SIZE, UPSTREAM_SERVER_MAX_HEADER_LIST, None),
    Check(
        "h2.connection_window",
        "the connection window is raised to 16 MiB",
        "the client preface, then a PING",
        "WINDOW_UPDATE on stream 0 to HTTP2_CONNECTION_WINDOW_SIZE = 16777216 (src/proxy/h2/server.rs)",
        "PASS if 65535 + the stream-0 increments = 16777216; DIFF otherwise",
        connection_window,
    ),
    Check(
        "h2.frame_size",
        "DATA frames respect our SETTINGS_MAX_FRAME_SIZE",
        "1 MiB through the echo, our SETTINGS without MAX_FRAME_SIZE (16384 applies)",
        "the h2 crate splits DATA at the peer's max frame size",
        "PASS if the echo is intact and no frame exceeds 16384 bytes",
        frame_size,
    ),
    Check(
        "h2.ping",
        "PING is answered",
        "PING with an 8-byte payload",
        "the h2 crate ACKs every PING with its payload",
        "PASS if a PING ACK with the same payload arrives",
        ping,
    ),
    Check(
        "h2.keepalive",
        "the target PINGs an idle connection",
        "nothing, for 25 s; we ACK every PING",
        "PING every 10 s, the first after 10 s; no ACK in 20 s drops the connection (src/proxy/h2.rs::do_ping_pong)",
        "PASS if a PING arrives within 25 s; DIFF if none (keepalive is the server's choice)",
        keepalive,
        background=True,
    ),
    Check(
        "connect.ok",
        "CONNECT to the echo service is answered 200",
        "HEADERS :method CONNECT, :authority <--authority>",
        "200 once the upstream app is connected (src/proxy/inbound.rs::serve_connect)",
        "PASS on 200",
        connect_ok,
    ),
    refusal_check(
        "connect.no_authority",
        "CONNECT without :authority is refused",
        [(":method", "CONNECT")],
        "HEADERS :method CONNECT only",
        "status 400",
        "src/proxy.rs HboneAddress::try_from: NoValidAuthority -> 400",
    ),
    refusal_check(
        "connect.authority_without_port",
        "CONNECT to a host without a port is refused",
        [(":method", "CONNECT"), (":authority", "10.0.0.1")],
        "HEADERS :method CONNECT, :authority 10.0.0.1",
        "status 400",
        "src/proxy.rs HboneAddress::try_from: NoValidAuthority -> 400",
    ),
    refusal_check(
        "connect.authority_invalid",
        "CONNECT with an unparsable :authority is refused",
        [(":method", "CONNECT"), (":authority", "10.0.0.1 :8080")],
        "HEADERS :method CONNECT, :authority '10.0.0.1 :8080' (a space)",
        _RST_PROTOCOL,
        _H2_MALFORMED + " (malformed authority)",
    ),
    refusal_check(
        "connect.scheme_and_path",
        "CONNECT with :scheme and :path is refused",
        [(":method", "CONNECT"), (":scheme", "https"), (":path", "/"), (":authority", "{authority}")],
        "HEADERS :method CONNECT, :scheme https, :path /, :authority <--authority> (extended-CONNECT pseudo-headers "
        "without :protocol)",
        _RST_PROTOCOL,
        _H2_MALFORMED + " (':scheme in CONNECT')",
    ),
    refusal_check(
        "connect.unknown_pseudo_header",
        "an unknown pseudo-header is refused",
        [(":method", "CONNECT"), (":authority", "{authority}"), (":tunnel", "1")],
        "HEADERS :method CONNECT, :authority <--authority>, :tunnel 1",
        f"GOAWAY {error_name(PROTOCOL_ERROR)}",
        "h2 crate src/frame/headers.rs: an unknown pseudo-header fails the header block, a connection error; "
        "seen against upstream 62d8265",
    ),
    refusal_check(
        "connect.connection_header",
        "a connection-specific header is refused",
        [(":method", "CONNECT"), (":authority", "{authority}"), ("connection", "keep-alive")],
        "HEADERS :method CONNECT, :authority <--authority>, connection: keep-alive",
        _RST_PROTOCOL,
        "h2 crate src/frame/headers.rs: connection-specific headers are malformed (RFC 9113 §8.2.2)",
    ),
    refusal_check(
        "connect.get",
        "a GET is refused",
        [(":method", "GET"), (":scheme", "https"), (":path", "/"), (":authority", "{authority}")],
        "HEADERS :method GET, :scheme https, :path /, :authority <--authority>",
        "status 400",
        "src/proxy/inbound.rs::build_inbound_request: NonConnectMethod -> 400",
    ),
    refusal_check(
        "connect.post",
        "a POST is refused",
        [(":method", "POST"), (":scheme", "https"), (":path", "/"), (":authority", "{authority}")],
        "HEADERS :method POST, :scheme https, :path /, :authority <--authority>",
        "status 400",
        "src/proxy/inbound.rs::build_inbound_request: NonConnectMethod -> 400",
    ),
    Check(
        "data.echo_half_close",
        "data both ways, and the reply survives our half-close",
        "256 KiB, then (once some echo is back) an empty DATA with END_STREAM",
        "END_STREAM becomes a FIN to the app, the other direction stays open (src/proxy/h2.rs, poll_shutdown)",
        "PASS if all bytes come back intact followed by END_STREAM",
        echo_half_close,
    ),
    Check(
        "flow.window_refill",
        "the target refills its receive window",
        "3x the target's stream window (at most 16 MiB) through the echo, reading as it comes",
        "received DATA is released to flow control as soon as it is read (src/proxy/h2.rs::poll_bytes)",
        "PASS if everything comes back intact",
        window_refill,
    ),
    Check(
        "flow.stalled_reader",
        "a stalled reader is never overrun, and loses nothing",
        "1 MiB through the echo with our stream window at 65535 and no WINDOW_UPDATE; then the whole window",
        "the h2 crate sends within the peer's window and buffers the rest (max_send_buffer_size 400 KiB)",
        "FAIL if more than 65535 bytes arrive before we release, or if the echo is not intact after",
        stalled_reader,
    ),
    Check(
        "flow.stalled_stream_isolated",
        "a stalled stream does not stall the connection",
        "stream A stalled at its 65535-byte window, then 32 KiB through the echo on stream B",
        "stream windows are per stream; the connection window (16 MiB) is ours to grant",
        "PASS if stream B's echo is intact",
        stalled_isolated,
    ),
    Check(
        "streams.rst_cancel",
        "RST_STREAM CANCEL ends one tunnel, not the connection",
        "a tunnel, 1 KiB, RST_STREAM CANCEL; then a new tunnel on the same connection",
        "RST_STREAM NO_ERROR/CANCEL is the end of that stream's input (src/proxy/h2.rs::poll_bytes)",
        "PASS if the connection stays up and the new tunnel echoes",
        rst_cancel,
    ),
    Check(
        "streams.goaway_from_client",
        "a client's GOAWAY does not cut its open tunnel",
        "a tunnel, 64 KiB, GOAWAY(last_stream_id 0, NO_ERROR), 64 KiB more and END_STREAM",
        "upstream (the h2 crate) may end the connection after a client's GOAWAY before the open tunnel's last bytes "
        "(seen against upstream 62d8265: cut at 117760 of 131072 bytes in one run, intact in the next); its own "
        "client sends GOAWAY only once its streams are done",
        "PASS if all 128 KiB come back intact followed by END_STREAM, as RFC 9113 §6.8 has it (GOAWAY limits only "
        "the streams its receiver may open); DIFF if the tunnel is cut, as upstream does",
        goaway_from_client,
    ),
    Check(
        "streams.concurrent",
        "100 tunnels on one connection",
        "100 CONNECTs (upstream's POOL_MAX_STREAMS_PER_CONNECTION), then 16 KiB through each",
        "upstream's client puts up to 100 streams on one connection; its server allows 200",
        "PASS if every tunnel opens and echoes its own bytes",
        concurrent_streams,
    ),
    Check(
        "streams.over_limit",
        "a stream beyond SETTINGS_MAX_CONCURRENT_STREAMS is refused",
        "as many CONNECTs as the target advertised, then one more",
        "the h2 crate refuses it with RST_STREAM REFUSED_STREAM",
        "PASS on RST_STREAM REFUSED_STREAM; DIFF on RST_STREAM PROTOCOL_ERROR or GOAWAY; FAIL if it opens",
        over_limit,
    ),
]
