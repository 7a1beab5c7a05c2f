from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.identity.certs import build_leaf
from ztunnel.identity import CaFileError, CsrRejected, Identity, LocalCA, WorkloadCertificate
from ztunnel.identity.ca import CA_KEY_FILE, ROOT_CERT_FILE

TD = "cluster.local"
ID = Identity(TD, "default", "bookinfo-productpage")


def fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- root ---------------------------------------------------------------------------------------------------------


def test_generated_root_is_a_p256_self_signed_ca() -> None:
    ca = LocalCA.generate(TD)
    root = ca.root_cert
    assert root.subject == root.issuer
    assert root.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == TD
    bc = root.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = root.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature
    public = root.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    root.verify_directly_issued_by(root)  # raises if the self-signature is bad


# --- issue --------------------------------------------------------------------------------------------------------


def test_issued_leaf_matches_the_fake_ca_profile() -> None:
    ca = LocalCA.generate(TD)
    now = datetime(2030, 5, 17, 12, 0, 30, 123456, tzinfo=UTC)
    wc = ca.issue(ID, timedelta(hours=24), now=now)
    leaf = wc.cert

    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.UniformResourceIdentifier(f"spiffe://{TD}/ns/default/sa/bookinfo-productpage")]
    assert wc.identity == ID

    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment
    assert not (ku.key_cert_sign or ku.crl_sign or ku.content_commitment)
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == TD

    # TTL honoured to the second: X.509 has no sub-second times, so `now` is truncated, then backdated 1 minute.
    whole = now.replace(microsecond=0)
    assert wc.not_before == whole - timedelta(minutes=1)
    assert wc.not_after == whole + timedelta(hours=24)

    leaf.verify_directly_issued_by(ca.root_cert)
    assert isinstance(wc.private_key, ec.EllipticCurvePrivateKey) and wc.private_key.curve.name == "secp256r1"
    assert list(wc.roots) == [ca.root_cert]
    assert list(wc.intermediates) == []


def test_each_issue_has_a_fresh_key_and_serial() -> None:
    ca = LocalCA.generate(TD)
    a, b = ca.issue(ID, timedelta(hours=1)), ca.issue(ID, timedelta(hours=1))
    assert a.cert.serial_number != b.cert.serial_number
    assert a.key_pem() != b.key_pem()


def test_issue_rejects_naive_time_and_non_positive_ttl() -> None:
    ca = LocalCA.generate(TD)
    with pytest.raises(ValueError, match="timezone-aware"):
        ca.issue(ID, timedelta(hours=1), now=datetime(2030, 1, 1))  # deliberately naive
    with pytest.raises(ValueError, match="ttl must be positive"):
        ca.issue(ID, timedelta(0))


def test_issue_signs_identities_of_other_trust_domains() -> None:
    # istiod signs for trust domain aliases with one root; the server-side trust domain check is what rejects.
    ca = LocalCA.generate(TD)
    other = Identity("other.domain", "ns", "sa")
    assert ca.issue(other, timedelta(hours=1)).identity == other


# --- sign_csr -----------------------------------------------------------------------------------------------------


def make_csr(*names: x509.GeneralName) -> tuple[str, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=True)
    csr = builder.sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode(), key


def test_sign_csr_round_trips_through_the_istiod_chain_shape() -> None:
    ca = LocalCA.generate(TD)
    csr, key = make_csr(x509.UniformResourceIdentifier(str(ID)))
    leaf = ca.sign_csr(csr, ID, timedelta(hours=2))
    leaf.verify_directly_issued_by(ca.root_cert)

    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    wc = WorkloadCertificate.from_pem_chain(ca.cert_chain(leaf), key_pem)
    assert wc.identity == ID
    assert wc.not_after - wc.not_before == timedelta(hours=2, minutes=1)
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


@pytest.mark.parametrize(
    ("names", "match"),
    [
        ((), "got none"),
        ((x509.UniformResourceIdentifier("spiffe://cluster.local/ns/default/sa/other"),), "sa/other"),
        (
            (x509.UniformResourceIdentifier(str(ID)), x509.DNSName("evil.example.com")),
            "evil.example.com",
        ),
    ],
    ids=["no-san", "wrong-identity", "extra-dns-san"],
)
def test_sign_csr_requires_exactly_the_requested_uri(names: tuple[x509.GeneralName, ...], match: str) -> None:
    ca = LocalCA.generate(TD)
    csr, _ = make_csr(*names)
    with pytest.raises(CsrRejected, match="exactly one SAN") as err:
        ca.sign_csr(csr, ID, timedelta(hours=1))
    assert match in str(err.value)
    assert str(ID) in str(err.value)


def test_sign_csr_rejects_garbage() -> None:
    with pytest.raises(CsrRejected, match="cannot parse CSR"):
        LocalCA.generate(TD).sign_csr("not a csr", ID, timedelta(hours=1))


# --- load_or_create -----------------------------------------------------------------------------------------------


