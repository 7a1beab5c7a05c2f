from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.identity.certs import build_intermediate, build_leaf
from ztunnel.identity import (
    CertificateError,
    Identity,
    LocalCA,
    WorkloadCertificate,
    identities_from_cert,
    identity_from_cert,
)

TD = "cluster.local"
ID = Identity(TD, "ns1", "sa1")


@pytest.fixture(scope="module")
def ca() -> LocalCA:
    return LocalCA.generate(TD)


def pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


# --- identity extraction ------------------------------------------------------------------------------------------


def test_identity_is_first_uri_san_that_parses(ca: LocalCA) -> None:
    wc = build_leaf(
        ca,
        uris=[
            "https://example.com/not-spiffe",
            "spiffe://cluster.local/ns/a/sa/b/extra",  # six segments: not an Istio identity
            "spiffe://td1/ns/first/sa/one",
            "spiffe://td2/ns/second/sa/two",
        ],
        dns=["svc.example.com"],
    )
    assert identity_from_cert(wc.cert) == Identity("td1", "first", "one")
    assert wc.identity == Identity("td1", "first", "one")
    assert identities_from_cert(wc.cert) == [Identity("td1", "first", "one"), Identity("td2", "second", "two")]


def test_no_identity_without_spiffe_uri(ca: LocalCA) -> None:
    assert identity_from_cert(build_leaf(ca, dns=["a.example.com"]).cert) is None
    assert identity_from_cert(build_leaf(ca).cert) is None  # no SAN extension at all
    assert identities_from_cert(build_leaf(ca).cert) == []


# --- validity -----------------------------------------------------------------------------------------------------


def test_validity_properties_and_half_life(ca: LocalCA) -> None:
    wc = ca.issue(ID, timedelta(hours=10))
    assert wc.not_before.tzinfo is UTC and wc.not_after.tzinfo is UTC
    # Validity is ttl + the 1-minute backdate; refresh at exactly half of it.
    assert wc.refresh_at == wc.not_before + timedelta(hours=5, seconds=30)
    assert not wc.is_expired()
    assert not wc.is_expired(wc.not_after)
    assert wc.is_expired(wc.not_after + timedelta(seconds=1))


# --- PEM ----------------------------------------------------------------------------------------------------------


def test_pem_accessors(ca: LocalCA) -> None:
    inter = build_intermediate(ca)
    leaf = inter.issue(ID, timedelta(hours=1))
    wc = WorkloadCertificate(
        cert=leaf.cert, intermediates=[inter.root_cert], roots=[ca.root_cert], private_key=leaf.private_key
    )
    assert x509.load_pem_x509_certificates(wc.chain_pem().encode()) == [leaf.cert, inter.root_cert]
    assert x509.load_pem_x509_certificates(wc.roots_pem().encode()) == [ca.root_cert]
    assert wc.key_pem().startswith("-----BEGIN PRIVATE KEY-----\n")  # PKCS#8, not "EC PRIVATE KEY"
    # full_chain_and_roots is the inverse of from_pem_chain.
    again = WorkloadCertificate.from_pem_chain(wc.full_chain_and_roots(), wc.key_pem())
    assert again == wc


def test_sequences_are_frozen(ca: LocalCA) -> None:
    leaf = ca.issue(ID, timedelta(hours=1))
    roots = [ca.root_cert]
    wc = WorkloadCertificate(cert=leaf.cert, intermediates=[], roots=roots, private_key=leaf.private_key)
    roots.clear()
    assert wc.roots == (ca.root_cert,)


def test_rejects_missing_roots_and_wrong_key(ca: LocalCA) -> None:
    a, b = ca.issue(ID, timedelta(hours=1)), ca.issue(ID, timedelta(hours=1))
    with pytest.raises(CertificateError, match="no root certificate"):
        WorkloadCertificate(cert=a.cert, intermediates=[], roots=[], private_key=a.private_key)
    with pytest.raises(CertificateError, match="does not match the leaf"):
        WorkloadCertificate(cert=a.cert, intermediates=[], roots=[ca.root_cert], private_key=b.private_key)


# --- from_pem_chain -----------------------------------------------------------------------------------------------


def test_from_pem_chain_splits_a_multi_root_bundle(ca: LocalCA) -> None:
    other = LocalCA.generate("other.root")
    leaf = ca.issue(ID, timedelta(hours=1))
    bundle = pem(ca.root_cert) + "\n" + pem(other.root_cert)
    wc = WorkloadCertificate.from_pem_chain([pem(leaf.cert), bundle], leaf.key_pem())
    assert wc.cert == leaf.cert
    assert wc.intermediates == ()
    assert wc.roots == (ca.root_cert, other.root_cert)
    assert wc.identity == ID


def test_from_pem_chain_middle_elements_are_intermediates(ca: LocalCA) -> None:
    inter = build_intermediate(ca)
    leaf = inter.issue(ID, timedelta(hours=1))
    wc = WorkloadCertificate.from_pem_chain([pem(leaf.cert), pem(inter.root_cert), pem(ca.root_cert)], leaf.key_pem())
    assert wc.intermediates == (inter.root_cert,)
    assert wc.roots == (ca.root_cert,)


@pytest.mark.parametrize(
    ("chain", "match"),
    [
        ([], "0 element"),
        (["leaf-only"], "1 element"),
        (["garbage", "root"], r"cert_chain\[0\]"),
    ],
)
def test_from_pem_chain_errors(ca: LocalCA, chain: list[str], match: str) -> None:
    leaf = ca.issue(ID, timedelta(hours=1))
    with pytest.raises(CertificateError, match=match):
        WorkloadCertificate.from_pem_chain(chain, leaf.key_pem())


def test_from_pem_chain_bad_root_bundle_and_key(ca: LocalCA) -> None:
    leaf = ca.issue(ID, timedelta(hours=1))
    with pytest.raises(CertificateError, match=r"root bundle \(cert_chain\[1\]\)"):
        WorkloadCertificate.from_pem_chain([pem(leaf.cert), "not pem"], leaf.key_pem())
    with pytest.raises(CertificateError, match="private key"):
        WorkloadCertificate.from_pem_chain([pem(leaf.cert), pem(ca.root_cert)], "not a key")
