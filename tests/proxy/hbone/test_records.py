"""The TLS 1.3 record layer of ztunnel's own (ztunnel/proxy/hbone/records.py), with OpenSSL as the oracle.

Each test runs a real handshake between two ``ssl.SSLObject``s over memory BIOs (the contexts ztunnel builds), takes
the traffic secrets OpenSSL reports, and hands one or both sides to :class:`TlsRecords`: what it seals, OpenSSL must
open, and what OpenSSL seals (application data, KeyUpdate, close_notify, alerts, tickets), it must open.
"""

from __future__ import annotations

import contextlib
import ssl
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import pytest

from ztunnel import tls
from ztunnel.identity.ca import LocalCA
from ztunnel.identity.spiffe import Identity
from ztunnel.proxy.hbone.records import KEY_UPDATE_AFTER, MAX_PLAINTEXT, RecordError, TlsRecords

TD = "cluster.local"


@dataclass
class End:
    obj: ssl.SSLObject
    inc: ssl.MemoryBIO
    out: ssl.MemoryBIO
    secrets: dict[bytes, bytes]


def _handshake(suite: str | None = None, *, capture: bool = True) -> tuple[End, End]:
    ca = LocalCA.generate(TD)
    ccert = ca.issue(Identity(TD, "ns", "client"), timedelta(hours=1))
    scert = ca.issue(Identity(TD, "ns", "server"), timedelta(hours=1))
    cctx = tls.client_context(ccert, secrets=True)
    sctx = tls.server_context(scert, secrets=True)
    if suite is not None:
        tls.set_tls13_ciphersuites(cctx, [suite])
    ends: list[End] = []
    for ctx, server_side in ((cctx, False), (sctx, True)):
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(inc, out, server_side=server_side, server_hostname=None)
        ends.append(End(obj, inc, out, {}))
    client, server = ends
    for _ in range(6):
        for end in (client, server):
            tls.capture_traffic_secrets(end.secrets if capture else None)
            try:
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.obj.do_handshake()
            finally:
                tls.capture_traffic_secrets(None)
        server.inc.write(client.out.read())
        client.inc.write(server.out.read())
    assert client.obj.version() == server.obj.version() == "TLSv1.3"
    return client, server


def _records(end: End, client_side: bool) -> TlsRecords:
    c, s = end.secrets[b"CLIENT_TRAFFIC_SECRET_0"], end.secrets[b"SERVER_TRAFFIC_SECRET_0"]
    suite = end.obj.cipher()
    assert suite is not None
    rec = TlsRecords(suite[0], s if client_side else c, c if client_side else s, client_side=client_side)
    leftover = end.inc.read()  # records that came after the handshake's last flight
    if leftover:
        rec.incoming.write(leftover)
    return rec


def _read_all(rec: TlsRecords, size: int = 1 << 20) -> bytes:
    out = bytearray()
    buf = memoryview(bytearray(size))
    while True:
        try:
            n = rec.read(size, buf)
        except ssl.SSLWantReadError:
            return bytes(out)
        out += buf[:n]


def _openssl_read(end: End) -> bytes:
    out = bytearray()
    while True:
        try:
            out += end.obj.read(1 << 20)
        except ssl.SSLWantReadError:
            return bytes(out)


def test_handshakes_report_both_traffic_secrets_only_while_capturing() -> None:
    client, server = _handshake()
    assert set(client.secrets) == set(server.secrets) == {b"CLIENT_TRAFFIC_SECRET_0", b"SERVER_TRAFFIC_SECRET_0"}
    assert client.secrets == server.secrets  # both ends derived the same
    assert all(len(v) == 48 for v in client.secrets.values())  # SHA-384: TLS_AES_256_GCM_SHA384 first
    # A handshake run with no dict set reports nothing, to the last dict set or anywhere (and does not fail).
    earlier: dict[bytes, bytes] = {}
    tls.capture_traffic_secrets(earlier)
    tls.capture_traffic_secrets(None)
    client, server = _handshake(capture=False)
    assert earlier == {} and client.secrets == server.secrets == {}


