"""A small certificate authority for the local cluster: client certificates for the real node's
kubelet, kube-proxy and CoreDNS, and for the API server's calls to the kubelet.

Called by :mod:`megafleet_dev.cluster` (the CA, whose certificate the API server trusts through
``--client-ca-file``) and :mod:`megafleet_dev.realnode` (one certificate per component). The
API server maps a client certificate's common name to the user and its organizations to the groups,
so ``CN=system:node:<name>, O=system:nodes`` is a node as the Node authorizer expects.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=30)


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)


def make_ca(path: Path, common_name: str = "megafleet-dev-ca") -> None:
    """Write ``<path>.crt`` and ``<path>.key``: a self-signed CA valid for :data:`VALIDITY`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(path, key, cert)


def issue(
    ca: Path,
    path: Path,
    common_name: str,
    organizations: tuple[str, ...] = (),
    *,
    server_ips: tuple[str, ...] = (),
    server_names: tuple[str, ...] = (),
) -> None:
    """Write ``<path>.crt``/``.key`` signed by the CA at ``<ca>.crt``/``.key``: a client
    certificate, and a serving one too when ``server_ips`` or ``server_names`` (DNS) are given."""
    ca_key = serialization.load_pem_private_key(ca.with_suffix(".key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(ca.with_suffix(".crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    serving = bool(server_ips or server_names)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if serving else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if serving:
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        names += [x509.DNSName(name) for name in server_names]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    _write(path, key, builder.sign(ca_key, hashes.SHA256()))
