"""The TLS 1.3 record layer of an HBONE connection after its handshake, with cryptography's AES-GCM (sans-IO).

Why: Python's ``ssl`` protects records with the OpenSSL it is linked against, through memory BIOs. On these
machines that is OpenSSL 3.0, whose AES-256-GCM runs at ~3.2 GB/s per core for 16 KiB records (``openssl speed``),
and every byte is copied into a BIO and out of it again on each side. The ``cryptography`` wheel carries its own,
newer OpenSSL (4.0 here), whose AES-GCM uses VAES/AVX-512: ``AESGCM.encrypt`` seals a 16 KiB record at ~8.7 GB/s
into a new ``bytes`` (not zeroed first) that goes to the transport as it is, and ``decrypt_into`` opens a record
straight from the socket read into the HTTP/2 receive buffer. OpenSSL (the ``ssl`` module) still does the whole
handshake, the certificate checks and everything before the first application record; this module takes over only
the record protection of RFC 8446 §5.2-5.5 from there on, with the traffic secrets OpenSSL reports through its
key-log callback (``ztunnel.tls.report_traffic_secrets``) - what kernel TLS does with the keys a TLS library
negotiated. Per Gbit that is a third less user-space CPU for the proxies; per small record a few Python lines
around each AEAD call cost more than OpenSSL's C loop (+5-10 % per 64 B round trip, measured: docs/performance.md).

Bytes in, bytes out: received ciphertext goes into :attr:`TlsRecords.incoming` (``write``, ``pending``, like an
``ssl.MemoryBIO``), :meth:`TlsRecords.read` decrypts whole records into the caller's buffer; :meth:`TlsRecords.write`
seals plaintext into :attr:`TlsRecords.outgoing` (``read``, ``pending``). ``read``/``write``/``pending`` behave like
those of the ``_ssl._SSLObject`` they replace (``ssl.SSLWantReadError`` when no whole record is there, 0 once the
peer sent close_notify, an ``ssl.SSLError`` for anything broken), so the connection's read loop serves both.

What the layer does besides application data (RFC 8446): KeyUpdate received (the read key moves on; a requested
update is answered with our own, then the write key moves on), KeyUpdate sent by itself before 2^24 records under
one key (§5.5 allows AES-GCM ~2^24.5), NewSessionTicket ignored on the client side, close_notify sent and received,
other alerts, unknown content types, oversized records, records that do not authenticate, and handshake messages it
does not expect are errors that end the connection.
"""

from __future__ import annotations

import ssl
import struct
from typing import Final, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from ztunnel.errors import ZtunnelError

__all__ = ["AVAILABLE", "SUITES", "InBuffer", "OutBuffer", "RecordError", "TlsRecords", "hkdf_expand_label"]

MAX_PLAINTEXT: Final = 1 << 14  # RFC 8446 §5.1: TLSInnerPlaintext.content at most 2^14 bytes
MAX_CIPHERTEXT: Final = MAX_PLAINTEXT + 256  # §5.2: a record's length at most 2^14 + 256
TAG: Final = 16
# §5.5: AES-GCM may protect up to 2^24.5 full-size records under one key; a new write key well before that.
KEY_UPDATE_AFTER: Final = 1 << 24

APPLICATION_DATA: Final = 23
HANDSHAKE: Final = 22
ALERT: Final = 21
NEW_SESSION_TICKET: Final = 4
KEY_UPDATE: Final = 24
CLOSE_NOTIFY: Final = 0
USER_CANCELED: Final = 90
MAX_TICKET: Final = 1 << 17  # a NewSessionTicket larger than this is refused, as OpenSSL does (~128 KiB)