@pytest.mark.parametrize("suite", ["TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256"])
@pytest.mark.parametrize("size", [0, 1, 100, MAX_PLAINTEXT, MAX_PLAINTEXT + 1, 3 * MAX_PLAINTEXT + 7, 1 << 20])
def test_sealed_records_open_in_openssl_and_back(suite: str, size: int) -> None:
    client, server = _handshake(suite)
    assert client.obj.cipher()[0] == suite  # type: ignore[index]
    ours = _records(client, client_side=True)
    payload = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    assert ours.write(payload) == size
    wire = b"".join(ours.outgoing.read())
    assert ours.outgoing.pending == 0 and ours.outgoing.read() == []
    # Records of at most 2^14 plaintext bytes, each its header + content + type + tag.
    pos, count = 0, 0
    while pos < len(wire):
        ctype, version, length = struct.unpack_from(">BHH", wire, pos)
        assert (ctype, version) == (23, 0x0303) and length <= MAX_PLAINTEXT + 17
        pos += 5 + length
        count += 1
    assert count == -(-size // MAX_PLAINTEXT)
    server.inc.write(wire)
    assert _openssl_read(server) == payload
    # And OpenSSL's records open here, split across reads however they arrive.
    server.obj.write(payload[::-1] + b"end")
    back = server.out.read()
    got = bytearray()
    for i in range(0, len(back), 7000):
        ours.incoming.write(back[i : i + 7000])
        got += _read_all(ours, 5000)  # a buffer smaller than a record: the rest is held (pending)
    assert bytes(got) == payload[::-1] + b"end"
    assert ours.pending() == 0 and ours.incoming.pending == 0


def test_both_ends_ours_and_a_small_buffer_holds_the_rest() -> None:
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    a.write(b"x" * 20000)
    b.incoming.write(b"".join(a.outgoing.read()))
    buf = memoryview(bytearray(100))
    assert b.read(100, buf) == 100
    assert b.pending() == MAX_PLAINTEXT - 100  # the rest of the first record
    total = 100 + len(_read_all(b, 100))
    assert total == 20000 and b.pending() == 0


def test_key_update_from_openssl_both_ways() -> None:
    client, server = _handshake()
    ours = _records(client, client_side=True)
    server.obj.write(b"one")
    ours.incoming.write(server.out.read())
    assert _read_all(ours) == b"one"
    # The server updates its keys and asks for ours (SSL_key_update, which Python's ssl lacks, through libssl): we
    # move our read keys, answer with a KeyUpdate of our own and move our write keys.
    _key_update(server.obj, requested=True)
    server.obj.write(b"two")
    ours.incoming.write(server.out.read())
    assert _read_all(ours) == b"two"
    assert ours.outgoing.pending  # our KeyUpdate, queued before any application data
    ours.write(b"after")
    server.inc.write(b"".join(ours.outgoing.read()))
    assert _openssl_read(server) == b"after"
    # An update OpenSSL makes unasked, then data: read with the new keys, nothing sent back.
    _key_update(server.obj, requested=False)
    server.obj.write(b"three")
    ours.incoming.write(server.out.read())
    assert _read_all(ours) == b"three" and not ours.outgoing.pending


def _key_update(obj: ssl.SSLObject, *, requested: bool) -> None:
    import ctypes

    lib = tls._libssl()
    lib.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.SSL_key_update.restype = ctypes.c_int
    sslobj = obj._sslobj  # type: ignore[attr-defined]
    # PySSLSocket: {PyObject_HEAD; PyObject *Socket; SSL *ssl; ...}
    pointer = ctypes.c_void_p.from_address(id(sslobj) + object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)).value
    assert lib.SSL_key_update(pointer, 1 if requested else 0) == 1


def test_our_own_key_update_before_the_aes_gcm_limit() -> None:
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    # As if ~16.7 million records went out under this key (OpenSSL cannot be moved there: both ends ours).
    a._write.seq = b._read.seq = KEY_UPDATE_AFTER - 2
    first = a._write.aead
    a.write(b"a" * (3 * MAX_PLAINTEXT))  # would cross the limit: a KeyUpdate first, then these under the new key
    assert a._write.aead is not first and a._write.seq == 3
    b.incoming.write(b"".join(a.outgoing.read()))
    assert _read_all(b) == b"a" * (3 * MAX_PLAINTEXT)
    assert b._read.seq == 3 and not b.outgoing.pending  # not requested: no answer


