"""SPIFFE identities as Istio uses them: ``spiffe://<trust domain>/ns/<namespace>/sa/<service account>``.

Parsing is exactly upstream's (``identity/manager.rs::Identity::from_str``): the ``spiffe://`` prefix, then
exactly five ``/``-separated segments whose second and fourth are the literal markers ``ns`` and ``sa``.
Anything else (a trailing slash, extra segments, other markers) is not an Istio identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from ztunnel.errors import ZtunnelError

SPIFFE_PREFIX = "spiffe://"
DEFAULT_TRUST_DOMAIN = "cluster.local"


class IdentityError(ZtunnelError, ValueError):
    """A string that is not an Istio SPIFFE identity."""


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    """An Istio workload identity. ``str(identity)`` is the SPIFFE URI."""

    trust_domain: str
    namespace: str
    service_account: str

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse ``spiffe://td/ns/<ns>/sa/<sa>``; raise :class:`IdentityError` naming the bad value."""
        if not uri.startswith(SPIFFE_PREFIX):
            raise IdentityError(f"invalid SPIFFE identity {uri!r}: must start with {SPIFFE_PREFIX!r}")
        parts = uri[len(SPIFFE_PREFIX) :].split("/")
        if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa":
            raise IdentityError(f"invalid SPIFFE identity {uri!r}: expected spiffe://<trust-domain>/ns/<ns>/sa/<sa>")
        return cls(parts[0], parts[2], parts[4])

    @classmethod
    def try_parse(cls, uri: str) -> Identity | None:
        """Like :meth:`parse` but returns ``None`` for anything that is not an Istio identity."""
        try:
            return cls.parse(uri)
        except IdentityError:
            return None

    def __str__(self) -> str:
        return f"{SPIFFE_PREFIX}{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"
