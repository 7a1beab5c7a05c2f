"""Workload identities, certificates and certificate providers."""

from __future__ import annotations

from ztunnel.identity.ca import CaError, CaFileError, CsrRejected, LocalCA
from ztunnel.identity.certificate import (
    CertificateError,
    WorkloadCertificate,
    identities_from_cert,
    identity_from_cert,
)
from ztunnel.identity.manager import (
    DEFAULT_CERT_TTL,
    CertificateProvider,
    CertificateState,
    CertificateStatus,
    LocalCertificateProvider,
)
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity, IdentityError

__all__ = [
    "DEFAULT_CERT_TTL",
    "DEFAULT_TRUST_DOMAIN",
    "CaError",
    "CaFileError",
    "CertificateError",
    "CertificateProvider",
    "CertificateState",
    "CertificateStatus",
    "CsrRejected",
    "Identity",
    "IdentityError",
    "LocalCA",
    "LocalCertificateProvider",
    "WorkloadCertificate",
    "identities_from_cert",
    "identity_from_cert",
]