def test_close_notify_both_ways_and_data_before_it_first() -> None:
    client, server = _handshake()
    ours = _records(client, client_side=True)
    server.obj.write(b"last words")
    with contextlib.suppress(ssl.SSLWantReadError):  # data and close_notify arrive in one read
        server.obj.unwrap()
    ours.incoming.write(server.out.read())
    buf = memoryview(bytearray(100))
    assert ours.read(100, buf) == 10 and bytes(buf[:10]) == b"last words"
    assert ours.closed_by_peer
    assert ours.read(100, buf) == 0  # as OpenSSL's read: 0 after close_notify, and it stays so
    ours.incoming.write(b"\x17\x03\x03\x00\x20" + b"\0" * 32)  # whatever follows is not read
    assert ours.read(100, buf) == 0
    # Ours to OpenSSL.
    client, server = _handshake()
    ours = _records(client, client_side=True)
    ours.write(b"bye")
    ours.close_notify()
    server.inc.write(b"".join(ours.outgoing.read()))
    assert server.obj.read(100) == b"bye"
    assert server.obj.read(100) == b""  # OpenSSL's EOF after a close_notify


def test_broken_records_are_errors_that_end_the_layer() -> None:
    client, server = _handshake()
    ours = _records(client, client_side=True)
    server.obj.write(b"hello")
    wire = bytearray(server.out.read())
    wire[-1] ^= 1  # the tag
    ours.incoming.write(wire)
    with pytest.raises(RecordError, match="DECRYPTION_FAILED_OR_BAD_RECORD_MAC") as err:
        ours.read(100, memoryview(bytearray(100)))
    assert err.value.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
    with pytest.raises(RecordError):  # nothing after that is read
        ours.read(100, memoryview(bytearray(100)))

    for bad, message in (
        (b"\x16\x03\x03\x00\x05hello", "UNEXPECTED_RECORD: TLS record type 22"),
        (b"\x17\x03\x03" + struct.pack(">H", MAX_PLAINTEXT + 257) + b"\0" * 10, "ENCRYPTED_LENGTH_TOO_LONG"),
        (b"\x17\x03\x03\x00\x10" + b"\0" * 16, "BAD_LENGTH"),
    ):
        client, server = _handshake()
        ours = _records(client, client_side=True)
        ours.incoming.write(bad)
        with pytest.raises(RecordError, match=message):
            ours.read(100, memoryview(bytearray(100)))


def test_an_incomplete_record_waits_for_the_rest() -> None:
    client, server = _handshake()
    ours = _records(client, client_side=True)
    server.obj.write(b"0123456789")
    wire = server.out.read()
    ours.incoming.write(wire[:4])
    with pytest.raises(ssl.SSLWantReadError):
        ours.read(100, memoryview(bytearray(100)))
    ours.incoming.write(wire[4:-1])
    with pytest.raises(ssl.SSLWantReadError):
        ours.read(100, memoryview(bytearray(100)))
    ours.incoming.write(wire[-1:])
    assert _read_all(ours) == b"0123456789"


