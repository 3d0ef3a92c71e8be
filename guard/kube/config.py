"""Cluster credentials: the official loader (``serve``), or a light reader for the CLI's cluster commands.

:func:`load_configuration` is the ``kubernetes`` client's own loader (in-cluster, then a kubeconfig);
it imports the client (about 1.5 s of CPU). :func:`load_cli_configuration` is what ``diagnose``,
``heal``, ``report --live`` and ``audit --audit-store kubernetes`` use: for the credentials most
kubeconfigs and every service account hold (a server with its CA or ``insecure-skip-tls-verify``,
``tls-server-name``, a bearer token or token file, a client certificate and key, as files or data)
it builds a :class:`LightConfiguration` without importing ``kubernetes``; anything else (an ``exec``
or ``auth-provider`` user, a proxy, several files in ``$KUBECONFIG``, a file it cannot read) goes to
the official loader, whose result and error messages are then exactly the ones ``serve`` gets.
"""

from __future__ import annotations

import atexit
import base64
import os
import shutil
import ssl
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies

SERVICE_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SERVICE_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
TOKEN_REFRESH_SECONDS = 60.0  # as the official in-cluster loader: the projected token is read again after a minute


class KubeConfigError(RuntimeError):
    """No usable cluster credentials (neither in-cluster nor a kubeconfig)."""


def load_configuration(kubeconfig: str | None) -> Any:
    """``--kubeconfig`` if given, else in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config``: the official
    client's ``Configuration``."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except ConfigException:
                config.load_kube_config(client_configuration=cfg)
    except (ConfigException, OSError, TypeError, ValueError) as e:
        where = (kubeconfig if kubeconfig else f"$KUBECONFIG ({os.environ['KUBECONFIG']})" if os.environ.get("KUBECONFIG")
                 else "the in-cluster service account, $KUBECONFIG (not set) or ~/.kube/config")
        raise KubeConfigError(f"cannot load cluster credentials from {where}: {e}; pass --kubeconfig or set "
                              "$KUBECONFIG") from e
    return cfg


def load_cli_configuration(kubeconfig: str | None) -> Any:
    """As :func:`load_configuration` (same sources, same order, same errors), as a :class:`LightConfiguration`
    when the credentials are plain ones, else the official ``Configuration``."""
    light = _light(kubeconfig)
    return light if light is not None else load_configuration(kubeconfig)


class LightConfiguration:
    """The few fields of the official ``Configuration`` that guard/kube reads, for :class:`guard.kube.api.LightApi`."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.token: str | None = None  # the Authorization header's value ("Bearer ...")
        self.refresh_api_key_hook: Any = None
        self.verify_ssl = True
        self.ssl_ca_cert: str | None = None
        self.ca_cert_data: str | None = None
        self.cert_file: str | None = None
        self.key_file: str | None = None
        self.assert_hostname: Any = None
        self.tls_server_name: str | None = None
        self.proxy: str | None = None
        self.no_proxy: str | None = None
        self.socket_options: Any = None
        self.keep_alive = False
        self.safe_chars_for_path_param = ""
        self.connection_pool_maxsize = 4
        self.retries: Any = None

    def auth_settings(self) -> dict[str, dict[str, Any]]:
        """As the official ``Configuration.auth_settings``: the refresh hook runs first."""
        if self.refresh_api_key_hook is not None:
            self.refresh_api_key_hook(self)
        if not self.token:
            return {}
        return {"BearerToken": {"type": "api_key", "in": "header", "key": "authorization", "value": self.token}}


def connection_settings(configuration: Any) -> dict[str, Any] | None:
    """The keyword arguments of urllib3's connection, as the kubernetes client builds its pool
    (``kubernetes.client.rest.RESTClientObject``), or None when a proxy applies to the host."""
    if configuration.proxy:
        from kubernetes.client.rest import should_bypass_proxies

        if not should_bypass_proxies(configuration.host, configuration.no_proxy or ""):
            return None
    kw: dict[str, Any] = {"cert_reqs": ssl.CERT_REQUIRED if configuration.verify_ssl else ssl.CERT_NONE,
                          "ca_certs": configuration.ssl_ca_cert, "cert_file": configuration.cert_file,
                          "key_file": configuration.key_file,
                          "ca_cert_data": getattr(configuration, "ca_cert_data", None)}
    if configuration.assert_hostname is not None:
        kw["assert_hostname"] = configuration.assert_hostname
    if configuration.tls_server_name:
        kw["server_hostname"] = configuration.tls_server_name
    if configuration.socket_options is not None:
        kw["socket_options"] = configuration.socket_options
    elif getattr(configuration, "keep_alive", False):
        from kubernetes.client.rest import tcp_keepalive_socket_options

        kw["socket_options"] = tcp_keepalive_socket_options()
    return kw


# --- the light reader ------------------------------------------------------------------------------

_USER_KEYS = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key", "client-key-data"}
_CLUSTER_KEYS = {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify",
                 "tls-server-name", "extensions"}
