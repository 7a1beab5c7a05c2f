"""mTLS for HBONE: stdlib ``ssl`` contexts built from a :class:`WorkloadCertificate`, plus identity checks.

Policy (upstream ``tls/lib.rs``, ``tls/certificate.rs``, ``tls/workload.rs``):

* TLS 1.3 only; ``tls12_enabled`` (``TLS12_ENABLED``) adds TLS 1.2 with ECDHE-ECDSA/RSA AES-GCM suites only.
* TLS 1.3 suites ``TLS_AES_256_GCM_SHA384`` and ``TLS_AES_128_GCM_SHA256`` only. The stdlib has no setter for
  TLS 1.3 suites, so :func:`set_tls13_ciphersuites` calls libssl's ``SSL_CTX_set_ciphersuites`` via ctypes and
  the result is read back through ``get_ciphers()``; a context is never returned with a weaker configuration.
* ALPN ``h2`` on both sides; the client sends no SNI (connect with ``server_hostname=""``: asyncio then passes
  none to OpenSSL) and does not check host names, as identities are SPIFFE URIs, not DNS names.
* No resumption: every connection re-verifies the peer chain and identity against the current roots.
* The server requires a client certificate. Both sides verify the chain against the certificate's own roots
  (never the system store) and OpenSSL checks the extended key usage purpose: clientAuth when the server
  verifies a client, serverAuth when the client verifies a server (each only if the peer has an EKU
  extension, as webpki's "required if present").

OpenSSL cannot run upstream's SAN checks, nor webpki's refusal of a CA certificate as the peer's leaf
(basicConstraints CA:TRUE; a leaf without basicConstraints is accepted, as webpki does), inside the handshake, so
they run right after it:
:func:`verify_client_identity` (server side, upstream's ``TrustDomainVerifier``) and
:func:`verify_server_identity` (client side, upstream's ``IdentityVerifier``). A connection must be closed
without exchanging data if either raises. :func:`handshake_error` turns an ``ssl`` handshake exception into a
:class:`TlsError` whose message says what to check.
"""

from __future__ import annotations

import ctypes
import functools
import os
import ssl
import threading
from collections.abc import Collection, Sequence
from typing import Final

from cryptography import x509

from ztunnel.config import PQC_GROUP
from ztunnel.crl import CrlSet
from ztunnel.errors import ZtunnelError
from ztunnel.identity.certificate import WorkloadCertificate, identities_from_cert
from ztunnel.identity.spiffe import Identity

__all__ = [
    "ALPN_H2",
    "TLS12_CIPHERS",
    "TLS13_CIPHERSUITES",
    "AlpnMismatch",
    "CaUsedAsEndEntity",
    "CertificateRevoked",
    "HandshakeFailed",
    "IdentityMismatch",
    "MissingPeerCertificate",
    "TlsConfigError",
    "TlsError",
    "TrustDomainMismatch",
    "capture_traffic_secrets",
    "check_crls",
    "client_context",
    "handshake_error",
    "key_exchange_group_supported",
    "load_crls",
    "peer_chain",
    "peer_identities",
    "report_traffic_secrets",
    "server_context",
    "set_tls13_ciphersuites",
    "verify_client_identity",
    "verify_server_identity",
]

ALPN_H2: Final = "h2"
# Upstream's provider suites, in its preference order.
TLS13_CIPHERSUITES: Final = ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
# OpenSSL names of upstream's TLS 1.2 suites (TLS_ECDHE_{ECDSA,RSA}_WITH_AES_{256,128}_GCM_SHA{384,256}).
TLS12_CIPHERS: Final = (
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES128-GCM-SHA256",
)

# libssl constants (ssl.h); stable across OpenSSL 1.1.1 and 3.x.
_SSL_CTRL_SET_SESS_CACHE_MODE: Final = 44
_SSL_CTRL_GET_SESS_CACHE_MODE: Final = 45
_SSL_SESS_CACHE_OFF: Final = 0

PeerSsl = ssl.SSLObject | ssl.SSLSocket


class TlsError(ZtunnelError):
    """Base class for HBONE TLS failures."""


class TlsConfigError(TlsError):
    """A context could not be built with the required security settings."""


