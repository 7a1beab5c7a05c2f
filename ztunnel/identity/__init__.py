"""Workload identities, certificates and certificate providers."""

from __future__ import annotations

from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity, IdentityError

__all__ = ["DEFAULT_TRUST_DOMAIN", "Identity", "IdentityError"]