# RFC 8446 §6 alert descriptions by the names OpenSSL's record layer gives them.
_ALERTS: Final = {
    10: "SSLV3_ALERT_UNEXPECTED_MESSAGE",
    20: "SSLV3_ALERT_BAD_RECORD_MAC",
    22: "TLSV1_ALERT_RECORD_OVERFLOW",
    40: "SSLV3_ALERT_HANDSHAKE_FAILURE",
    42: "SSLV3_ALERT_BAD_CERTIFICATE",
    43: "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    44: "SSLV3_ALERT_CERTIFICATE_REVOKED",
    45: "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    46: "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    47: "SSLV3_ALERT_ILLEGAL_PARAMETER",
    48: "TLSV1_ALERT_UNKNOWN_CA",
    49: "TLSV1_ALERT_ACCESS_DENIED",
    50: "TLSV1_ALERT_DECODE_ERROR",
    51: "TLSV1_ALERT_DECRYPT_ERROR",
    70: "TLSV1_ALERT_PROTOCOL_VERSION",
    71: "TLSV1_ALERT_INSUFFICIENT_SECURITY",
    80: "TLSV1_ALERT_INTERNAL_ERROR",
    86: "TLSV1_ALERT_INAPPROPRIATE_FALLBACK",
    109: "TLSV13_ALERT_MISSING_EXTENSION",
    110: "TLSV1_ALERT_UNSUPPORTED_EXTENSION",
    112: "TLSV1_ALERT_UNRECOGNIZED_NAME",
    116: "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    120: "TLSV1_ALERT_NO_APPLICATION_PROTOCOL",
}

# The TLS 1.3 suites ztunnel offers (ztunnel.tls.TLS13_CIPHERSUITES), by OpenSSL's name: hash and AES key length.
SUITES: Final[dict[str, tuple[type[hashes.HashAlgorithm], int]]] = {
    "TLS_AES_256_GCM_SHA384": (hashes.SHA384, 32),
    "TLS_AES_128_GCM_SHA256": (hashes.SHA256, 16),
}

# decrypt_into (opening a record straight into the HTTP/2 buffer) is in recent cryptography releases (the image pins
# 50.0.2); without it HBONE connections keep OpenSSL's record layer (ztunnel.proxy.common.TlsContextCache).
AVAILABLE: Final = hasattr(AESGCM, "decrypt_into")

_HEADER: Final = struct.Struct("!BHH").pack  # content type, legacy version 0x0303, length
_FULL_HEADER: Final = _HEADER(APPLICATION_DATA, 0x0303, MAX_PLAINTEXT + 1 + TAG)


class RecordError(ssl.SSLError, ZtunnelError):
    """A record this layer cannot accept (the connection ends): an ``ssl.SSLError`` with a ``reason``, as the
    connection reports OpenSSL's (and a ZtunnelError, as every error the project defines)."""

    def __init__(self, reason: str) -> None:
        super().__init__(1, reason)
        self.reason = reason
        self.library = "ztunnel"


def hkdf_expand_label(algorithm: hashes.HashAlgorithm, secret: bytes, label: bytes, length: int) -> bytes:
    """RFC 8446 §7.1 HKDF-Expand-Label with an empty context (all that §7.2-7.3 need here)."""
    full = b"tls13 " + label
    info = struct.pack("!HB", length, len(full)) + full + b"\x00"
    return HKDFExpand(algorithm, length, info).derive(secret)


class _Keys:
    """One direction's traffic keys (§7.3): the AEAD, its IV as an integer and the record sequence number."""

    __slots__ = ("aead", "algorithm", "iv", "key_length", "secret", "seq")

    def __init__(self, algorithm: hashes.HashAlgorithm, key_length: int, secret: bytes) -> None:
        self.algorithm = algorithm
        self.key_length = key_length
        self.secret = secret
        self.aead = AESGCM(hkdf_expand_label(algorithm, secret, b"key", key_length))
        self.iv = int.from_bytes(hkdf_expand_label(algorithm, secret, b"iv", 12), "big")
        self.seq = 0

    def nonce(self) -> bytes:
        """§5.3: the IV XORed with the 64-bit sequence number, which then moves on (never used twice)."""
        nonce = (self.iv ^ self.seq).to_bytes(12, "big")
        self.seq += 1
        return nonce

    def updated(self) -> _Keys:
        """§7.2: the next generation's keys (application_traffic_secret_N+1)."""
        alg = self.algorithm
        return _Keys(alg, self.key_length, hkdf_expand_label(alg, self.secret, b"traffic upd", alg.digest_size))


