"""Certificates for the guard: a private CA, the serving certificate, one
client certificate per caller role (kube-scheduler, kube-apiserver, monitoring).

This is the CLI's half (``ghost-guard certs``): the running guard never
imports it. Serving those files, and following them when they are renewed, is
:mod:`guard.serving.tls`.

* :func:`generate` writes ``ca.crt``/``ca.key``, ``tls.crt``/``tls.key`` (the
  guard's serving certificate), ``client.crt``/``client.key`` (the client
  certificate kube-scheduler presents for mTLS), ``apiserver.crt``/``apiserver.key``
  (kube-apiserver's, for the admission webhook) and ``monitoring.crt``/``monitoring.key``
  (Prometheus's and the probes'). Each endpoint answers only its role's names
  (guard.core.identity). ``ghost-guard certs`` calls it
  through :func:`certs_command`.

Why a private CA: with ``enableHTTPS: true`` and no CA, kube-scheduler silently
skips verification (pkg/scheduler/extender.go, the ``tlsConfig`` of an
``extenders[]`` entry), so the extender entry must carry a
``caFile``; the same CA signs the scheduler's client certificate, which the
guard then requires (``--client-ca``). Anyone holding ``ca.key`` can mint a
client certificate the guard accepts: keep it out of the cluster.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "CLIENT_CERT",
    "APISERVER_CERT",
    "APISERVER_COMMON_NAME",
    "APISERVER_KEY",
    "CLIENT_COMMON_NAME",
    "CLIENT_KEY",
    "KEY_TYPES",
    "MONITORING_CERT",
    "MONITORING_COMMON_NAME",
    "MONITORING_KEY",
    "TLS_CERT",
    "TLS_KEY",
    "CertBundle",
    "CertError",
    "certs_command",
    "default_dns_names",
    "generate",
]

log = logging.getLogger("guard.certs")

CA_CERT, CA_KEY = "ca.crt", "ca.key"
TLS_CERT, TLS_KEY = "tls.crt", "tls.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"  # kube-scheduler's (the scheduler role)
APISERVER_CERT, APISERVER_KEY = "apiserver.crt", "apiserver.key"  # kube-apiserver's, for the webhook
MONITORING_CERT, MONITORING_KEY = "monitoring.crt", "monitoring.key"  # Prometheus's and the probes'
ALL_FILES = (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY, CLIENT_CERT, CLIENT_KEY, APISERVER_CERT, APISERVER_KEY,
             MONITORING_CERT, MONITORING_KEY)

#: The client certificates' common names, one per caller role; the defaults of
#: --scheduler-identities, --apiserver-identities and --monitoring-identities
#: (guard.core.settings; tests/unit/test_certs.py checks that the serve defaults accept
#: each certificate for its own role and no other). With --client-ca the guard
#: answers each endpoint only for its role's names (guard.core.identity).
CLIENT_COMMON_NAME = "system:kube-scheduler"
APISERVER_COMMON_NAME = "kube-apiserver-ghost-guard-client"
MONITORING_COMMON_NAME = "ghost-guard-monitoring"

KeyType = Literal["ecdsa-p256", "rsa-2048", "rsa-3072"]
KEY_TYPES: tuple[str, ...] = ("ecdsa-p256", "rsa-2048", "rsa-3072")

#: Backdate ``notBefore`` so a node whose clock runs a little behind accepts a
#: certificate issued a moment ago.
CLOCK_SKEW = dt.timedelta(minutes=5)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class CertError(Exception):
    """Bad input or an unusable file; the message is one line for the operator."""


@dataclass(frozen=True)
class CertBundle:
    """What :func:`generate` wrote."""

    out_dir: Path
    ca_cert: Path
    ca_key: Path
    tls_cert: Path
    tls_key: Path
    client_cert: Path
    client_key: Path
    apiserver_cert: Path
    apiserver_key: Path
    monitoring_cert: Path
    monitoring_key: Path
    #: base64 of the PEM CA certificate: the ``caBundle`` of a webhook config.
    ca_bundle: str
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    #: ``notAfter`` of the serving and client certificates (UTC).
    not_after: dt.datetime
    ca_not_after: dt.datetime
    #: True when the existing CA was kept (``renew=True``).
    ca_reused: bool = False

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.ca_cert, self.ca_key, self.tls_cert, self.tls_key, self.client_cert, self.client_key,
                self.apiserver_cert, self.apiserver_key, self.monitoring_cert, self.monitoring_key)


# --- input validation -----------------------------------------------------


def _check_dns_label(value: str, what: str) -> str:
    if not _DNS_LABEL.match(value):
        raise CertError(f"invalid {what} {value!r}: must be a DNS-1123 label (lowercase letters, digits, '-', at most 63)")
    return value


def _check_dns_name(value: str) -> str:
    name = value.strip().lower().rstrip(".")
    labels = name.split(".")
    if labels and labels[0] == "*":  # a wildcard only as the whole leftmost label
        labels = labels[1:]
    if not name or len(name) > 253 or not labels or not all(_DNS_LABEL.match(label) for label in labels):
        raise CertError(f"invalid --dns {value!r}: not a DNS name")
    return name


def _check_ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError as e:
        raise CertError(f"invalid --ip {value!r}: not an IPv4 or IPv6 address") from e


def default_dns_names(namespace: str, service: str) -> list[str]:
    """The names the serving certificate always carries."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", "localhost"]