_files_dir: str | None = None


def _light(kubeconfig: str | None) -> LightConfiguration | None:
    """The light configuration, or None: the official loader decides (and words any error)."""
    try:
        if not kubeconfig:
            env = os.environ
            if env.get("KUBERNETES_SERVICE_HOST") or env.get("KUBERNETES_SERVICE_PORT"):
                return _in_cluster()
            kubeconfig = env.get("KUBECONFIG") or "~/.kube/config"
            if os.pathsep in kubeconfig:
                return None  # several files, merged by the official loader
        return _from_kubeconfig(os.path.expanduser(kubeconfig))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, UnicodeError):
        return None


def _in_cluster() -> LightConfiguration | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port or not os.path.isfile(SERVICE_TOKEN) or not os.path.isfile(SERVICE_CA):
        return None
    with open(SERVICE_CA) as f:
        if not f.read():
            return None
    cfg = LightConfiguration("https://" + (f"[{host}]:{port}" if ":" in host or "%" in host else f"{host}:{port}"))
    if _proxied(cfg.host):
        return None
    cfg.ssl_ca_cert = SERVICE_CA
    token = _token_reader(SERVICE_TOKEN, "bearer ")
    if token is None:
        return None
    cfg.refresh_api_key_hook = token
    return cfg


def _token_reader(path: str, prefix: str) -> Any:
    """A refresh hook that reads the token file again once a minute (None: no token in it now)."""
    state: dict[str, Any] = {}

    def read() -> str | None:
        with open(path) as f:
            content = f.read().strip()
        return prefix + content if content else None

    first = read()
    if first is None:
        return None
    state["token"], state["at"] = first, time.monotonic()

    def refresh(cfg: LightConfiguration) -> None:
        if time.monotonic() - state["at"] >= TOKEN_REFRESH_SECONDS:
            try:
                state["token"] = read() or state["token"]
            except OSError:
                pass
            state["at"] = time.monotonic()
        cfg.token = state["token"]

    return refresh


def _parse(text: str) -> Any:
    import orjson

    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        import yaml

        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _named(items: Any, name: str, key: str) -> dict | None:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name and isinstance(item.get(key), dict):
            return item[key]
    return None


def _from_kubeconfig(path: str) -> LightConfiguration | None:
    with open(path) as f:
        doc = _parse(f.read())
    if not isinstance(doc, dict) or not doc.get("current-context"):
        return None
    context = _named(doc.get("contexts"), doc["current-context"], "context")
    if context is None or not context.get("cluster") or not context.get("user"):
        return None
    cluster = _named(doc.get("clusters"), context["cluster"], "cluster")
    user = _named(doc.get("users"), context["user"], "user") if context.get("user") else {}
    if cluster is None or user is None or set(cluster) - _CLUSTER_KEYS or set(user) - _USER_KEYS:
        return None  # exec, auth-provider, basic auth, impersonation, a proxy...: the official loader
    server = str(cluster.get("server") or "").rstrip("/")
    if urlsplit(server).scheme not in ("https", "http") or _proxied(server):
        return None
    base = os.path.dirname(os.path.abspath(path))
    cfg = LightConfiguration(server)
    if server.startswith("https"):
        cfg.verify_ssl = not cluster.get("insecure-skip-tls-verify", False)
        cfg.ssl_ca_cert = _file(cluster, "certificate-authority", base)
        cfg.tls_server_name = cluster.get("tls-server-name") or None
        cfg.cert_file = _file(user, "client-certificate", base)
        cfg.key_file = _file(user, "client-key", base)
    if user.get("token"):
        cfg.token = "Bearer " + str(user["token"])
    elif user.get("tokenFile"):
        hook = _token_reader(_resolve(str(user["tokenFile"]), base), "Bearer ")
        if hook is None:
            return None
        cfg.refresh_api_key_hook = hook
    return cfg


def _resolve(path: str, base: str) -> str:
    return path if os.path.isabs(path) else os.path.join(base, path)


def _file(section: dict, key: str, base: str) -> str | None:
    """A file named by ``key`` (relative to the kubeconfig), or ``key-data`` (base64) written to a private
    temporary file removed at exit (as the official loader does)."""
    data = section.get(key + "-data")
    if data:
        global _files_dir
        if _files_dir is None:
            _files_dir = tempfile.mkdtemp(prefix="ghost-guard-kube-")
            atexit.register(shutil.rmtree, _files_dir, True)
        fd, name = tempfile.mkstemp(dir=_files_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.standard_b64decode(data))
        return name
    if section.get(key):
        path = _resolve(str(section[key]), base)
        if not os.path.isfile(path):
            raise ValueError(f"{key} {path} does not exist")  # the official loader's error, not ours
        return path
    return None


def _proxied(host: str) -> bool:
    """Whether an environment proxy would apply to ``host`` (the official client then uses it: its path)."""
    proxies = getproxies()
    return bool(proxies.get(urlsplit(host).scheme) or proxies.get("all"))