class HandshakeFailed(TlsError):
    """The TLS handshake failed; built by :func:`handshake_error` from the ``ssl`` exception."""


class CaUsedAsEndEntity(HandshakeFailed):
    """The peer's leaf certificate is a CA certificate (basicConstraints cA=TRUE): webpki's ``CaUsedAsEndEntity``.

    A handshake failure (flag ``TLS_FAILURE``), as upstream, where webpki refuses it inside the handshake."""


class CertificateRevoked(HandshakeFailed):
    """The peer's chain holds a certificate a CRL of ``CRL_PATH`` revokes (OpenSSL's ``X509_V_ERR_CERT_REVOKED``)."""


class MissingPeerCertificate(TlsError):
    """The peer presented no certificate."""


class TrustDomainMismatch(TlsError):
    """The client certificate has no SPIFFE identity in the server's trust domain."""


class IdentityMismatch(TlsError):
    """The server certificate carries none of the identities the client expected."""


class MultipleIdentities(TlsError):
    """The peer certificate carries more than one SPIFFE identity."""


class AlpnMismatch(TlsError):
    """The handshake did not negotiate ALPN ``h2``."""


# --- contexts -------------------------------------------------------------------------------------------------


def server_context(
    cert: WorkloadCertificate, *, tls12_enabled: bool = False, crls: CrlSet | None = None, secrets: bool = False
) -> ssl.SSLContext:
    """A server context presenting ``cert`` and requiring a client certificate that chains to ``cert.roots``
    (and, with ``crls``, that no certificate of its chain is revoked: see :func:`load_crls`). With ``secrets``
    (as :func:`client_context`'s), its handshakes report their TLS 1.3 traffic secrets
    (:func:`report_traffic_secrets`).

    After the handshake, call :func:`verify_client_identity` with the server's own trust domain.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure_common(ctx, cert, tls12_enabled=tls12_enabled, crls=crls)
    ctx.verify_mode = ssl.CERT_REQUIRED
    # No resumption: no TLS 1.3 tickets (num_tickets), no TLS 1.2 tickets (OP_NO_TICKET, set in
    # _configure_common) and no TLS 1.2 session-ID cache.
    ctx.num_tickets = 0
    _disable_server_session_cache(ctx)
    if secrets:
        report_traffic_secrets(ctx)
    return ctx


def client_context(
    cert: WorkloadCertificate, *, tls12_enabled: bool = False, crls: CrlSet | None = None, secrets: bool = False
) -> ssl.SSLContext:
    """A client context presenting ``cert`` and verifying the server chain against ``cert.roots`` (and ``crls``).

    With ``secrets``, its handshakes report their TLS 1.3 traffic secrets (:func:`report_traffic_secrets`), for
    a record layer of ztunnel's own after the handshake (``ztunnel/proxy/hbone/records.py``).

    Connect with ``server_hostname=""`` (asyncio) or ``server_hostname=None`` (``wrap_bio``/``wrap_socket``) so
    that no SNI is sent, and never pass a ``session``: HBONE does not resume. After the handshake, call
    :func:`verify_server_identity` with the destination's expected identities.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # must precede verify_mode changes; identities are checked on URI SANs instead
    ctx.verify_mode = ssl.CERT_REQUIRED
    _configure_common(ctx, cert, tls12_enabled=tls12_enabled, crls=crls)
    if secrets:
        report_traffic_secrets(ctx)
    return ctx


def _configure_common(
    ctx: ssl.SSLContext, cert: WorkloadCertificate, *, tls12_enabled: bool, crls: CrlSet | None
) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2 if tls12_enabled else ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    # OP_NO_TICKET: no TLS 1.2 tickets; OP_NO_RENEGOTIATION: rustls never renegotiates either.
    ctx.options |= ssl.OP_NO_TICKET | ssl.OP_NO_RENEGOTIATION
    # The TLS 1.2 list is set even when TLS 1.2 is off: OpenSSL requires a non-empty list, and it keeps
    # get_ciphers() free of anything weaker.
    ctx.set_ciphers(":".join(TLS12_CIPHERS))
    set_tls13_ciphersuites(ctx, TLS13_CIPHERSUITES)
    ctx.set_alpn_protocols([ALPN_H2])
    # Trust exactly the roots from the CA (PROTOCOL_TLS_* contexts start with an empty store; nothing loads the
    # system defaults). PARTIAL_CHAIN makes every configured root a trust anchor even if it is not self-signed,
    # as webpki treats its root store, so a bundle holding an intermediate still works.
    ctx.load_verify_locations(cadata=cert.roots_pem())
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if crls is not None and not crls.empty:
        load_crls(ctx, crls)
    _load_chain_from_memory(ctx, cert)