def test_alerts_and_unexpected_messages() -> None:
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(b"\x02\x28"), 21)  # a fatal handshake_failure alert
    a.incoming.write(b"".join(b.outgoing.read()))
    with pytest.raises(RecordError, match=r"^SSLV3_ALERT_HANDSHAKE_FAILURE$"):
        _read_all(a)
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(b"\x01\x5a"), 21)  # user_canceled: a warning, ignored
    b.write(b"still here")
    a.incoming.write(b"".join(b.outgoing.read()))
    assert _read_all(a) == b"still here"
    # A NewSessionTicket is ignored by a client, refused by a server; a CertificateRequest by both.
    ticket = b"\x04\x00\x00\x02\xab\xcd"
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(ticket), 22)
    b.write(b"data")
    a.incoming.write(b"".join(b.outgoing.read()))
    assert _read_all(a) == b"data"
    a._seal(memoryview(ticket), 22)
    b.incoming.write(b"".join(a.outgoing.read()))
    with pytest.raises(RecordError, match="UNEXPECTED_MESSAGE: post-handshake message 4"):
        _read_all(b)
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(b"\x0d\x00\x00\x00"), 22)
    a.incoming.write(b"".join(b.outgoing.read()))
    with pytest.raises(RecordError, match="UNEXPECTED_MESSAGE: post-handshake message 13"):
        _read_all(a)
    # A message split over two records is put together.
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(ticket[:3]), 22)
    b._seal(memoryview(ticket[3:]), 22)
    b.write(b"ok")
    a.incoming.write(b"".join(b.outgoing.read()))
    assert _read_all(a) == b"ok"
    # Padding after the content type is allowed (RFC 8446 §5.4); a record of zeros only is not.
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    a.incoming.write(_sealed_by_hand(b, b"padded" + b"\x17" + b"\0" * 100))
    assert _read_all(a) == b"padded"
    a.incoming.write(_sealed_by_hand(b, b"\0" * 20))
    with pytest.raises(RecordError, match="NO_CONTENT_TYPE"):
        _read_all(a)
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    a.incoming.write(_sealed_by_hand(b, b"x\x63"))  # content type 99
    with pytest.raises(RecordError, match="UNEXPECTED_RECORD: TLS content type 99"):
        _read_all(a)


def _sealed_by_hand(sender: TlsRecords, inner: bytes) -> bytes:
    """One record of ``inner`` (TLSInnerPlaintext: content, type, padding) under ``sender``'s write keys."""
    keys = sender._write
    header = bytes((23, 3, 3)) + struct.pack(">H", len(inner) + 16)
    return header + keys.aead.encrypt(keys.nonce(), inner, header)


def test_a_borrowed_read_is_opened_in_place_and_only_a_cut_record_is_kept() -> None:
    client, server = _handshake()
    ours = _records(client, client_side=True)
    server.obj.write(b"a" * 100)
    server.obj.write(b"b" * 100)
    wire = server.out.read()
    cut = len(wire) - 50  # the second record cut by the end of the "socket read"
    socket_buffer = bytearray(wire[:cut])
    inb = ours.incoming
    inb.pending += cut
    inb.src, inb.spos = memoryview(socket_buffer), 0  # what HboneTransport.buffer_updated does
    out = memoryview(bytearray(1000))
    assert ours.read(1000, out) == 100 and bytes(out[:100]) == b"a" * 100
    assert inb.pending == cut - (5 + 100 + 1 + 16)
    with pytest.raises(ssl.SSLWantReadError):
        ours.read(1000, out)
    inb.keep()  # the cut record copied out: the transport may read into its buffer again
    assert cast(Any, inb).src is None  # (mypy keeps the type the test assigned above)
    assert bytes(inb.buf) == wire[5 + 117 : cut]
    socket_buffer[:] = b"\xff" * len(socket_buffer)
    ours.incoming.write(wire[cut:])
    assert ours.read(1000, out) == 100 and bytes(out[:100]) == b"b" * 100
    assert inb.pending == 0 and not inb.buf


def test_a_seal_that_fails_half_way_never_reuses_a_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    keys = a._write
    real = keys.aead
    nonces: list[bytes] = []

    class Failing:
        def encrypt(self, nonce: bytes, data: Any, aad: Any) -> bytes:
            nonces.append(nonce)
            if len(nonces) == 2:
                raise MemoryError("injected")
            return real.encrypt(nonce, data, aad)

    keys.aead = Failing()  # type: ignore[assignment]
    with pytest.raises(MemoryError):
        a.write(b"x" * (3 * MAX_PLAINTEXT))  # the second of three records fails
    keys.aead = real
    a.write(b"next")
    assert len(set(nonces)) == len(nonces) == 2 and keys.seq == 3  # the failed record's nonce is not used again
    # What was queued is whole records only: the first (sealed before the failure) and "next".
    b._read.seq = 0
    b.incoming.write(b"".join(a.outgoing.read()))
    with pytest.raises(RecordError, match="DECRYPTION_FAILED"):  # "next" went out under seq 2, never seq 1
        _read_all(b)