def test_load_or_create_creates_private_files(tmp_path: Path) -> None:
    directory = tmp_path / "nested" / "ca"
    old_umask = os.umask(0)  # a permissive umask must not loosen the modes
    try:
        ca = LocalCA.load_or_create(directory, TD)
    finally:
        os.umask(old_umask)
    assert mode(directory) == 0o700
    assert mode(directory / CA_KEY_FILE) == 0o600
    assert mode(directory / ROOT_CERT_FILE) == 0o644
    assert (directory / ROOT_CERT_FILE).read_text() == ca.root_pem()
    assert sorted(p.name for p in directory.iterdir()) == sorted([".lock", CA_KEY_FILE, ROOT_CERT_FILE])


def test_load_or_create_reloads_the_same_pair(tmp_path: Path) -> None:
    first = LocalCA.load_or_create(tmp_path, TD)
    second = LocalCA.load_or_create(tmp_path, TD)
    assert fingerprint(first.root_cert) == fingerprint(second.root_cert)
    assert first.root_key.private_numbers() == second.root_key.private_numbers()
    # A leaf from the reloaded CA chains to the original root.
    second.issue(ID, timedelta(hours=1)).cert.verify_directly_issued_by(first.root_cert)


def test_existing_directory_mode_is_left_alone(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    LocalCA.load_or_create(tmp_path, TD)
    assert mode(tmp_path) == 0o755


@pytest.mark.parametrize("corrupt", [ROOT_CERT_FILE, CA_KEY_FILE])
def test_corrupt_file_is_named(tmp_path: Path, corrupt: str) -> None:
    LocalCA.load_or_create(tmp_path, TD)
    (tmp_path / corrupt).write_text("-----BEGIN GARBAGE-----\nnope\n")
    with pytest.raises(CaFileError) as err:
        LocalCA.load_or_create(tmp_path, TD)
    assert str(tmp_path / corrupt) in str(err.value)


def test_mismatched_pair_names_both_files(tmp_path: Path) -> None:
    LocalCA.load_or_create(tmp_path, TD)
    other = LocalCA.generate(TD)
    (tmp_path / CA_KEY_FILE).write_bytes(
        other.root_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(CaFileError, match="does not match") as err:
        LocalCA.load_or_create(tmp_path, TD)
    assert str(tmp_path / CA_KEY_FILE) in str(err.value)
    assert str(tmp_path / ROOT_CERT_FILE) in str(err.value)


def test_non_ca_certificate_is_rejected(tmp_path: Path) -> None:
    leaf = build_leaf(LocalCA.generate(TD), uris=[str(ID)])
    (tmp_path / ROOT_CERT_FILE).write_text(leaf.chain_pem())
    (tmp_path / CA_KEY_FILE).write_text(leaf.key_pem())
    with pytest.raises(CaFileError, match="not a CA certificate"):
        LocalCA.load_or_create(tmp_path, TD)


@pytest.mark.parametrize("remaining", [ROOT_CERT_FILE, CA_KEY_FILE])
def test_half_pair_is_reported_not_overwritten(tmp_path: Path, remaining: str) -> None:
    LocalCA.load_or_create(tmp_path, TD)
    missing = CA_KEY_FILE if remaining == ROOT_CERT_FILE else ROOT_CERT_FILE
    before = (tmp_path / remaining).read_bytes()
    (tmp_path / missing).unlink()
    with pytest.raises(CaFileError, match="is missing") as err:
        LocalCA.load_or_create(tmp_path, TD)
    assert str(tmp_path / missing) in str(err.value)
    assert (tmp_path / remaining).read_bytes() == before


def test_concurrent_threads_agree_on_one_root(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    start = threading.Barrier(8)
    results: list[bytes] = []
    lock = threading.Lock()

    def run() -> None:
        start.wait()
        ca = LocalCA.load_or_create(directory, TD)
        with lock:
            results.append(fingerprint(ca.root_cert))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    assert len(set(results)) == 1
    on_disk = x509.load_pem_x509_certificate((directory / ROOT_CERT_FILE).read_bytes())
    assert results[0] == fingerprint(on_disk)


def test_concurrent_processes_agree_on_one_root(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    go = tmp_path / "go"
    # Each child waits for the "go" file so that they race on creation rather than start one after another.
    script = (
        "import sys, time, pathlib\n"
        "from cryptography.hazmat.primitives import hashes\n"
        "from ztunnel.identity import LocalCA\n"
        "go = pathlib.Path(sys.argv[2])\n"
        "while not go.exists(): time.sleep(0.001)\n"
        "ca = LocalCA.load_or_create(pathlib.Path(sys.argv[1]), 'cluster.local')\n"
        "print(ca.root_cert.fingerprint(hashes.SHA256()).hex())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(directory), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(4)
    ]
    go.touch()
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        outputs.append(out.decode().strip())
    assert len(set(outputs)) == 1
    on_disk = x509.load_pem_x509_certificate((directory / ROOT_CERT_FILE).read_bytes())
    assert outputs[0] == fingerprint(on_disk).hex()
