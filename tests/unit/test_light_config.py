"""guard/kube/config.py's light reader gives the CLI what the official loader gives ``serve``.

For each kind of credentials the reader takes, the light configuration and the official client's
``Configuration`` (``kubernetes.config.load_kube_config``) agree on the server, TLS verification and
server name, the Authorization header, and the bytes of the CA, client certificate and key files;
everything else (exec, auth-provider, basic auth, a proxy, a broken file) is left to the official loader,
so its result and its error messages are the ones ``serve`` gets.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from guard.kube.config import KubeConfigError, LightConfiguration, load_cli_configuration, load_configuration

CA, CERT, KEY = b"-----CA-----\n", b"-----CERT-----\n", b"-----KEY-----\n"


def b64(data: bytes) -> str:
    return base64.standard_b64encode(data).decode()


def kubeconfig(tmp: Path, cluster: dict, user: dict, *, as_json: bool = False) -> str:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "contexts": [{"name": "other", "context": {"cluster": "x", "user": "x"}},
                        {"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}]}
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc) if not as_json else __import__("json").dumps(doc))
    return str(path)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _seen(cfg) -> dict:
    auth = cfg.auth_settings().get("BearerToken", {}).get("value")
    # (a token file's final newline: the official loader keeps it, which no header can carry; the light one drops it)
    return {"host": cfg.host, "verify_ssl": cfg.verify_ssl, "tls_server_name": cfg.tls_server_name or None,
            "authorization": auth.strip() if auth else None, "ca": _read(cfg.ssl_ca_cert), "cert": _read(cfg.cert_file),
            "key": _read(cfg.key_file)}


CASES = {
    "token-ca-data": ({"server": "https://10.0.0.1:6443", "certificate-authority-data": b64(CA)}, {"token": "t0k"}),
    "client-cert-data": ({"server": "https://10.0.0.1:6443/", "certificate-authority-data": b64(CA),
                          "tls-server-name": "kubernetes"},
                         {"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)}),
    "files-relative": ({"server": "https://h:6443", "certificate-authority": "ca.crt"},
                       {"client-certificate": "c.crt", "client-key": "c.key"}),
    "token-file-insecure": ({"server": "https://h:6443", "insecure-skip-tls-verify": True}, {"tokenFile": "tok"}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("as_json", [False, True], ids=["yaml", "json"])
def test_light_equals_official(tmp_path, case, as_json):
    (tmp_path / "ca.crt").write_bytes(CA)
    (tmp_path / "c.crt").write_bytes(CERT)
    (tmp_path / "c.key").write_bytes(KEY)
    (tmp_path / "tok").write_text("file-token\n")
    path = kubeconfig(tmp_path, *CASES[case], as_json=as_json)
    light = load_cli_configuration(path)
    assert isinstance(light, LightConfiguration)
    assert _seen(light) == _seen(load_configuration(path))


@pytest.mark.parametrize("user", [
    {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true"}},
    {"auth-provider": {"name": "oidc", "config": {}}},
    {"username": "a", "password": "b"},
], ids=["exec", "auth-provider", "basic"])
def test_other_credentials_go_to_the_official_loader(tmp_path, user):
    path = kubeconfig(tmp_path, {"server": "https://h:6443", "certificate-authority-data": b64(CA)}, user)
    try:
        cfg = load_cli_configuration(path)
    except KubeConfigError as e:  # the official loader's own complaint about this user (the light one has none)
        assert "Invalid kube-config file" in str(e) and str(e) == _official_error(path)
    else:
        assert not isinstance(cfg, LightConfiguration)


def _official_error(path: str) -> str:
    with pytest.raises(KubeConfigError) as e:
        load_configuration(path)
    return str(e.value)


def test_a_proxy_goes_to_the_official_loader(tmp_path, monkeypatch):
    path = kubeconfig(tmp_path, {"server": "https://h:6443", "certificate-authority-data": b64(CA)}, {"token": "t"})
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not isinstance(load_cli_configuration(path), LightConfiguration)


@pytest.mark.parametrize("make", [
    lambda d: str(d / "missing"),
    lambda d: (d / "empty").write_text("") and str(d / "empty"),
    lambda d: kubeconfig(d, {"server": "https://h:6443", "certificate-authority": "nope.crt"}, {"token": "t"}),
], ids=["missing-file", "empty-file", "missing-ca"])
def test_errors_are_the_official_loaders(tmp_path, make):
    path = make(tmp_path) or str(tmp_path / "empty")
    with pytest.raises(KubeConfigError) as official:
        load_configuration(path)
    with pytest.raises(KubeConfigError) as light:
        load_cli_configuration(path)
    assert str(light.value) == str(official.value)