def test_post_handshake_messages_are_judged_at_their_header() -> None:
    # A message announcing 16 MiB is refused before its body is held (a peer could make us hold it otherwise).
    for header, side, match in (
        (b"\x18\x00\x00\x02", True, "BAD_KEY_UPDATE"),  # KeyUpdate is one byte
        (b"\x04\xff\xff\xff", True, "NewSessionTicket too long"),
        (b"\x04\x00\x00\x10", False, "UNEXPECTED_MESSAGE"),  # a server never receives tickets
        (b"\x0d\xff\xff\xff", True, "UNEXPECTED_MESSAGE"),
    ):
        client, server = _handshake()
        a, b = _records(client, client_side=True), _records(server, client_side=False)
        reader, writer = (a, b) if side else (b, a)
        writer._seal(memoryview(header), 22)
        reader.incoming.write(b"".join(writer.outgoing.read()))
        with pytest.raises(RecordError, match=match):
            _read_all(reader)
        assert len(reader._handshake) <= 4
    # A KeyUpdate with more handshake data after it in its record (§5.1), one asking for 2, an empty record.
    for body, match in (
        (b"\x18\x00\x00\x01\x00\x04\x00", "NOT_ON_RECORD_BOUNDARY"),
        (b"\x18\x00\x00\x01\x02", "BAD_KEY_UPDATE"),
        (b"", "BAD_LENGTH"),
    ):
        client, server = _handshake()
        a, b = _records(client, client_side=True), _records(server, client_side=False)
        a.incoming.write(_sealed_by_hand(b, body + b"\x16"))
        with pytest.raises(RecordError, match=match):
            _read_all(a)
    # Application data in between the fragments of a handshake message.
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    b._seal(memoryview(b"\x04\x00\x00\x02\xab"), 22)
    b.write(b"data")
    a.incoming.write(b"".join(b.outgoing.read()))
    with pytest.raises(RecordError, match="MIXED_HANDSHAKE_AND_NON_HANDSHAKE_DATA"):
        _read_all(a)


def test_content_over_two_to_the_fourteen_and_long_padding() -> None:
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    a.incoming.write(_sealed_by_hand(b, b"x" * (MAX_PLAINTEXT + 1) + b"\x17"))  # fits the ciphertext limit
    with pytest.raises(RecordError, match="DATA_LENGTH_TOO_LONG"):
        _read_all(a)
    # 1 byte and 16 KiB of padding: found without a byte loop in Python, and the byte delivered.
    client, server = _handshake()
    a, b = _records(client, client_side=True), _records(server, client_side=False)
    for _ in range(50):
        a.incoming.write(_sealed_by_hand(b, b"z\x17" + b"\0" * (MAX_PLAINTEXT - 1)))
    assert _read_all(a) == b"z" * 50


def test_a_server_that_sends_tickets_keeps_openssl_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tickets sealed inside the handshake under the server's first write key would make our first record reuse its
    sequence number 0: such a server keeps OpenSSL's record layer (ztunnel's server contexts send none), and a client
    of ours reads the tickets and ignores them."""
    from tests.proxy.hbone.test_pump import _built

    ca = LocalCA.generate(TD)
    assert tls.server_context(ca.issue(Identity(TD, "ns", "s"), timedelta(hours=1)), secrets=True).num_tickets == 0
    made = tls.server_context

    def with_tickets(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        ctx = made(*args, **kwargs)
        ctx.num_tickets = 2
        return ctx

    monkeypatch.setattr(tls, "server_context", with_tickets)
    links = _built(None, True)
    link = next(links)
    try:
        assert link.server._records is None and link.client._records is not None
        link.app_sends(b"to the server")
        link.pump()
        assert link.server_app.take() == b"to the server"
        assert not link.client.closed and not link.server.closed
    finally:
        next(links, None)
