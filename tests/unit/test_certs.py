"""guard/tools/certs.py generation: files, modes, chains, SANs, lifetimes, overwrite rules, bad input.

Chains are checked with cryptography's X.509 path validation (the same RFC 5280
rules Go's crypto/x509 applies in kube-scheduler); the live TLS behaviour
(mTLS, reload under load) is in tests/component/test_certs_tls.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509 import verification as v
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from guard.tools.certs import CertError, certs_command, generate

FILES = ["ca.crt", "ca.key", "tls.crt", "tls.key", "client.crt", "client.key", "apiserver.crt", "apiserver.key",
         "monitoring.crt", "monitoring.key"]


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    return generate(out, namespace="kube-system", dns=["guard.example.com"], ips=["10.96.0.50", "fd00::50"])


def server_verifier(ca: x509.Certificate, name):
    return v.PolicyBuilder().store(v.Store([ca])).build_server_verifier(name)


def test_writes_ten_files_keys_private(bundle):
    assert sorted(p.name for p in bundle.out_dir.iterdir()) == sorted(FILES)
    assert [p.name for p in bundle.files] == FILES
    for name in (f for f in FILES if f.endswith(".key")):
        assert mode(bundle.out_dir / name) == 0o600, name
    for name in (f for f in FILES if f.endswith(".crt")):
        assert mode(bundle.out_dir / name) & 0o077 == 0o044, name  # world-readable, writable by owner only


def test_ca_bundle_is_base64_of_ca_pem(bundle):
    assert base64.b64decode(bundle.ca_bundle) == bundle.ca_cert.read_bytes()


def test_ca_is_a_ca(bundle):
    ca = load(bundle.ca_cert)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert ca.subject == ca.issuer


SANS = [
    ("service", x509.DNSName("ghost-guard.kube-system.svc")),
    ("service-fqdn", x509.DNSName("ghost-guard.kube-system.svc.cluster.local")),
    ("localhost", x509.DNSName("localhost")),
    ("extra-dns", x509.DNSName("guard.example.com")),
    ("loopback", x509.IPAddress(ipaddress.ip_address("127.0.0.1"))),
    ("extra-ipv4", x509.IPAddress(ipaddress.ip_address("10.96.0.50"))),
    ("extra-ipv6", x509.IPAddress(ipaddress.ip_address("fd00::50"))),
]


@pytest.mark.parametrize("name", [s[1] for s in SANS], ids=[s[0] for s in SANS])
def test_serving_cert_verifies_for_every_san(bundle, name):
    chain = server_verifier(load(bundle.ca_cert), name).verify(load(bundle.tls_cert), [])
    assert chain[-1] == load(bundle.ca_cert)


@pytest.mark.parametrize("name", [x509.DNSName("ghost-guard.default.svc"), x509.DNSName("evil.example.com"),
                                  x509.IPAddress(ipaddress.ip_address("10.96.0.51"))],
                         ids=["other-namespace", "unrelated-name", "other-ip"])
def test_serving_cert_rejected_for_other_names(bundle, name):
    with pytest.raises(v.VerificationError):
        server_verifier(load(bundle.ca_cert), name).verify(load(bundle.tls_cert), [])


def test_san_list_exact(bundle):
    san = load(bundle.tls_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ghost-guard.kube-system.svc", "ghost-guard.kube-system.svc.cluster.local",
                                                     "localhost", "guard.example.com"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.96.0.50", "fd00::50"]
    assert bundle.dns_names == ("ghost-guard.kube-system.svc", "ghost-guard.kube-system.svc.cluster.local", "localhost", "guard.example.com")
    assert bundle.ip_addresses == ("127.0.0.1", "10.96.0.50", "fd00::50")


def test_client_cert_is_for_kube_scheduler_client_auth(bundle):
    client = load(bundle.client_cert)
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-scheduler"
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    client.verify_directly_issued_by(load(bundle.ca_cert))  # signature + issuer; the handshake test is in integration
    assert not client.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


@pytest.mark.parametrize("role,expected_cn", [("client", "system:kube-scheduler"),
                                              ("apiserver", "kube-apiserver-ghost-guard-client"),
                                              ("monitoring", "ghost-guard-monitoring")])
def test_one_client_cert_per_role_named_as_the_identity_defaults(bundle, role, expected_cn):
    from guard.core.identity import APISERVER, MONITORING, SCHEDULER, RolePolicy
    from guard.core.settings import Settings

    cert = load(getattr(bundle, f"{role}_cert"))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == expected_cn
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(load(bundle.ca_cert))
    # The serve defaults accept exactly this certificate for its own role.
    policy = RolePolicy.from_settings(Settings())
    own = {"client": SCHEDULER, "apiserver": APISERVER, "monitoring": MONITORING}[role]
    assert {r for r, names in policy.identities.items() if expected_cn in names} == {own}


def test_serving_cert_is_server_auth_only(bundle):
    tls = load(bundle.tls_cert)
    assert list(tls.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not tls.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_lifetimes(bundle):
    ca, tls, client = load(bundle.ca_cert), load(bundle.tls_cert), load(bundle.client_cert)
    skew = dt.timedelta(minutes=5)
    assert tls.not_valid_after_utc - tls.not_valid_before_utc == dt.timedelta(days=365) + skew
    assert client.not_valid_after_utc == tls.not_valid_after_utc
    assert ca.not_valid_after_utc - ca.not_valid_before_utc == dt.timedelta(days=3650) + skew
    assert tls.not_valid_before_utc <= dt.datetime.now(dt.timezone.utc)
    assert bundle.not_after == tls.not_valid_after_utc and bundle.ca_not_after == ca.not_valid_after_utc


@pytest.mark.parametrize("key_type,expected", [("ecdsa-p256", ("ec", 256)), ("rsa-2048", ("rsa", 2048)), ("rsa-3072", ("rsa", 3072))],
                         ids=["ecdsa-default", "rsa-2048", "rsa-3072"])
def test_key_types(tmp_path, key_type, expected):
    b = generate(tmp_path, key_type=key_type)
    for cert in (b.ca_cert, b.tls_cert, b.client_cert):
        key = load(cert).public_key()
        kind = "ec" if isinstance(key, ec.EllipticCurvePublicKey) else "rsa" if isinstance(key, rsa.RSAPublicKey) else "?"
        assert (kind, key.key_size) == expected
    server_verifier(load(b.ca_cert), x509.DNSName("localhost")).verify(load(b.tls_cert), [])


def test_default_is_ecdsa_p256(tmp_path):
    key = load(generate(tmp_path).tls_cert).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)


# --- overwrite rules ----------------------------------------------------


def test_never_overwrites_without_force(tmp_path):
    generate(tmp_path)
    before = {n: (tmp_path / n).read_bytes() for n in FILES}
    with pytest.raises(CertError) as e:
        generate(tmp_path)
    assert str(e.value) == f"{tmp_path / 'ca.crt'} already exists: pass --force to overwrite (or --renew to keep the CA)"
    assert {n: (tmp_path / n).read_bytes() for n in FILES} == before


def test_one_existing_file_blocks_all_and_is_named(tmp_path):
    (tmp_path / "client.key").write_text("mine")
    with pytest.raises(CertError) as e:
        generate(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'client.key'} already exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client.key"]
    assert (tmp_path / "client.key").read_text() == "mine"


def test_force_replaces_everything_with_private_modes(tmp_path):
    first = generate(tmp_path)
    os.chmod(tmp_path / "tls.key", 0o644)
    second = generate(tmp_path, force=True)
    assert second.ca_bundle != first.ca_bundle
    assert mode(tmp_path / "tls.key") == 0o600 and mode(tmp_path / "ca.key") == 0o600
    server_verifier(load(second.ca_cert), x509.DNSName("localhost")).verify(load(second.tls_cert), [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)  # no temporary files left


def test_renew_keeps_ca_and_names(tmp_path):
    first = generate(tmp_path, dns=["guard.example.com"], ips=["10.0.0.9"])
    ca_before = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "ca.key").read_bytes()
    tls_before = load(first.tls_cert).serial_number
    second = generate(tmp_path, renew=True, ips=["10.0.0.10"])
    assert ((tmp_path / "ca.crt").read_bytes(), (tmp_path / "ca.key").read_bytes()) == ca_before
    assert second.ca_bundle == first.ca_bundle and second.ca_reused
    assert load(second.tls_cert).serial_number != tls_before
    assert "guard.example.com" in second.dns_names
    assert second.ip_addresses == ("127.0.0.1", "10.0.0.10", "10.0.0.9")
    server_verifier(load(second.ca_cert), x509.IPAddress(ipaddress.ip_address("10.0.0.9"))).verify(load(second.tls_cert), [])
    assert mode(tmp_path / "client.key") == 0o600


def test_renew_needs_a_ca(tmp_path):
    with pytest.raises(CertError) as e:
        generate(tmp_path, renew=True)
    assert str(e.value) == f"--renew needs the existing CA: {tmp_path / 'ca.crt'} not found"


def test_renew_rejects_mismatched_ca_key(tmp_path):
    generate(tmp_path / "a")
    generate(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    with pytest.raises(CertError) as e:
        generate(tmp_path / "a", renew=True)
    assert str(e.value) == f"--renew: {tmp_path / 'a' / 'ca.key'} does not match {tmp_path / 'a' / 'ca.crt'}"


# --- bad input ----------------------------------------------------------

BAD = [
    ("bad-ipv4", {"ips": ["300.1.1.1"]}, "invalid --ip '300.1.1.1': not an IPv4 or IPv6 address"),
    ("ip-is-a-name", {"ips": ["localhost"]}, "invalid --ip 'localhost': not an IPv4 or IPv6 address"),
    ("dns-with-space", {"dns": ["bad name.example"]}, "invalid --dns 'bad name.example': not a DNS name"),
    ("dns-underscore", {"dns": ["a_b.example"]}, "invalid --dns 'a_b.example': not a DNS name"),
    ("dns-empty", {"dns": [""]}, "invalid --dns '': not a DNS name"),
    ("dns-bare-wildcard", {"dns": ["*"]}, "invalid --dns '*': not a DNS name"),
    ("namespace-upper", {"namespace": "Kube"},
     "invalid --namespace 'Kube': must be a DNS-1123 label (lowercase letters, digits, '-', at most 63)"),
    ("service-dot", {"service": "a.b"},
     "invalid --service 'a.b': must be a DNS-1123 label (lowercase letters, digits, '-', at most 63)"),
    ("days-zero", {"days": 0}, "--days (0) and --ca-days (3650) must be at least 1"),
    ("leaf-outlives-ca", {"days": 400, "ca_days": 365},
     "--days (400) must not exceed --ca-days (365): a certificate cannot outlive its CA"),
    ("key-type", {"key_type": "dsa"}, "invalid --key-type 'dsa': choose one of ecdsa-p256, rsa-2048, rsa-3072"),
    ("force-and-renew", {"force": True, "renew": True}, "--force and --renew exclude each other (--force also replaces the CA)"),
]


@pytest.mark.parametrize("kwargs,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_clear_error_nothing_written(tmp_path, kwargs, message):
    out = tmp_path / "out"
    with pytest.raises(CertError) as e:
        generate(out, **kwargs)
    assert str(e.value) == message
    assert not out.exists()


def test_wildcard_and_case_normalised(tmp_path):
    b = generate(tmp_path, dns=["*.Guard.Example.com."])
    assert b.dns_names[-1] == "*.guard.example.com"


def test_certs_command_text(tmp_path):
    text = certs_command(tmp_path, ips=["10.0.0.1"])
    lines = text.splitlines()
    assert lines[-1] == "caBundle: " + base64.b64encode((tmp_path / "ca.crt").read_bytes()).decode()
    assert lines[2] == ("        SANs: ghost-guard.ghost-guard.svc, ghost-guard.ghost-guard.svc.cluster.local, localhost, "
                        "127.0.0.1, 10.0.0.1")


# --- the real command ----------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from guard.cli import main; sys.exit(main(prog_name='ghost-guard'))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


def test_cli_certs_writes_prints_and_refuses_overwrite(tmp_path):
    out = tmp_path / "c"
    first = run_cli("certs", "--out", str(out), "--namespace", "guard-system")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1] == "caBundle: " + base64.b64encode((out / "ca.crt").read_bytes()).decode()
    assert "ghost-guard.guard-system.svc" in first.stdout
    again = run_cli("certs", "--out", str(out))
    assert again.returncode == 1
    assert again.stderr.strip() == f"Error: {out / 'ca.crt'} already exists: pass --force to overwrite (or --renew to keep the CA)"
    renewed = run_cli("certs", "--out", str(out), "--renew")
    assert renewed.returncode == 0, renewed.stderr
    assert renewed.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]


def test_cli_bad_ip_exits_nonzero_one_line(tmp_path):
    r = run_cli("certs", "--out", str(tmp_path / "c"), "--ip", "1.2.3")
    assert r.returncode == 1
    assert r.stderr.strip() == "Error: invalid --ip '1.2.3': not an IPv4 or IPv6 address"
    assert not (tmp_path / "c").exists()


def test_out_is_a_file_clear_error(tmp_path):
    out = tmp_path / "certs"
    out.write_text("not a directory")
    with pytest.raises(CertError) as e:
        generate(out)
    assert str(e.value) == f"cannot create {out}: File exists"