# X509_V_ERR_* codes that mean "revocation status unknown": no CRL from this certificate's issuer (3), no issuer
# certificate for a CRL (33), a CRL of another scope (44), a CRL not yet or no longer valid (11, 12). webpki, as
# upstream configures it (UnknownStatusPolicy::Allow, ExpirationPolicy::Ignore), accepts the certificate then.
_UNKNOWN_REVOCATION_STATUS: Final = frozenset({3, 11, 12, 33, 44})


def load_crls(ctx: ssl.SSLContext, crls: CrlSet) -> None:
    """Make OpenSSL refuse a peer chain holding a certificate that ``crls`` revokes, as upstream's webpki does.

    ``VERIFY_CRL_CHECK_CHAIN`` checks every certificate of the chain, and would refuse a certificate whose issuer
    published no CRL; upstream allows unknown status. The stdlib has no verify callback, so one is set on the
    context's certificate store through libcrypto (``X509_STORE_set_verify_cb``; a store callback survives the
    ``ssl`` module resetting the SSL_CTX's own callback when ``verify_mode`` is set): it clears exactly the
    unknown-status errors and nothing else. The CRLs go in like ``load_verify_locations(cafile=)`` reads them
    (``cadata`` takes certificates only), from an anonymous memfd.
    """
    pointer = _ssl_ctx_pointer(ctx)
    lib = _libssl()
    store = lib.SSL_CTX_get_cert_store(pointer)
    if not store:
        raise TlsConfigError("cannot reach the OpenSSL certificate store to load CRLs")
    fd = os.memfd_create("ztunnel-crl", os.MFD_CLOEXEC)
    try:
        view = memoryview(crls.pem)
        while view:
            view = view[os.write(fd, view) :]
        try:
            ctx.load_verify_locations(cafile=f"/proc/self/fd/{fd}")
        except ssl.SSLError as e:
            raise TlsConfigError(f"OpenSSL cannot load the CRLs from CRL_PATH: {e}") from e
    finally:
        os.close(fd)
    lib.X509_STORE_set_verify_cb(store, _crl_verify_cb)
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN


def check_crls(crls: CrlSet) -> None:
    """Raise :class:`TlsConfigError` if OpenSSL cannot load ``crls`` into a context (checked when the file is
    loaded, so a handshake never meets it)."""
    load_crls(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), crls)


_VERIFY_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p)


def _allow_unknown_revocation_status(ok: int, store_ctx: int | None) -> int:
    if ok:
        return 1
    lib = _libssl()
    if lib.X509_STORE_CTX_get_error(store_ctx) in _UNKNOWN_REVOCATION_STATUS:
        lib.X509_STORE_CTX_set_error(store_ctx, 0)  # X509_V_OK: the handshake's verify result stays clean
        return 1
    return 0


# Module level: OpenSSL keeps the bare function pointer, so the ctypes object must live as long as the process.
_crl_verify_cb: Final = _VERIFY_CB(_allow_unknown_revocation_status)


