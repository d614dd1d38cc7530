"""X.509 certificates for kvflow's TLS endpoints, made in memory with ``cryptography``.

The router serves its ext_proc port over TLS by default; without a certificate from a Secret
it makes a self-signed one at start-up, as the Inference Extension's endpoint picker does
(gateways that speak to an EPP do not verify it unless told to). ``authority`` and ``issue``
make a small CA and certificates signed by it, for mutual TLS and for tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvflow"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _pem(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> KeyPair:
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))


def _builder(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


def authority(common_name: str = "kvflow test CA") -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(_name(common_name), _name(common_name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return _pem(key, cert)


def issue(ca: KeyPair | None, hosts: Sequence[str], *, client: bool = False) -> KeyPair:
    """A leaf certificate for ``hosts`` (DNS names or IPs), signed by ``ca`` or by itself."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(hosts[0] if hosts else "kvflow")
    if ca is None:
        issuer_name, signer = subject, key
    else:
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        issuer_name, signer = ca_cert.subject, ca_key
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (_builder(subject, issuer_name, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if hosts:
        builder = builder.add_extension(_alt_names(hosts), critical=False)
    return _pem(key, builder.sign(signer, hashes.SHA256()))


def self_signed(hosts: Sequence[str] = ("localhost",)) -> KeyPair:
    return issue(None, hosts)