DEFAULT_IPS = ("127.0.0.1",)


def _dedupe(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --- key and certificate building ------------------------------------------


def _new_key(key_type: str):
    if key_type == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa-2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if key_type == "rsa-3072":
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    raise CertError(f"invalid --key-type {key_type!r}: choose one of {', '.join(KEY_TYPES)}")


def _key_usage(key, *, ca: bool) -> x509.KeyUsage:
    rsa_key = isinstance(key, rsa.RSAPrivateKey)
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=rsa_key and not ca,  # RSA key exchange; meaningless for ECDSA
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kube-ghost-guard"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _build_ca(key, now: dt.datetime, ca_days: int, namespace: str) -> x509.Certificate:
    subject = _name(f"ghost-guard CA ({namespace})")
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=ca_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key, ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _build_leaf(key, ca_cert: x509.Certificate, ca_key, *, common_name: str, now: dt.datetime, not_after: dt.datetime,
                usage: x509.ObjectIdentifier, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(key, ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if dns or ips:
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# --- writing files --------------------------------------------------------


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (never replacing an existing file) with ``mode`` from the start."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as e:
        raise CertError(f"{path} already exists: pass --force to overwrite (or --renew to keep the CA)") from e
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_replace(path: Path, data: bytes, mode: int) -> None:
    """Atomically replace ``path``: readers see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates with 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_ca(out_dir: Path):
    cert_path, key_path = out_dir / CA_CERT, out_dir / CA_KEY
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError as e:
        raise CertError(f"--renew needs the existing CA: {e.filename} not found") from e
    except ValueError as e:
        raise CertError(f"--renew: cannot load the CA from {out_dir}: {e}") from e
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)  # any key type
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise CertError(f"--renew: {key_path} does not match {cert_path}")
    return cert, key


def _existing_sans(path: Path) -> tuple[list[str], list[str]]:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return [], []
    return list(san.get_values_for_type(x509.DNSName)), [str(i) for i in san.get_values_for_type(x509.IPAddress)]


# --- public API -----------------------------------------------------------


def generate(
    out_dir: Path,
    *,
    namespace: str = "ghost-guard",
    service: str = "ghost-guard",
    dns: list[str] | None = None,
    ips: list[str] | None = None,
    days: int = 365,
    ca_days: int = 3650,
    force: bool = False,
    renew: bool = False,
    key_type: str = "ecdsa-p256",
) -> CertBundle:
    """Write a CA, the guard's serving certificate and one client certificate per caller role
    (kube-scheduler: ``client.crt``, kube-apiserver: ``apiserver.crt``, monitoring: ``monitoring.crt``).

    The serving certificate always carries ``<service>.<namespace>.svc``,
    ``<service>.<namespace>.svc.cluster.local``, ``localhost`` and
    ``127.0.0.1``; ``dns`` and ``ips`` are *added* to those (with ``renew``,
    so are the names of the serving certificate being replaced).

    Without ``force`` or ``renew`` no existing file is touched: the first one
    found raises :class:`CertError` naming it. ``force`` replaces all six files
    (a new CA: every ``caBundle``/``caFile`` must be updated). ``renew`` keeps
    ``ca.crt``/``ca.key`` and replaces the leaf files, so nothing that
    trusts the CA changes. Replacements are atomic (write to a temporary file,
    then rename); private keys are created with mode 0600.
    """
    out_dir = Path(out_dir)
    _check_dns_label(namespace, "--namespace")
    _check_dns_label(service, "--service")
    if days < 1 or ca_days < 1:
        raise CertError(f"--days ({days}) and --ca-days ({ca_days}) must be at least 1")
    if key_type not in KEY_TYPES:
        raise CertError(f"invalid --key-type {key_type!r}: choose one of {', '.join(KEY_TYPES)}")
    if force and renew:
        raise CertError("--force and --renew exclude each other (--force also replaces the CA)")
    dns_names = _dedupe(default_dns_names(namespace, service) + [_check_dns_name(d) for d in dns or []])
    ip_addresses = _dedupe(list(DEFAULT_IPS) + [_check_ip(i) for i in ips or []])

    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    not_after = now + dt.timedelta(days=days)
    if renew:
        ca_cert, ca_key = _load_ca(out_dir)
        # Keep the names the current serving certificate has, so a renewal
        # never silently drops a --dns/--ip given when it was first issued.
        old_dns, old_ips = _existing_sans(out_dir / TLS_CERT)
        dns_names = _dedupe(list(dns_names) + old_dns)
        ip_addresses = _dedupe(list(ip_addresses) + old_ips)
        ca_not_after = ca_cert.not_valid_after_utc
        if ca_not_after <= now:
            raise CertError(f"--renew: the CA in {out_dir / CA_CERT} expired at {ca_not_after:%Y-%m-%d %H:%M}Z; use --force")
    else:
        if days > ca_days:
            raise CertError(f"--days ({days}) must not exceed --ca-days ({ca_days}): a certificate cannot outlive its CA")
        if not force:
            for name in ALL_FILES:
                if (out_dir / name).exists():
                    raise CertError(f"{out_dir / name} already exists: pass --force to overwrite (or --renew to keep the CA)")
        ca_key = _new_key(key_type)
        ca_cert = _build_ca(ca_key, now, ca_days, namespace)
        ca_not_after = ca_cert.not_valid_after_utc
    # A leaf never outlives the CA that signed it (relevant with --renew).
    not_after = min(not_after, ca_not_after)

    tls_key = _new_key(key_type)
    tls_cert = _build_leaf(tls_key, ca_cert, ca_key, common_name=f"{service}.{namespace}.svc", now=now, not_after=not_after,
                           usage=ExtendedKeyUsageOID.SERVER_AUTH, dns=dns_names, ips=ip_addresses)
    clients = {}
    for cert_name, key_name, common_name in ((CLIENT_CERT, CLIENT_KEY, CLIENT_COMMON_NAME),
                                             (APISERVER_CERT, APISERVER_KEY, APISERVER_COMMON_NAME),
                                             (MONITORING_CERT, MONITORING_KEY, MONITORING_COMMON_NAME)):
        key = _new_key(key_type)
        clients[cert_name, key_name] = (key, _build_leaf(key, ca_cert, ca_key, common_name=common_name, now=now,
                                                         not_after=not_after, usage=ExtendedKeyUsageOID.CLIENT_AUTH))

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CertError(f"cannot create {out_dir}: {e.strerror}") from e
    write = _write_replace if (force or renew) else _write_new
    ca_pem = _cert_pem(ca_cert)
    # Keys before certificates: a reloader that sees the new certificate first
    # fails to pair it with the old key and keeps serving the old pair.
    plan: list[tuple[str, bytes, int]] = []
    if not renew:
        plan += [(CA_KEY, _key_pem(ca_key), 0o600), (CA_CERT, ca_pem, 0o644)]
    plan += [(TLS_KEY, _key_pem(tls_key), 0o600), (TLS_CERT, _cert_pem(tls_cert), 0o644)]
    for (cert_name, key_name), (key, cert) in clients.items():
        plan += [(key_name, _key_pem(key), 0o600), (cert_name, _cert_pem(cert), 0o644)]
    for name, data, mode in plan:
        try:
            write(out_dir / name, data, mode)
        except OSError as e:
            raise CertError(f"cannot write {out_dir / name}: {e.strerror}") from e

    return CertBundle(
        out_dir=out_dir,
        ca_cert=out_dir / CA_CERT, ca_key=out_dir / CA_KEY,
        tls_cert=out_dir / TLS_CERT, tls_key=out_dir / TLS_KEY,
        client_cert=out_dir / CLIENT_CERT, client_key=out_dir / CLIENT_KEY,
        apiserver_cert=out_dir / APISERVER_CERT, apiserver_key=out_dir / APISERVER_KEY,
        monitoring_cert=out_dir / MONITORING_CERT, monitoring_key=out_dir / MONITORING_KEY,
        ca_bundle=base64.b64encode(ca_pem).decode("ascii"),
        dns_names=dns_names, ip_addresses=ip_addresses,
        not_after=not_after, ca_not_after=ca_not_after, ca_reused=renew,
    )


def certs_command(
    out: str | Path = "certs",
    *,
    namespace: str = "ghost-guard",
    service: str = "ghost-guard",
    dns: tuple[str, ...] | list[str] = (),
    ips: tuple[str, ...] | list[str] = (),
    days: int = 365,
    ca_days: int = 3650,
    force: bool = False,
    renew: bool = False,
    key_type: str = "ecdsa-p256",
) -> str:
    """Run :func:`generate` and return the text ``ghost-guard certs`` prints.

    The last line is ``caBundle: <base64>`` (for the webhook configuration):
    ``ghost-guard certs | sed -n 's/^caBundle: //p'``. Raises :class:`CertError`.
    """
    b = generate(Path(out), namespace=namespace, service=service, dns=list(dns), ips=list(ips), days=days,
                 ca_days=ca_days, force=force, renew=renew, key_type=key_type)
    until = f"{b.not_after:%Y-%m-%d %H:%M}Z"
    ca_line = (f"kept    {b.ca_cert}  (CA, valid until {b.ca_not_after:%Y-%m-%d %H:%M}Z)" if b.ca_reused else
               f"wrote   {b.ca_cert}  {b.ca_key}  (CA, valid until {b.ca_not_after:%Y-%m-%d %H:%M}Z; keep ca.key out of the cluster)")
    lines = [
        ca_line,
        f"wrote   {b.tls_cert}  {b.tls_key}  (guard serving certificate, valid until {until})",
        f"        SANs: {', '.join(b.dns_names + b.ip_addresses)}",
        f"wrote   {b.client_cert}  {b.client_key}  (kube-scheduler client certificate, CN={CLIENT_COMMON_NAME}, valid until {until})",
        f"wrote   {b.apiserver_cert}  {b.apiserver_key}  (kube-apiserver webhook client certificate, "
        f"CN={APISERVER_COMMON_NAME}, valid until {until})",
        f"wrote   {b.monitoring_cert}  {b.monitoring_key}  (monitoring client certificate for Prometheus and the "
        f"probes, CN={MONITORING_COMMON_NAME}, valid until {until})",
        f"caBundle: {b.ca_bundle}",
    ]
    return "\n".join(lines)
