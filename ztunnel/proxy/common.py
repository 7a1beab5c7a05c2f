"""What every listener shares (upstream ``proxy.rs``): errors with response flags, the HBONE request headers, the
inbound destination service guess, and the TLS context cache. The listeners' inputs are in ``inputs``."""

from __future__ import annotations

import enum
import errno
import os
import random
import ssl
from collections.abc import Sequence

from ztunnel import tls
from ztunnel.crl import CrlManager
from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate
from ztunnel.identity.spiffe import Identity
from ztunnel.net import format_addr
from ztunnel.proxy.hbone.reason import CloseReason
from ztunnel.proxy.hbone.records import AVAILABLE as records_available
from ztunnel.state import ProxyState
from ztunnel.state.service import Service
from ztunnel.state.upstream import ServiceDescription
from ztunnel.state.workload import IPAddress, Workload

BAGGAGE_HEADER = "baggage"
FORWARDED_HEADER = "forwarded"
TRACEPARENT_HEADER = "traceparent"
X_FORWARDED_NETWORK = "x-forwarded-network"
CONNECTION_TIMEOUT = 10.0


class ResponseFlag(enum.Enum):
    """``response_flags`` metric label and access-log values (upstream ``proxy/metrics.rs``)."""

    NONE = "-"
    DENY = "DENY"
    CONNECT = "CONNECT"
    TLS_FAILURE = "TLS_FAILURE"
    H2_HANDSHAKE_FAILURE = "H2_HANDSHAKE_FAILURE"
    NETWORK_POLICY = "NETWORK_POLICY"
    IDENTITY_ERROR = "IDENTITY_ERROR"
    CERT_REVOKED = "CERT_REVOKED"


class ProxyError(ZtunnelError):
    """A connection could not be proxied. The message goes to the access log; ``flag`` is its response flag (the
    metrics label and access-log value), decided where the error is made so no caller maps it; ``timed_out`` says
    the destination did not answer in time (a connect or TLS handshake timeout, or the socket's ETIMEDOUT)."""

    def __init__(self, message: str, flag: ResponseFlag = ResponseFlag.CONNECT, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.flag = flag
        self.timed_out = timed_out

    # The source side's flags for a dial that failed are upstream's, whatever the reason the message gives: its
    # client handshake (rustls, the server's certificate checked inside it) fails as an I/O error, which its
    # metrics map to CONNECT, never TLS_FAILURE or IDENTITY_ERROR (proxy/metrics.rs extract_failure_reason; seen
    # on its binary: a wrong SAN, an unknown root and a CA as the leaf all count CONNECT at the source).

    @classmethod
    def server_rejected(cls, what: str, e: tls.TlsError) -> ProxyError:
        """Our check of an HBONE server's certificate after its handshake failed (``what``: the connection, for the
        log): CONNECT, as upstream's failed client handshake."""
        return cls(f"{what}: {e}")

    @classmethod
    def closed_before_ready(cls, what: str, reason: CloseReason) -> ProxyError:
        """An HBONE client connection ended before it was ready (a failed or timed-out TLS handshake, or any other
        end): CONNECT, as upstream's."""
        return cls(f"{what}: {reason}", timed_out=reason.timed_out)

    @classmethod
    def stream_failed(cls, e: ConnectionError, timed_out: bool) -> ProxyError:
        """Our CONNECT's stream was reset, refused or lost with its connection before the answer came: upstream's
        HTTP/2 error (``Error::H2``), the H2_HANDSHAKE_FAILURE flag."""
        return cls(f"HBONE stream failed: {e}", ResponseFlag.H2_HANDSHAKE_FAILURE, timed_out=timed_out)

    @classmethod
    def no_certificate(cls, identity: object, why: object) -> ProxyError:
        """No certificate for the source identity (the CA down, a renewal failed, expired): upstream's
        ``Error::Identity``, the IDENTITY_ERROR flag."""
        return cls(f"no certificate for {identity}: {why}", ResponseFlag.IDENTITY_ERROR)


class HttpStatusError(ProxyError):
    """The HBONE peer answered our CONNECT with ``status``, not 200 (upstream's ``Error::HttpStatus``). Any refusal,
    401 included, is a connection failure at the source: only the destination knows a policy denied it."""

    def __init__(self, status: int) -> None:
        super().__init__(f"http status: {status} {_REASONS.get(status, '')}", ResponseFlag.CONNECT)
        self.status = status


_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 503: "Service Unavailable"}


def is_timeout(e: BaseException) -> bool:
    """A socket call that failed with ETIMEDOUT (the peer never answered): a timeout, as much as our own."""
    return isinstance(e, OSError) and e.errno == errno.ETIMEDOUT


