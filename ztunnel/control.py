"""Connections to the control plane (istiod): TLS roots, gRPC channels and auth headers.

Upstream ``tls/control.rs`` and ``identity/auth.rs``, shared by the xDS client and the CA client:

* the server is verified against ``XDS_ROOT_CA`` / ``CA_ROOT_CA``: a file path (read when a channel is built, so a
  rotated root is picked up by the next connection), ``SYSTEM`` (gRPC's default roots) or inline PEM;
* ``ALT_XDS_HOSTNAME`` / ``ALT_CA_HOSTNAME`` name the server identity to verify instead of the address's host.
  Upstream accepts either name; gRPC's verifier takes exactly one, so here the alternative name is the one checked
  (it exists for servers whose certificate does not carry the dialled host);
* every call carries ``authorization: Bearer <token>`` and ``clusterid: <cluster id>`` when a token is configured.
  The token is read from ``AUTH_TOKEN`` (a file, re-read on every call because projected tokens rotate, or a
  static string); an empty token file is an error, as upstream;
* HTTP/2 keepalive PINGs every 30 s with a 10 s timeout, and messages up to 200 MiB (a full Address push for a
  large mesh is big), as upstream. Only ``https`` addresses are accepted: upstream's connector is HTTPS-only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc

from ztunnel.config import DEFAULT_TOKEN_PROVIDER, AuthSource, RootCertKind, RootCertSource
from ztunnel.errors import ZtunnelError
from ztunnel.net import format_addr

__all__ = [
    "MAX_MESSAGE_SIZE",
    "ControlPlaneError",
    "auth_metadata",
    "grpc_target",
    "load_root_pem",
    "root_cert_file",
    "secure_channel",
    "token_path_or_static",
]

MAX_MESSAGE_SIZE = 200 * 1024 * 1024
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
_PEM_CERT = b"-----BEGIN CERTIFICATE-----"


class ControlPlaneError(ZtunnelError):
    """The control-plane connection cannot be set up as configured; the message names the variable or file."""


def root_cert_file(source: RootCertSource) -> Path | None:
    """The file behind ``source`` if it names an existing file (the CA client watches it for rotation)."""
    if source.kind is RootCertKind.FILE_OR_INLINE and os.path.isfile(source.value):
        return Path(source.value)
    return None


def load_root_pem(source: RootCertSource, variable: str) -> bytes | None:
    """The PEM roots to trust, or ``None`` for the system roots (``SYSTEM``).

    Raises :class:`ControlPlaneError` naming ``variable`` when the file is unreadable or holds no certificate, or
    when the value is neither an existing file nor inline PEM.
    """
    if source.kind is RootCertKind.SYSTEM:
        return None
    path = root_cert_file(source)
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ControlPlaneError(f"{variable}: cannot read root certificate file {path}: {e.strerror}") from None
        if _PEM_CERT not in data:
            raise ControlPlaneError(f"{variable}: {path} contains no PEM certificate")
        return data
    data = source.value.encode()
    if _PEM_CERT in data:
        return data
    raise ControlPlaneError(
        f"{variable}={source.value!r}: no such file and not inline PEM; expected a root certificate file path, "
        "SYSTEM, or the PEM text itself"
    )


def token_path_or_static(auth: AuthSource) -> tuple[str | None, str | None]:
    """(token file, static token) for ``AUTH_TOKEN``, resolved at call time: the file may appear or rotate later.

    An unset ``AUTH_TOKEN`` uses the default token file when it exists (else no token); a value naming an existing
    file is that file; any other value is the token itself.
    """
    if auth.value is None:
        return (DEFAULT_TOKEN_PROVIDER if os.path.exists(DEFAULT_TOKEN_PROVIDER) else None), None
    if os.path.exists(auth.value):
        return auth.value, None
    return None, auth.value


def auth_metadata(auth: AuthSource, cluster_id: str) -> list[tuple[str, str]]:
    """``authorization`` and ``clusterid`` headers for one call (none when no token is configured).

    The token file is read on every call: Kubernetes rotates projected tokens in place.
    """
    path, static = token_path_or_static(auth)
    if path is not None:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ControlPlaneError(f"AUTH_TOKEN: cannot read token file {path}: {e}") from None
        if not token:
            raise ControlPlaneError(f"AUTH_TOKEN: token file {path} exists, but was empty")
    elif static is not None:
        token = static
    else:
        return []
    return [("authorization", f"Bearer {token}"), ("clusterid", cluster_id)]


def grpc_target(address: str, variable: str) -> str:
    """``https://host:port`` -> ``host:port`` (port 443 when absent), for gRPC's channel."""
    parts = urlsplit(address)
    if parts.scheme != "https":
        raise ControlPlaneError(
            f"{variable}={address!r}: only https:// control-plane addresses are supported (the connection is TLS)"
        )
    if not parts.hostname:
        raise ControlPlaneError(f"{variable}={address!r}: missing host")
    try:
        port = parts.port or 443
    except ValueError:
        raise ControlPlaneError(f"{variable}={address!r}: invalid port") from None
    return format_addr(parts.hostname, port)


def secure_channel(
    address: str,
    root_pem: bytes | None,
    alt_hostname: str | None,
    variable: str,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> Any:
    """A new ``grpc.aio`` TLS channel to ``address`` (the caller closes it)."""
    target = grpc_target(address, variable)
    options: list[tuple[str, Any]] = [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.max_receive_message_length", MAX_MESSAGE_SIZE),
        ("grpc.max_send_message_length", MAX_MESSAGE_SIZE),
        # Failures surface to our own retry logic (the xDS backoff, the certificate manager's) instead of being
        # retried invisibly underneath it.
        ("grpc.enable_retries", 0),
        # A channel of our own connects afresh: with gRPC's process-wide subchannel pool a new channel would reuse
        # a subchannel still in gRPC's internal reconnect backoff (1 s and up) and fail without even dialling.
        ("grpc.use_local_subchannel_pool", 1),
        *extra_options,
    ]
    if alt_hostname:
        options.append(("grpc.ssl_target_name_override", alt_hostname))
    creds = grpc.ssl_channel_credentials(root_certificates=root_pem)
    return grpc.aio.secure_channel(target, creds, options=options)