def _load_chain_from_memory(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> None:
    """``load_cert_chain`` without writing the private key to a filesystem.

    ``SSLContext.load_cert_chain`` only accepts paths. An anonymous memfd (``memfd_create``) is RAM-backed,
    has no name in any mounted filesystem, is close-on-exec, and disappears when closed; its
    ``/proc/self/fd/<n>`` path is openable only by this process (and root). It holds the chain and key for
    the duration of the call.
    """
    fd = os.memfd_create("ztunnel-workload-cert", os.MFD_CLOEXEC)
    try:
        data = (cert.chain_pem() + cert.key_pem()).encode("ascii")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        try:
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        except ssl.SSLError as e:
            raise TlsConfigError(f"cannot load the workload certificate chain and key into OpenSSL: {e}") from e
    finally:
        os.close(fd)


# --- libssl via ctypes ----------------------------------------------------------------------------------------


@functools.cache
def _libssl() -> ctypes.CDLL:
    import _ssl

    # Use the very libssl the ssl module is linked against: open the _ssl extension itself and let the dynamic
    # linker resolve libssl symbols through its dependencies. If _ssl is built into the interpreter, the
    # symbols are in the process image (CDLL(None)).
    lib = ctypes.CDLL(getattr(_ssl, "__file__", None))
    lib.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.SSL_CTX_set_ciphersuites.restype = ctypes.c_int
    # uint64_t in OpenSSL 3, unsigned long in 1.1.1: both 64-bit on the LP64 platforms ztunnel runs on.
    lib.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
    lib.SSL_CTX_get_options.restype = ctypes.c_uint64
    lib.SSL_CTX_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    lib.SSL_CTX_ctrl.restype = ctypes.c_long
    lib.SSL_CTX_get_cert_store.argtypes = [ctypes.c_void_p]
    lib.SSL_CTX_get_cert_store.restype = ctypes.c_void_p
    lib.X509_STORE_set_verify_cb.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.X509_STORE_set_verify_cb.restype = None
    lib.X509_STORE_CTX_get_error.argtypes = [ctypes.c_void_p]
    lib.X509_STORE_CTX_get_error.restype = ctypes.c_int
    lib.X509_STORE_CTX_set_error.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.X509_STORE_CTX_set_error.restype = None
    lib.SSL_CTX_set_keylog_callback.argtypes = [ctypes.c_void_p, _KEYLOG_CB]
    lib.SSL_CTX_set_keylog_callback.restype = None
    return lib


def _ssl_ctx_pointer(ctx: ssl.SSLContext) -> int:
    """The ``SSL_CTX*`` inside a CPython ``SSLContext``.

    CPython's ``PySSLContext`` struct is ``{PyObject_HEAD; SSL_CTX *ctx; ...}``, so the pointer sits right
    after the object header (``object.__basicsize__`` bytes from the object's address). Before trusting it we
    check that libssl reads the same option bits through it as the ``ssl`` module reports.
    """
    try:
        lib = _libssl()
    except (OSError, AttributeError) as e:
        raise TlsConfigError(f"cannot reach libssl through ctypes to restrict TLS 1.3 cipher suites: {e}") from e
    pointer = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not pointer or lib.SSL_CTX_get_options(pointer) != int(ctx.options):
        raise TlsConfigError(
            "cannot locate the OpenSSL SSL_CTX inside ssl.SSLContext (unexpected interpreter layout); "
            "refusing to run without the TLS 1.3 cipher suite restriction. Use CPython 3.11+"
        )
    return pointer


# --- TLS 1.3 traffic secrets, for the HBONE record layer -------------------------------------------------------

_KEYLOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
_TRAFFIC_SECRETS: Final = (b"CLIENT_TRAFFIC_SECRET_0", b"SERVER_TRAFFIC_SECRET_0")
_capture = threading.local()


def _on_key_log_line(ssl_pointer: int | None, line: bytes | None) -> None:
    # OpenSSL calls this inside SSL_do_handshake, in the thread that called it (the ssl module releases the GIL
    # there; ctypes takes it back for this call): the handshake that thread is running is the one capturing.
    try:
        target = getattr(_capture, "target", None)
        if target is None or not line:
            return
        label, _, rest = line.partition(b" ")
        if label in _TRAFFIC_SECRETS:
            target[label] = bytes.fromhex(rest.partition(b" ")[2].decode("ascii"))
    except Exception:  # never let an exception unwind into OpenSSL; a missing secret keeps OpenSSL's records
        return


# Module level: OpenSSL keeps the bare function pointer, so the ctypes object must live as long as the process.
_key_log_cb: Final = _KEYLOG_CB(_on_key_log_line)


def report_traffic_secrets(ctx: ssl.SSLContext) -> None:
    """Have ``ctx``'s handshakes report their TLS 1.3 application traffic secrets (OpenSSL's key-log callback,
    ``SSL_CTX_set_keylog_callback``) to the dict that :func:`capture_traffic_secrets` set for the calling thread,
    as ``{b"CLIENT_TRAFFIC_SECRET_0": secret, b"SERVER_TRAFFIC_SECRET_0": secret}``. Nothing is written anywhere
    else, and a handshake run with no dict set reports nothing. (The ``ssl`` module's ``keylog_filename`` writes the
    same lines to a file; this context then has no use for it.)"""
    _libssl().SSL_CTX_set_keylog_callback(_ssl_ctx_pointer(ctx), _key_log_cb)


def capture_traffic_secrets(target: dict[bytes, bytes] | None) -> None:
    """The dict the secrets of the handshakes this thread runs from now on go to (None: nowhere). Set it around
    ``do_handshake``; clear it after."""
    _capture.target = target


def set_tls13_ciphersuites(ctx: ssl.SSLContext, suites: Sequence[str]) -> None:
    """Restrict ``ctx``'s TLS 1.3 cipher suites to ``suites`` (OpenSSL names) and verify it took effect.

    Raises :class:`TlsConfigError` if libssl rejects the list or ``ctx.get_ciphers()`` does not then list
    exactly ``suites`` for TLS 1.3.
    """
    pointer = _ssl_ctx_pointer(ctx)
    if _libssl().SSL_CTX_set_ciphersuites(pointer, ":".join(suites).encode("ascii")) != 1:
        raise TlsConfigError(f"libssl rejected the TLS 1.3 cipher suites {list(suites)}")
    active = [c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.3"]
    if sorted(active) != sorted(suites):
        raise TlsConfigError(
            f"TLS 1.3 cipher suites are {active} after setting {list(suites)}; refusing to use this context"
        )


# SSL_CTRL_SET_GROUPS_LIST (ssl.h): what SSL_CTX_set1_groups_list() expands to.
_SSL_CTRL_SET_GROUPS_LIST: Final = 92


def key_exchange_group_supported(group: str = PQC_GROUP) -> bool:
    """Whether the libssl behind the ``ssl`` module accepts ``group`` as a key-exchange group list (asked of a
    scratch context through ``SSL_CTX_set1_groups_list``): X25519MLKEM768 needs OpenSSL 3.5 or later, the version
    :func:`ztunnel.config.pqc_refusal` goes by (a test holds the two to agree)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        pointer = _ssl_ctx_pointer(ctx)
    except TlsConfigError:
        return False
    return bool(_libssl().SSL_CTX_ctrl(pointer, _SSL_CTRL_SET_GROUPS_LIST, 0, group.encode("ascii")) == 1)


def _disable_server_session_cache(ctx: ssl.SSLContext) -> None:
    # CPython gives server contexts a session id context, so OpenSSL's default server cache would let a TLS 1.2
    # client resume by session ID and skip certificate verification; turn the cache off.
    pointer = _ssl_ctx_pointer(ctx)
    lib = _libssl()
    lib.SSL_CTX_ctrl(pointer, _SSL_CTRL_SET_SESS_CACHE_MODE, _SSL_SESS_CACHE_OFF, None)
    if lib.SSL_CTX_ctrl(pointer, _SSL_CTRL_GET_SESS_CACHE_MODE, 0, None) != _SSL_SESS_CACHE_OFF:
        raise TlsConfigError("cannot disable the OpenSSL server session cache; refusing to allow TLS resumption")


# --- post-handshake identity checks ---------------------------------------------------------------------------


def _peer_leaf(ssl_obj: PeerSsl) -> x509.Certificate:
    der = ssl_obj.getpeercert(binary_form=True)
    if not der:
        raise MissingPeerCertificate(
            "peer presented no certificate; HBONE requires mTLS (is the peer a mesh workload with a certificate?)"
        )
    return x509.load_der_x509_certificate(der)


def _check_end_entity(leaf: x509.Certificate, role: str) -> None:
    """webpki's end-entity rule (``verify_cert.rs::check_basic_constraints`` with ``Role::EndEntity``): a leaf whose
    basicConstraints says cA=TRUE is refused (``CaUsedAsEndEntity``). A leaf *without* basicConstraints reads as
    cA=FALSE and is accepted, as is a pathLenConstraint on a non-CA leaf; so "or without basicConstraints" would be
    stricter than upstream, and is not done. OpenSSL accepts a CA leaf, hence this check after the handshake."""
    try:
        constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return
    except ValueError as e:  # a malformed extension: webpki fails the handshake on it too (BadDer)
        raise HandshakeFailed(f"TLS handshake failed: {role} certificate has malformed extensions ({e})") from None
    if constraints.ca:
        raise CaUsedAsEndEntity(
            f"TLS handshake failed: the {role} certificate is a CA certificate (basicConstraints CA:TRUE) used as an "
            "end entity (CaUsedAsEndEntity); workload certificates must be issued with CA:FALSE: check the CA that "
            "issued it"
        )


def peer_identities(ssl_obj: PeerSsl, role: str = "peer") -> list[Identity]:
    """All Istio identities in the peer leaf's URI SANs, in certificate order (first = the peer identity).

    Raises :class:`CaUsedAsEndEntity` when the leaf is a CA certificate (webpki refuses it as an end entity)."""
    leaf = _peer_leaf(ssl_obj)
    _check_end_entity(leaf, role)
    return identities_from_cert(leaf)


def peer_chain(ssl_obj: PeerSsl) -> list[bytes] | None:
    """The peer chain OpenSSL verified (DER, leaf first, ending at the trust anchor), or None if unknown.

    Python 3.13 has ``SSLObject.get_verified_chain()``; 3.10 to 3.12 have the same method on the private
    ``_sslobj``, which is what this reads there."""
    getter = getattr(ssl_obj, "get_verified_chain", None)
    if getter is None:
        getter = getattr(getattr(ssl_obj, "_sslobj", None), "get_verified_chain", None)
    if getter is None:
        return None
    try:
        chain = getter()
    except (ssl.SSLError, ValueError, AttributeError):
        return None
    if not chain:
        return None
    return [c if isinstance(c, bytes) else c.public_bytes(_ssl_der()) for c in chain]


def _ssl_der() -> int:
    import _ssl

    return int(getattr(_ssl, "ENCODING_DER", 2))


def _check_alpn(ssl_obj: PeerSsl) -> None:
    got = ssl_obj.selected_alpn_protocol()
    if got != ALPN_H2:
        raise AlpnMismatch(
            f"negotiated ALPN {got!r}, expected {ALPN_H2!r}: the peer is not speaking HBONE "
            "(is it a ztunnel or waypoint on port 15008?)"
        )


def _single_identity(ids: list[Identity], role: str) -> list[Identity]:
    """Refuse a certificate naming two identities. Deliberately stricter than upstream (which takes the first):
    an Istio CA never issues one (the CSR carries one identity), and with two it is ambiguous which one policy
    and telemetry should see, so a peer could be allowed as B while logged as A."""
    if len(ids) > 1:
        raise MultipleIdentities(
            f"{role} certificate carries {len(ids)} SPIFFE identities ({', '.join(map(str, ids))}); exactly one is "
            "allowed: check the CA that issued it"
        )
    return ids


def verify_client_identity(ssl_obj: PeerSsl, local_trust_domain: str) -> Identity:
    """Server side: check ALPN and that the client is in ``local_trust_domain``; return the client identity.

    The client certificate must carry at least one SPIFFE URI SAN whose trust domain equals the server's own.
    The returned identity is the first one in the certificate, which is what policy and telemetry use.
    """
    _check_alpn(ssl_obj)
    ids = _single_identity(peer_identities(ssl_obj, "client"), "client")
    if not any(i.trust_domain == local_trust_domain for i in ids):
        got = ", ".join(map(str, ids)) or "no SPIFFE identity"
        raise TrustDomainMismatch(
            f"client certificate identities ({got}) are not in trust domain {local_trust_domain!r}; check that "
            "both clusters share a trust domain (TRUST_DOMAIN / meshConfig.trustDomain) or use the same root CA"
        )
    return ids[0]


def verify_server_identity(ssl_obj: PeerSsl, expected: Collection[Identity]) -> Identity:
    """Client side: check ALPN and that a server URI SAN is one of ``expected``; return the server identity.

    ``expected`` is the destination service's subject alt names plus the destination workload's identity. The
    returned identity is the first one in the certificate, which is what policy and telemetry use.
    """
    _check_alpn(ssl_obj)
    ids = _single_identity(peer_identities(ssl_obj, "server"), "server")
    if not any(i in expected for i in ids):
        got = ", ".join(map(str, ids)) or "no SPIFFE identity"
        want = ", ".join(sorted(map(str, expected))) or "nothing"
        raise IdentityMismatch(
            f"server certificate identities ({got}) do not match the expected identities ({want}); check the "
            "destination workload's service account and the service's subjectAltNames"
        )
    return ids[0]


# --- handshake failures ---------------------------------------------------------------------------------------

# OpenSSL X509_V_ERR_* codes seen when verifying a peer chain.
_VERIFY_HINTS: Final[dict[int, str]] = {
    9: "the peer certificate is not yet valid: check clock skew between the nodes",
    10: "the peer certificate has expired: check that the peer can reach its CA to rotate certificates",
    18: "the peer certificate is self-signed and not a trusted root: check that both sides use the same mesh CA",
    19: "the peer chain ends at an untrusted root: check that both sides use the same mesh CA (root bundle)",
    20: "the peer certificate does not chain to our roots: check that both sides use the same mesh CA",
    23: "the peer certificate is revoked (a CRL in CRL_PATH lists it or a CA of its chain)",
    26: "the peer certificate lacks the required extended key usage (serverAuth/clientAuth)",
}
X509_V_ERR_CERT_REVOKED: Final = 23

# OpenSSL reason codes: the local failure, or the alert the peer sent us about our side.
_REASON_HINTS: Final[dict[str, str]] = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the client sent no certificate: HBONE requires mTLS",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server requires a client certificate and we sent none",
    "NO_SHARED_CIPHER": (
        "no shared cipher suite: HBONE allows only TLS_AES_256_GCM_SHA384 and TLS_AES_128_GCM_SHA256 "
        "(plus ECDHE AES-GCM with TLS12_ENABLED=true)"
    ),
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "the peer aborted the handshake: check cipher suites and TLS versions",
    "UNSUPPORTED_PROTOCOL": "TLS version mismatch: HBONE uses TLS 1.3 unless TLS12_ENABLED=true on both sides",
    "TLSV1_ALERT_PROTOCOL_VERSION": "TLS version mismatch: HBONE uses TLS 1.3 unless TLS12_ENABLED=true on both sides",
    "WRONG_VERSION_NUMBER": "the peer did not answer with TLS: is it listening for HBONE (port 15008)?",
    "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust our certificate's CA: check both sides use the same mesh CA",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the peer says our certificate has expired: check certificate rotation",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the peer rejected our certificate: check its CA, validity and key usage",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "the peer rejected our certificate's key usage (serverAuth/clientAuth)",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "the peer says our certificate is revoked (its CRL lists it)",
}


def handshake_error(exc: BaseException) -> TlsError:
    """Translate a handshake exception from ``ssl``/asyncio into a :class:`TlsError` saying what to check.

    Use as ``raise handshake_error(e) from e``. A :class:`TlsError` is returned unchanged.
    """
    if isinstance(exc, TlsError):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = _VERIFY_HINTS.get(exc.verify_code, "the peer certificate failed verification")
        kind = CertificateRevoked if exc.verify_code == X509_V_ERR_CERT_REVOKED else HandshakeFailed
        return kind(f"TLS handshake failed: {hint} ({exc.verify_message})")
    if isinstance(exc, ssl.SSLError):
        hint = _REASON_HINTS.get(exc.reason or "", "TLS error")
        return HandshakeFailed(f"TLS handshake failed: {hint} ({exc.reason or exc})")
    if isinstance(exc, ConnectionError | EOFError):
        return HandshakeFailed(
            f"TLS handshake failed: connection closed by the peer ({exc!r}); the peer may have rejected our "
            "certificate, or something (e.g. a NetworkPolicy) is blocking HBONE port 15008"
        )
    return HandshakeFailed(f"TLS handshake failed: {exc!r}")