class InBuffer:
    """Received ciphertext not yet decrypted: ``write`` and ``pending`` as ``ssl.MemoryBIO``'s, and a socket read
    lent in place (``src``, set by ``HboneTransport.buffer_updated`` when nothing is held, with ``pending`` raised by
    its size): its records are opened straight from the transport's buffer, and :meth:`keep` copies only the tail of
    a record the read cut, before that buffer is read into again (ciphertext went into a BIO whole)."""

    __slots__ = ("buf", "pending", "pos", "spos", "src")

    def __init__(self) -> None:
        self.buf = bytearray()  # held bytes (a record cut by the end of a read, or what write() gave)
        self.pos = 0  # bytes of buf already taken
        self.src: memoryview | None = None  # a borrowed read, until keep()
        self.spos = 0  # bytes of src already taken
        self.pending = 0  # bytes not yet taken, of both (an attribute: the pump reads it per chunk)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.buf += data
        self.pending += len(data)
        return len(data)

    def keep(self) -> None:
        """Copy what is left of the borrowed view (a record it ends inside of) and let the view go."""
        src = self.src
        if src is not None:
            if self.spos < len(src):
                self.buf += src[self.spos :]
            self.src = None


class OutBuffer:
    """Sealed records not yet sent: ``pending`` as ``ssl.MemoryBIO``'s, and :meth:`read`, which hands over the list
    of their parts (each record's 5-byte header and ciphertext, in order) for the transport's ``writelines``: no
    record is copied into a larger buffer (a fresh 1 MiB buffer per write cost page faults and a memset, measured)."""

    __slots__ = ("chunks", "pending")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.pending = 0

    def read(self) -> list[bytes]:
        chunks = self.chunks
        if chunks:
            self.chunks = []
            self.pending = 0
        return chunks