def os_error_reason(e: OSError) -> str:
    """The reason of a failed socket call as the operator knows it (``Connection refused``), not the event loop's
    wording (``Connect call failed ('10.0.0.1', 15008)``, which hides the errno)."""
    return os.strerror(e.errno) if e.errno else (e.strerror or str(e))


def forwarded_header(src: tuple[IPAddress, int], service_hostname: str | None) -> str:
    """``for="<src ip:port>"``, plus ``;host=<service hostname>`` when the traffic was service-addressed."""
    value = f'for="{format_addr(*src)}"'
    return f"{value};host={service_hostname}" if service_hostname else value


def services_of(state: ProxyState, workload: Workload) -> list[Service]:
    """The services that select ``workload``, in its xDS order (upstream ``get_services_by_workload``)."""
    # A plain loop: a generator and a comprehension were 3 Python calls per inbound connection.
    get = state.services.get
    out: list[Service] = []
    for key in workload.services:
        svc = get(key)
        if svc is not None:
            out.append(svc)
    return out


def guess_inbound_service(
    candidates: Sequence[Service], forwarded_host: str | None, port: int, dest: Workload
) -> ServiceDescription | None:
    """``destination_service`` of an inbound connection (upstream ``proxy.rs::guess_inbound_service``).

    Only ``candidates`` (the services that select the destination, or the one a hostname authority named) can be
    reported, so a peer cannot invent a label value: the one the ``forwarded`` host names, else the first whose
    target port is ``port`` (the service's own number, or for a named port this endpoint's map), else None.
    """
    if forwarded_host is not None:
        for svc in candidates:
            if svc.hostname == forwarded_host:
                return ServiceDescription.of(svc)
    for svc in candidates:
        ep = svc.endpoints.get(dest.uid)
        for svc_port, target in svc.ports.items():
            if target == port or (ep is not None and ep.port.get(svc_port) == port):
                return ServiceDescription.of(svc)
    return None


_trace_rng = random.Random()


def new_traceparent() -> str:
    """A random W3C ``traceparent`` (``00-<32 hex>-<16 hex>-00``), one per connection as upstream.

    Trace ids need to be unique, not secret: a seeded PRNG costs no system call (``os.urandom`` was two
    ``getrandom`` calls per connection).
    """
    return f"00-{_trace_rng.getrandbits(128):032x}-{_trace_rng.getrandbits(64):016x}-00"


class TlsContextCache:
    """SSL contexts per certificate: building one loads the chain and key (~0.3 ms), so do it once per cert.

    With ``crl`` (CRL_PATH) a context is also rebuilt when a new CRL set is loaded (its generation moved), since
    OpenSSL cannot take a CRL back out of a context's store."""

    def __init__(
        self, tls12_enabled: bool = False, crl: CrlManager | None = None, *, own_record_layer: bool = True
    ) -> None:
        self.tls12_enabled = tls12_enabled
        self.crl = crl
        # Contexts that report TLS 1.3 traffic secrets, so HBONE connections protect records themselves
        # (ztunnel/proxy/hbone/records.py); False (ZTUNNEL_OPENSSL_RECORD_LAYER): OpenSSL keeps them.
        self.own_record_layer = own_record_layer and records_available
        self._client: dict[Identity, tuple[WorkloadCertificate, int, ssl.SSLContext]] = {}
        self._server: dict[Identity, tuple[WorkloadCertificate, int, ssl.SSLContext]] = {}

    def client(self, identity: Identity, cert: WorkloadCertificate) -> ssl.SSLContext:
        crl = self.crl
        gen = crl.generation if crl is not None else 0
        hit = self._client.get(identity)
        if hit is not None and hit[0] is cert and hit[1] == gen:
            return hit[2]
        ctx = tls.client_context(
            cert, tls12_enabled=self.tls12_enabled, crls=crl.current if crl else None, secrets=self.own_record_layer
        )
        self._client[identity] = (cert, gen, ctx)
        return ctx

    def server(self, identity: Identity, cert: WorkloadCertificate) -> ssl.SSLContext:
        crl = self.crl
        gen = crl.generation if crl is not None else 0
        hit = self._server.get(identity)
        if hit is not None and hit[0] is cert and hit[1] == gen:
            return hit[2]
        ctx = tls.server_context(
            cert, tls12_enabled=self.tls12_enabled, crls=crl.current if crl else None, secrets=self.own_record_layer
        )
        self._server[identity] = (cert, gen, ctx)
        return ctx
