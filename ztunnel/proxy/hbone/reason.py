"""Why an HBONE connection closed, as a value: what kind of end it was, and the message the logs show.

Code decides on the kind (was it a TLS failure? a timeout?); the message is for people, and stays exactly what
the access log and the warnings have always said (``TLS handshake failed: ...``, ``peer sent GOAWAY``, ...).
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass


class CloseKind(enum.Enum):
    """How an HBONE connection ended."""

    TLS_HANDSHAKE_FAILED = "TLS handshake failed"
    TLS_HANDSHAKE_TIMEOUT = "TLS handshake timed out"
    TLS_ERROR = "TLS error"
    TLS_CLOSE_NOTIFY = "peer sent TLS close_notify"
    PROTOCOL_ERROR = "HTTP/2 protocol error"
    KEEPALIVE_TIMEOUT = "no PING response"
    PEER_CLOSED = "peer closed the connection"  # TCP FIN
    LOST = "connection lost"  # the socket failed (reset, timed out, ...)
    CLOSED = "connection closed"  # the socket closed with no error and no FIN seen first
    GOAWAY = "peer sent GOAWAY"
    DRAINED = "drained"
    PEER_REJECTED = "peer rejected"  # its certificate failed our checks (identity, trust domain)
    ABORTED = "aborted"  # by ztunnel, for a reason of its own (no certificate, shutdown, ...)


_TLS_FAILURES = frozenset({CloseKind.TLS_HANDSHAKE_FAILED, CloseKind.TLS_HANDSHAKE_TIMEOUT, CloseKind.TLS_ERROR})


@dataclass(frozen=True, slots=True)
class CloseReason:
    """One connection's end: ``kind`` for code, ``message`` (also ``str()``) for the logs."""

    kind: CloseKind
    message: str
    timed_out: bool = False  # the end was a timeout (the handshake's, or the socket's ETIMEDOUT)
    revoked: bool = False  # the handshake refused the peer's chain as revoked by a CRL (CRL_PATH)

    def __str__(self) -> str:
        return self.message

    @property
    def tls_failure(self) -> bool:
        """TLS failed (handshake refused or timed out, or a TLS error): the ``TLS_FAILURE`` response flag."""
        return self.kind in _TLS_FAILURES

    @classmethod
    def lost(cls, exc: Exception | None) -> CloseReason:
        """The socket went away: with an error (``connection lost: ...``) or without (``connection closed``)."""
        if exc is None:
            return cls(CloseKind.CLOSED, "connection closed")
        return cls(CloseKind.LOST, f"connection lost: {exc}", getattr(exc, "errno", None) == errno.ETIMEDOUT)

    @classmethod
    def aborted(cls, message: str) -> CloseReason:
        return cls(CloseKind.ABORTED, message)