class TlsRecords:
    """The record layer of one TLS 1.3 connection from the first application record on (see the module)."""

    __slots__ = (
        "_client_side",
        "_end",
        "_handshake",
        "_held",
        "_read",
        "_stage",
        "_stage_view",
        "_write",
        "closed_by_peer",
        "incoming",
        "outgoing",
    )

    def __init__(self, suite: str, read_secret: bytes, write_secret: bytes, *, client_side: bool) -> None:
        try:
            hash_type, key_length = SUITES[suite]
        except KeyError:
            raise ValueError(f"no record layer for the TLS 1.3 suite {suite!r}") from None
        algorithm = hash_type()
        self.incoming = InBuffer()
        self.outgoing = OutBuffer()
        self._read = _Keys(algorithm, key_length, read_secret)
        self._write = _Keys(algorithm, key_length, write_secret)
        self._held: memoryview | None = None  # decrypted application data the last read had no room for
        self._handshake = bytearray()  # a post-handshake message still arriving
        self._client_side = client_side
        self._stage = bytearray(MAX_PLAINTEXT + 1)  # a record's plaintext and its content type, being sealed
        self._stage_view = memoryview(self._stage)
        self._end: ssl.SSLError | None = None  # what every read raises once the peer broke the layer
        self.closed_by_peer = False  # close_notify received: every read returns 0, as OpenSSL's

    # -- sending -------------------------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Seal ``data`` as application data, in records of at most 2^14 bytes; returns ``len(data)``."""
        n = len(data)
        keys = self._write
        seq = keys.seq
        if 0 < n < MAX_PLAINTEXT and seq < KEY_UPDATE_AFTER - 1:
            # One record (interactive traffic, HTTP/2 control frames): _seal's work without its loop.
            stage = self._stage
            stage[:n] = data
            stage[n] = APPLICATION_DATA
            header = _HEADER(APPLICATION_DATA, 0x0303, n + 1 + TAG)
            keys.seq = seq + 1
            out = self.outgoing
            sealed = keys.aead.encrypt((keys.iv ^ seq).to_bytes(12, "big"), self._stage_view[: n + 1], header)
            out.chunks += (header, sealed)
            out.pending += n + 5 + 1 + TAG
        elif n:
            self._seal(data if type(data) is memoryview else memoryview(data), APPLICATION_DATA)
        return n

    def close_notify(self) -> None:
        """Queue the close_notify alert (§6.1): nothing more is written after it."""
        self._seal(memoryview(bytes((1, CLOSE_NOTIFY))), ALERT)

    def _seal(self, view: memoryview, content_type: int) -> None:
        n = len(view)
        records = (n + MAX_PLAINTEXT - 1) >> 14
        if self._write.seq + records >= KEY_UPDATE_AFTER:
            self._update_write_keys()  # before these records, so they go out after the KeyUpdate
        keys = self._write
        encrypt = keys.aead.encrypt
        iv, seq = keys.iv, keys.seq
        stage, sv = self._stage, self._stage_view
        append = self.outgoing.chunks.append
        stage[MAX_PLAINTEXT] = content_type
        pos = 0
        # One record per 2^14 bytes: the plaintext and its content type staged (a copy of at most 16 KiB, which
        # the AEAD then reads from cache), sealed into a new bytes object (not zeroed first), header beside it.
        # The sequence number moves on before each encryption and is stored back whatever happens: a nonce is used
        # once even if sealing fails half way (a record is queued only once it is sealed whole).
        try:
            while n - pos >= MAX_PLAINTEXT:
                stage[:MAX_PLAINTEXT] = view[pos : pos + MAX_PLAINTEXT]
                nonce = (iv ^ seq).to_bytes(12, "big")
                seq += 1
                sealed = encrypt(nonce, sv, _FULL_HEADER)
                append(_FULL_HEADER)  # the outer type is always application_data (§5.2)
                append(sealed)
                pos += MAX_PLAINTEXT
            m = n - pos
            if m:
                stage[:m] = view[pos:]
                stage[m] = content_type
                header = _HEADER(APPLICATION_DATA, 0x0303, m + 1 + TAG)
                nonce = (iv ^ seq).to_bytes(12, "big")
                seq += 1
                sealed = encrypt(nonce, sv[: m + 1], header)
                append(header)
                append(sealed)
        finally:
            keys.seq = seq
        self.outgoing.pending += n + records * (5 + 1 + TAG)

    def _update_write_keys(self) -> None:
        """Send a KeyUpdate (§4.6.3, update_not_requested: the peer's keys are its own business) under the current
        write key, then move to the next one."""
        message = bytes((KEY_UPDATE, 0, 0, 1, 0, HANDSHAKE))  # the message, then its record's content type
        keys = self._write
        length = len(message) + TAG
        header = _HEADER(APPLICATION_DATA, 0x0303, length)
        self.outgoing.chunks += (header, keys.aead.encrypt(keys.nonce(), message, header))
        self.outgoing.pending += 5 + length
        self._write = keys.updated()

    # -- receiving -----------------------------------------------------------------------------------------------

    def pending(self) -> int:
        """Decrypted application data held for the next :meth:`read` (a record larger than the last buffer's
        room)."""
        held = self._held
        return len(held) if held is not None else 0

    def read(self, size: int, buffer: memoryview) -> int:
        """Decrypt whole records into ``buffer`` (up to ``size`` bytes of application data); returns the count,
        0 once the peer sent close_notify (the application data before it first), as the ``ssl`` module's read
        does. Raises ``ssl.SSLWantReadError`` when there was nothing to return, :class:`RecordError` for a record
        that breaks the protocol (and on every read after it)."""
        got = 0
        held = self._held
        if held is not None:
            got = min(size, len(held))
            buffer[:got] = held[:got]
            self._held = held[got:] if got < len(held) else None
            if got == size:
                return got
        if self._end is not None or self.closed_by_peer:
            if got or self._end is None:
                return got
            raise self._end
        inb = self.incoming
        src = inb.src
        if src is not None:
            data: bytearray | memoryview = src
            pos = inb.spos
        else:
            data = inb.buf
            pos = inb.pos
        end = len(data)
        dv = data if src is not None else memoryview(data)
        keys = self._read
        decrypt = keys.aead.decrypt_into
        iv, seq = keys.iv, keys.seq
        try:
            while end - pos >= 5:
                length = data[pos + 3] << 8 | data[pos + 4]
                if data[pos] != APPLICATION_DATA:
                    raise RecordError(f"UNEXPECTED_RECORD: TLS record type {data[pos]} after the handshake")
                if length > MAX_CIPHERTEXT:
                    raise RecordError("ENCRYPTED_LENGTH_TOO_LONG: TLS record over 2^14 + 256 bytes")
                if end - pos - 5 < length:
                    break
                if length <= TAG:
                    raise RecordError("BAD_LENGTH: TLS record too short")
                plain = length - TAG
                room = size - got
                target = buffer[got : got + plain] if room >= plain else memoryview(bytearray(plain))
                try:
                    decrypt((iv ^ seq).to_bytes(12, "big"), dv[pos + 5 : pos + 5 + length], dv[pos : pos + 5], target)
                except InvalidTag:
                    raise RecordError("DECRYPTION_FAILED_OR_BAD_RECORD_MAC") from None
                seq += 1
                pos += 5 + length
                # §5.4: the content type is the last non-zero byte; zeros after it are padding.
                i = plain - 1
                content_type = target[i]
                if not content_type:  # padded: the zeros found in C (a byte loop here cost ~1 ms per 16 KiB)
                    i = len(target.tobytes().rstrip(b"\0")) - 1
                    if i < 0:
                        raise RecordError("NO_CONTENT_TYPE: TLS record without a content type")
                    content_type = target[i]
                if i > MAX_PLAINTEXT:
                    raise RecordError("DATA_LENGTH_TOO_LONG: TLS record content over 2^14 bytes")
                if content_type == APPLICATION_DATA:
                    if self._handshake:  # §5.1: no other record between the fragments of a handshake message
                        raise RecordError("MIXED_HANDSHAKE_AND_NON_HANDSHAKE_DATA")
                    if room >= plain:
                        got += i
                    else:
                        take = min(room, i)
                        buffer[got : got + take] = target[:take]
                        got += take
                        if take < i:
                            self._held = target[take:i]
                            break
                    if got == size:
                        break
                elif content_type == HANDSHAKE:
                    keys.seq = seq
                    self._on_handshake(target[:i])
                    if self._read is not keys:  # a KeyUpdate: the next record is under the new keys
                        keys = self._read
                        decrypt = keys.aead.decrypt_into
                        iv, seq = keys.iv, keys.seq
                elif content_type == ALERT:
                    if self._on_alert(target[:i]):
                        self.closed_by_peer = True
                        break  # what follows a close_notify is ignored (§6.1)
                else:
                    raise RecordError(f"UNEXPECTED_RECORD: TLS content type {content_type}")
        except RecordError as e:
            self._end = e
            raise
        finally:
            keys.seq = seq
            inb.pending = end - pos  # a lent read is the only input while it is lent (nothing is held then)
            if src is not None:
                if pos == end:
                    inb.src = None  # all of the read taken: nothing for keep() to copy
                else:
                    inb.spos = pos
            else:
                cast(memoryview, dv).release()  # the buffer may be resized now (no slice of it outlives its call)
                buf = inb.buf
                if pos == end:
                    buf.clear()
                    inb.pos = 0
                elif pos:
                    del buf[:pos]
                    inb.pos = 0
        if not got and not self.closed_by_peer:
            raise ssl.SSLWantReadError("no whole TLS record")
        return got

    def _on_alert(self, content: memoryview) -> bool:
        """True for close_notify; user_canceled is a warning (§6.1, close_notify follows); any other alert is the
        peer ending the connection with an error."""
        if len(content) != 2:
            raise RecordError("BAD_LENGTH: malformed TLS alert")
        description = content[1]
        if description == CLOSE_NOTIFY:
            return True
        if description == USER_CANCELED:
            return False
        # OpenSSL's name for it, as its record layer reports it (and ztunnel.tls's hints know them).
        raise RecordError(_ALERTS.get(description, f"TLS_ALERT_{description}"))

    def _on_handshake(self, content: memoryview) -> None:
        """§4.6: post-handshake messages, possibly split over records or several in one."""
        if not content:
            raise RecordError("BAD_LENGTH: empty handshake record")  # §5.1: zero-length handshake fragments
        buf = self._handshake
        buf += content
        while len(buf) >= 4:
            kind = buf[0]
            length = buf[1] << 16 | buf[2] << 8 | buf[3]
            # Judged at the header, before its body is held: only what this side may receive, at its size.
            if kind == KEY_UPDATE:
                if length != 1:
                    raise RecordError("BAD_KEY_UPDATE: KeyUpdate of the wrong length")
            elif kind != NEW_SESSION_TICKET or not self._client_side:
                raise RecordError(f"UNEXPECTED_MESSAGE: post-handshake message {kind}")
            elif length > MAX_TICKET:
                raise RecordError("BAD_LENGTH: NewSessionTicket too long")
            if len(buf) < 4 + length:
                return
            body = bytes(buf[4 : 4 + length])
            del buf[: 4 + length]
            if kind == KEY_UPDATE:
                if body[0] > 1:
                    raise RecordError("BAD_KEY_UPDATE: KeyUpdate request neither 0 nor 1")
                if buf:
                    raise RecordError("NOT_ON_RECORD_BOUNDARY: handshake data after a KeyUpdate")  # §5.1
                self._read = self._read.updated()
                if body[0] == 1:
                    self._update_write_keys()
            # A NewSessionTicket: HBONE never resumes a session.
