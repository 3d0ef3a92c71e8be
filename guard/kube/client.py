"""Kubernetes reads: the only module that imports ``kubernetes``.

Build one :class:`Kube` per process *after* gunicorn forks (TLS connections
shared across a fork corrupt: kubernetes-client/python#1000). Every call
carries a timeout; every client error is translated here into data
(:class:`~guard.core.verdict.QuorumRead`) so the callers never see a client
exception.
"""

from __future__ import annotations

import copy
import logging
import os
import ssl
import threading
from collections.abc import Iterator
from urllib.parse import quote
from typing import Any

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import should_bypass_proxies, tcp_keepalive_socket_options
from kubernetes.config.config_exception import ConfigException

from guard.core.attribution import ReplicaObservation, http_error, transport_error
from guard.core.heal_plan import is_placeholder
from guard.kube.transport import Connections, GetError
from guard.core.names import namespace_problem, pod_identity_problem, pod_name_problem, visible
from guard.core.settings import Replica
from guard.core.verdict import QuorumRead, shows_pending

log = logging.getLogger("guard.kube")


class KubeConfigError(RuntimeError):
    """No usable cluster credentials (neither in-cluster nor a kubeconfig)."""


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """``--kubeconfig`` if given, else in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config``."""
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


def _status_reason(e: ApiException) -> tuple[str, dict]:
    return _error_reason(e.body, e.reason)


def _error_reason(data: str | bytes | None, http_reason: str | None) -> tuple[str, dict]:
    """The apiserver's Status ``reason`` of an error reply (else the HTTP reason phrase), and the Status."""
    try:
        body = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return str(body.get("reason") or http_reason or ""), body


class KubeWriteError(Exception):
    """A write the apiserver refused or did not answer: ``status`` (0: no answer), ``reason``, ``message``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def connection_settings(configuration: Any) -> dict[str, Any] | None:
    """The keyword arguments of urllib3's connection, as the kubernetes client builds its pool
    (``kubernetes.client.rest.RESTClientObject``), or None when a proxy applies to the host."""
    if configuration.proxy and not should_bypass_proxies(configuration.host, configuration.no_proxy or ""):
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
        kw["socket_options"] = tcp_keepalive_socket_options()
    return kw


class Kube:
    """The guard's apiserver client: quorum GETs, readiness, and the heal's writes."""

    def __init__(self, configuration: client.Configuration, *, timeout: float, pool_size: int) -> None:
        configuration.connection_pool_maxsize = max(pool_size, 1)
        # No urllib3 retries: a retry would blow the per-GET budget; the caller fails open instead.
        configuration.retries = False
        self.timeout = timeout
        self.configuration = configuration
        self.api_client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api_client)
        self.version = client.VersionApi(self.api_client)
        self.host = configuration.host
        # The client's own pool (TLS and proxy from the configuration), for quorum_get.
        self._pool: urllib3.PoolManager = self.api_client.rest_client.pool_manager
        # quorum_get's copy of the configuration, for its auth headers and URL. The kubeconfig
        # loader's token hook assigns ``host`` again on every call, and while the proxy counts as
        # "from the environment" that assignment re-reads every environment variable
        # (urllib.request.getproxies: 140 us with 38 variables, more in a pod with service links).
        # The pool was built with the proxy resolved once and never looks again, so the copy pins
        # it: the same proxy, token, hooks and host as the client's own calls, without the scan.
        self._auth: client.Configuration = copy.deepcopy(configuration)
        self._auth.proxy = configuration.proxy
        # The GET's own kept-alive connections (guard/kube/transport.py), opened with the client's TLS
        # settings; None through a proxy, where the client's pool is used.
        self._wire_settings = connection_settings(configuration)
        self._pool_size = max(pool_size, 1)
        self._wire: Connections | None = None
        self._wire_lock = threading.Lock()

    def quorum_get(self, namespace: str, name: str, timeout: float | None = None) -> QuorumRead:
        """GET the pod with no resourceVersion: served by etcd (linearizable), never by a watch cache.

        ``timeout`` (seconds, total) is what is left of the caller's request budget, capped at
        ``--get-timeout``.

        The request goes straight through the kubernetes client's own urllib3 pool (the
        kubeconfig's TLS: CA, client certificate, server name, proxy; no retries) with the
        client's auth headers (``Configuration.auth_settings()``, which runs the token refresh
        hook), not through ``CoreV1Api``, whose per-call argument validation, parameter
        serialisation and response wrapping cost about 0.1 ms of CPU per GET (with the
        environment scan avoided in ``__init__``, 0.3 ms; docs/BENCHMARKS.md, "CPU per pod").
        Redirects are not followed (an apiserver never redirects a pod GET; a redirect is an
        error, the caller fails open)."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            headers = self._headers()  # first: the auth hook may rewrite the host (the client's own order)
            wire = self._connections()
            if wire is not None:
                reply = wire.get(self._pod_path(namespace, name), headers, timeout)
                status, reason, data = reply.status, reply.reason, reply.body
            else:  # through a proxy: the client's pool
                resp = self._pool.request("GET", self._auth.host + self._pod_path(namespace, name), headers=headers,
                                          timeout=urllib3.Timeout(total=timeout), retries=False, redirect=False,
                                          preload_content=True)
                status, reason, data = resp.status, resp.reason or "", resp.data
        except GetError as e:
            if e.kind == "timeout":
                return QuorumRead.failed(f"timeout after {timeout:g}s")
            if e.kind == "tls":
                return QuorumRead.failed("TLS error talking to the apiserver")
            if e.kind == "protocol":
                return QuorumRead.failed(f"bad HTTP reply from the apiserver: {e.name}")
            return QuorumRead.failed(f"connection error: {e.name}")
        except urllib3.exceptions.SSLError:
            return QuorumRead.failed("TLS error talking to the apiserver")
        except urllib3.exceptions.NewConnectionError as e:  # before TimeoutError: urllib3 makes it a subclass
            return QuorumRead.failed(f"connection error: {type(e).__name__}")
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return QuorumRead.failed(f"timeout after {timeout:g}s")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return QuorumRead.failed(f"connection error: {type(e).__name__}")
        if not 200 <= status <= 299:
            reason, body = _error_reason(data, reason)
            raw_details = body.get("details")
            details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
            if status == 404 and reason == "NotFound" and details.get("kind") in ("pods", None):
                return QuorumRead.not_found()
            # A 404 that is not the apiserver's "pods NAME not found" (a proxy, a wrong path) is
            # no evidence that the pod is gone: treat it as an error and fail open.
            return QuorumRead.failed(f"HTTP {status} {reason or 'error'}", http_status=status)
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            return QuorumRead.failed(f"undecodable apiserver reply: {type(e).__name__}")
        if not isinstance(obj, dict):
            return QuorumRead.failed("undecodable apiserver reply: not an object")
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        if not isinstance(meta, dict) or not isinstance(spec, dict):
            return QuorumRead.failed("undecodable apiserver reply: not a pod")
        return QuorumRead.found(
            str(meta.get("uid") or ""),
            node_name=str(spec.get("nodeName") or ""),
            deletion_timestamp=str(meta.get("deletionTimestamp") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
            placeholder=is_placeholder(meta),
        )

    def _pod_path(self, namespace: str, name: str) -> str:
        # As the client builds it: the path parameters percent-encoded with the configuration's safe characters.
        safe = self._auth.safe_chars_for_path_param
        return f"/api/v1/namespaces/{quote(namespace, safe=safe)}/pods/{quote(name, safe=safe)}"

    def _connections(self) -> Connections | None:
        """The kept-alive connections to the host the auth hook left (None through a proxy).

        The kubeconfig loader's hook assigns the host on every call; it is the same host, but a
        hook may move it (the tests' does), and then the connections follow."""
        host = self._auth.host
        wire = self._wire
        if wire is not None and wire.url == host:
            return wire
        if self._wire_settings is None:
            return None
        with self._wire_lock:
            if self._wire is None or self._wire.url != host:
                old, self._wire = self._wire, Connections(host, self._wire_settings, keep=self._pool_size)
                if old is not None:
                    old.close()
            return self._wire

    def _headers(self) -> dict[str, str]:
        """The client's default headers (User-Agent), JSON, and its auth (the refresh hook runs here)."""
        headers = {**self.api_client.default_headers, "Accept": "application/json"}
        if self.api_client.cookie:
            headers["Cookie"] = self.api_client.cookie
        for auth in self._auth.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers
    # --- writes (ghost-guard heal; guard/engine/healer.py) ----------------------------------------------
    # Each returns the object as JSON or raises KubeWriteError (status 0: no answer).

    def create_pod(self, namespace: str, body: dict, timeout: float | None = None) -> dict:
        return self._write(lambda t: self.core.create_namespaced_pod(namespace, body, _preload_content=False,
                                                                     _request_timeout=t), timeout)

    def read_pod(self, namespace: str, name: str, timeout: float | None = None) -> dict:
        """The pod as etcd has it (GET without resourceVersion), whole; 404 raises KubeWriteError too."""
        return self._write(lambda t: self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                                   _request_timeout=t), timeout)

    def delete_pod(self, namespace: str, name: str, uid: str, timeout: float | None = None) -> dict:
        """DELETE with a UID precondition (409 Conflict if the name now holds another pod) and no grace period."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        return self._write(lambda t: self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False,
                                                                     _request_timeout=t), timeout)

    def merge_patch_pod(self, namespace: str, name: str, patch: dict, timeout: float | None = None) -> dict:
        """A JSON merge patch; a ``metadata.resourceVersion`` in it is a precondition (409 Conflict otherwise)."""
        return self._write(lambda t: self.core.patch_namespaced_pod(name, namespace, patch, _preload_content=False,
                                                                    _content_type="application/merge-patch+json",
                                                                    _request_timeout=t), timeout)

    def create_node(self, body: dict, timeout: float | None = None) -> dict:
        """Create a Node (``heal node/NAME``'s placeholder, guard/engine/node_healer.py)."""
        return self._write(lambda t: self.core.create_node(body, _preload_content=False, _request_timeout=t), timeout)

    def delete_node(self, name: str, uid: str, timeout: float | None = None) -> dict:
        """DELETE a Node with a UID precondition (409 Conflict if the name now holds another Node)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        return self._write(lambda t: self.core.delete_node(name, body=body, _preload_content=False,
                                                           _request_timeout=t), timeout)

    def _write(self, call, timeout: float | None) -> dict:
        t = self.timeout if timeout is None else timeout
        try:
            resp = call(t)
            return orjson.loads(resp.data)
        except ApiException as e:
            if not e.status:
                raise KubeWriteError(0, "TLSError", "TLS error talking to the apiserver") from e
            reason, body = _status_reason(e)
            message = str(body.get("message") or e.reason or "")[:1000]
            raise KubeWriteError(e.status, reason or "Error", message) from e
        except (urllib3.exceptions.TimeoutError, TimeoutError) as e:
            if isinstance(e, urllib3.exceptions.NewConnectionError):
                raise KubeWriteError(0, "Unreachable", f"connection error: {type(e).__name__}") from e
            raise KubeWriteError(0, "Timeout", f"no answer within {t:g}s") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubeWriteError(0, "Unreachable", f"connection error: {type(e).__name__}") from e
        except (orjson.JSONDecodeError, ValueError) as e:
            raise KubeWriteError(0, "Undecodable", f"undecodable apiserver reply: {type(e).__name__}") from e

    def read_node(self, name: str, timeout: float | None = None) -> QuorumRead:
        """GET the Node ``name`` with no resourceVersion: served by etcd, never by a watch cache.
        Found (with its uid), not-found (the apiserver's own "nodes NAME not found"), or failed
        with a short reason: any other answer is no evidence, the caller fails open."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            resp = self.core.read_node(name, _preload_content=False, _request_timeout=timeout)
            obj = orjson.loads(resp.data)
        except ApiException as e:
            if not e.status:
                return QuorumRead.failed("connection error")
            reason, body = _error_reason(e.body, e.reason)
            details = body.get("details")
            if e.status == 404 and reason == "NotFound" and isinstance(details, dict) and details.get("kind") == "nodes":
                return QuorumRead.not_found()
            return QuorumRead.failed(f"HTTP {e.status} {reason or 'error'}", http_status=e.status)
        except urllib3.exceptions.NewConnectionError as e:
            return QuorumRead.failed(f"connection error: {type(e).__name__}")
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return QuorumRead.failed(f"timeout after {timeout:g}s")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return QuorumRead.failed(f"connection error: {type(e).__name__}")
        except ValueError as e:
            return QuorumRead.failed(f"undecodable apiserver reply: {type(e).__name__}")
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta, dict) or meta.get("name") != name:
            return QuorumRead.failed("undecodable apiserver reply: not that Node")
        return QuorumRead.found(str(meta.get("uid") or ""), resource_version=str(meta.get("resourceVersion") or ""))

    def ping(self) -> str | None:
        """None when the apiserver answers ``/version``, else a short reason."""
        try:
            self.version.get_code(_request_timeout=self.timeout)
        except ApiException as e:
            return f"apiserver answered HTTP {e.status}"
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return f"apiserver unreachable: {type(e).__name__}"
        return None

    def close(self) -> None:
        with self._wire_lock:
            if self._wire is not None:
                self._wire.close()
        self.api_client.close()


# --- apiserver replicas -------------------------------------------------------

IDENTITY_LABEL = "apiserver.kubernetes.io/identity=kube-apiserver"
PEER_ADDRESS_ANNOTATION = "kubernetes.io/peer-advertise-address"


def _pinned_refresh_hook(hook, host: str, server_name: str | None):
    """Token refresh hooks (in-cluster and kubeconfig alike) rewrite ``configuration.host`` to the
    Service / kubeconfig server *and* re-install themselves: put the replica and this wrapper back."""

    def refresh(cfg):
        hook(cfg)
        cfg.host = host
        cfg.tls_server_name = server_name
        cfg.refresh_api_key_hook = refresh

    return refresh


def name_selector(namespace: str, name: str) -> str | None:
    """``metadata.name=NAME`` for a LIST of one pod name, or None when the namespace or name is not
    one the apiserver accepts (guard.core.names): a selector is built from validated values only, so
    ``live,metadata.namespace=default`` can never become two terms that match a live pod."""
    if namespace_problem(namespace) is not None or pod_name_problem(name) is not None:
        return None
    return f"metadata.name={name}"


def only_object(items: object, namespace: str, name: str) -> list[dict]:
    """The items of a LIST that are the object asked about (this namespace, this name): what a
    replica says about anything else is not an answer to the question."""
    if not isinstance(items, list):
        return []
    return [i for i in items if isinstance(i, dict) and isinstance(i.get("metadata"), dict)
            and i["metadata"].get("namespace") == namespace and i["metadata"].get("name") == name]


# A watch event is one object (a pod: at most about 1.5 MiB in etcd); a line longer than this is no event.
MAX_WATCH_EVENT_BYTES = 8 * 1024 * 1024
# Node lists and watches ask for metadata only (names are all the ghost-Node check needs), with
# plain JSON as the fallback for a server that does not offer it.
_META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1, application/json"
_META_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json"


class ReplicaClient:
    """A client aimed at one replica: cluster CA, configurable TLS server name, the guard's credentials."""

    def __init__(self, base: client.Configuration, replica: Replica, *, server_name: str | None, timeout: float,
                 pool_size: int = 4) -> None:
        cfg = copy.deepcopy(base)
        cfg.host = replica.url
        cfg.tls_server_name = server_name
        cfg.connection_pool_maxsize = pool_size
        cfg.retries = False
        if getattr(base, "refresh_api_key_hook", None):
            cfg.refresh_api_key_hook = _pinned_refresh_hook(base.refresh_api_key_hook, replica.url, server_name)
        self.replica = replica
        self.timeout = timeout
        self.api_client = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api_client)

    def read_cache(self, namespace: str, name: str) -> tuple[list[dict], str | None, str | None]:
        """This replica's watch cache for one pod name (LIST resourceVersion=0):
        (items, the list's resourceVersion, None) or ([], None, error) with an attribution error string.

        The selector is built only from a valid namespace and name (:func:`name_selector`), and only the
        items that are this very object (same namespace and name) are returned: a replica's answer is
        trusted for the object asked about and nothing else (issue 25)."""
        selector = name_selector(namespace, name)
        if selector is None:
            return [], None, f"invalid pod identity: {pod_identity_problem(namespace, name, '')}"
        try:
            resp = self.core.list_namespaced_pod(namespace, field_selector=selector,
                                                 resource_version="0", _preload_content=False,
                                                 _request_timeout=self.timeout)
            doc = orjson.loads(resp.data)
        except ApiException as e:
            if not e.status:
                return [], None, transport_error("unreachable", "TLS error")
            reason, _ = _status_reason(e)
            return [], None, http_error(e.status, reason)
        except urllib3.exceptions.NewConnectionError as e:  # before TimeoutError: urllib3 makes it a subclass
            return [], None, transport_error("unreachable", type(e).__name__)
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return [], None, transport_error("timeout", f"after {self.timeout:g}s")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return [], None, transport_error("unreachable", type(e).__name__)
        except ValueError as e:
            return [], None, f"undecodable reply: {type(e).__name__}"
        rv = (doc.get("metadata") or {}).get("resourceVersion")
        return only_object(doc.get("items"), namespace, name), str(rv) if rv else None, None

    def consistent_revision(self, namespace: str, name: str, *, timeout: float = 5.0) -> tuple[int | None, str | None]:
        """A consistent read of one pod name on this replica (LIST without resourceVersion):
        (the list's resourceVersion, None) or (None, error). Since 1.31 the cacher asks etcd for its
        current revision and waits (up to 3 s) until this replica's cache reaches it, else falls back
        to etcd (or answers 429): the revision is one etcd had, and a flowing cache is there after it
        (k8s.io/apiserver pkg/storage/cacher delegator.go GetList, watch_cache.go waitUntilFreshLocked)."""
        selector = name_selector(namespace, name)
        if selector is None:
            return None, f"invalid pod identity: {pod_identity_problem(namespace, name, '')}"
        try:
            resp = self.core.list_namespaced_pod(namespace, field_selector=selector,
                                                 _preload_content=False, _request_timeout=timeout)
            rv = (orjson.loads(resp.data).get("metadata") or {}).get("resourceVersion")
        except ApiException as e:
            if not e.status:
                return None, transport_error("unreachable", "TLS error")
            return None, http_error(e.status, _status_reason(e)[0])
        except urllib3.exceptions.NewConnectionError as e:
            return None, transport_error("unreachable", type(e).__name__)
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return None, transport_error("timeout", f"after {timeout:g}s")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return None, transport_error("unreachable", type(e).__name__)
        except (ValueError, AttributeError) as e:
            return None, f"undecodable reply: {type(e).__name__}"
        try:
            return int(str(rv)), None
        except ValueError:
            return None, f"no resourceVersion in the list: {str(rv)[:50]}"

    def probe(self, namespace: str, name: str, uid: str, *, at: float) -> ReplicaObservation:
        """Does this replica's watch cache still serve the ghost with this UID (as a pod to schedule)?
        The cache half of ``verdict.serves_ghost``: the caller asked etcd first. Only a copy with this
        namespace, name and UID counts; without a UID there is nothing to compare, and no answer."""
        if not uid:
            return ReplicaObservation(self.replica.address, None, None, "no UID to compare", at)
        items, rv, error = self.read_cache(namespace, name)
        if error:
            return ReplicaObservation(self.replica.address, None, None, error, at)
        return ReplicaObservation(self.replica.address, shows_pending(items, uid), rv, None, at)

    def pending_pods(self, *, resource_version: str = "0") -> tuple[str, list[dict]]:
        """LIST unscheduled pods from this replica's cache: (list resourceVersion, items)."""
        resp = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=", resource_version=resource_version,
                                                     _preload_content=False, _request_timeout=self.timeout * 5)
        doc = orjson.loads(resp.data)
        return str((doc.get("metadata") or {}).get("resourceVersion") or ""), doc.get("items") or []

    def watch_pending(self, resource_version: str, *, timeout_seconds: int = 300) -> Iterator[dict]:
        """WATCH unscheduled pods from ``resource_version``: yields raw watch events (dicts).

        Raises ``WatchExpired`` on 410 Gone (the caller re-lists), ``WatchFailed`` on an error event
        or an event over ``MAX_WATCH_EVENT_BYTES``.
        """
        try:
            resp = self.core.list_pod_for_all_namespaces(
                field_selector="spec.nodeName=", resource_version=resource_version, watch=True,
                allow_watch_bookmarks=True, timeout_seconds=timeout_seconds, _preload_content=False,
                _request_timeout=(self.timeout * 5, timeout_seconds + 30))
        except ApiException as e:
            if e.status == 410:
                raise WatchExpired(resource_version) from e
            raise
        try:
            yield from self._events(resp.stream(64 * 1024, decode_content=False), resource_version)
        finally:
            resp.release_conn()

    def serves_node(self, name: str) -> bool | None:
        """Whether this replica's watch cache serves the Node ``name`` (LIST resourceVersion=0, one name);
        None when it gives no answer."""
        try:
            resp = self.core.list_node(field_selector=f"metadata.name={name}", resource_version="0",
                                       _preload_content=False, _request_timeout=self.timeout)
            items = orjson.loads(resp.data).get("items") or []
        except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError, AttributeError):
            return None
        return any((i.get("metadata") or {}).get("name") == name for i in items if isinstance(i, dict))

    def list_node_names(self) -> tuple[str, list[str]]:
        """LIST Nodes from this replica's cache (resourceVersion=0), metadata only where the apiserver
        offers it: (list resourceVersion, names)."""
        resp = self.core.list_node(resource_version="0", _headers={"Accept": _META_LIST}, _preload_content=False,
                                   _request_timeout=self.timeout * 5)
        doc = orjson.loads(resp.data)
        names = [str((i.get("metadata") or {}).get("name") or "") for i in doc.get("items") or [] if isinstance(i, dict)]
        return str((doc.get("metadata") or {}).get("resourceVersion") or ""), [n for n in names if n]

    def watch_nodes(self, resource_version: str, *, timeout_seconds: int = 300) -> Iterator[dict]:
        """WATCH Nodes on this replica from ``resource_version`` (metadata only where offered): raw
        events. WatchExpired on 410 (re-list), WatchFailed on an error event."""
        try:
            resp = self.core.list_node(
                resource_version=resource_version, watch=True, allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds, _headers={"Accept": _META_WATCH}, _preload_content=False,
                _request_timeout=(self.timeout * 5, timeout_seconds + 30))
        except ApiException as e:
            if e.status == 410:
                raise WatchExpired(resource_version) from e
            raise
        try:
            yield from self._events(resp.stream(64 * 1024, decode_content=False), resource_version)
        finally:
            resp.release_conn()

    @staticmethod
    def _events(pieces: Iterator[bytes], resource_version: str) -> Iterator[dict]:
        """Watch events, one JSON object per line, from the body's pieces as they arrive. A line
        longer than ``MAX_WATCH_EVENT_BYTES`` ends the watch (WatchFailed): memory stays bounded."""
        buf = b""
        for piece in pieces:
            buf = buf + piece if buf else piece
            if b"\n" in buf:
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        if status.get("code") == 410:
                            raise WatchExpired(resource_version)
                        raise WatchFailed(str(status.get("message") or status)[:200])
                    yield event
            if len(buf) > MAX_WATCH_EVENT_BYTES:
                raise WatchFailed(f"a watch event longer than {MAX_WATCH_EVENT_BYTES} bytes")

    def close(self) -> None:
        self.api_client.close()


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): re-list."""


class WatchFailed(Exception):
    """The watch stream carried an error event."""


def _endpoint_slice_replicas(doc: dict) -> list[tuple[str, int]]:
    out = []
    for sl in doc.get("items") or []:
        ports = [p.get("port") for p in sl.get("ports") or [] if p.get("name") in ("https", None, "")]
        port = ports[0] if ports else None
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or []:
                out.append((addr, port))
    return out


def _endpoints_replicas(doc: dict) -> list[tuple[str, int]]:
    out = []
    for subset in doc.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or [] if p.get("name") in ("https", None, "")]
        if not ports:
            continue
        for addr in subset.get("addresses") or []:
            out.append((addr.get("ip"), ports[0]))
    return out


def _lease_identities(doc: dict) -> dict[str, str]:
    """Identity Leases whose peer-advertise-address annotation names an address -> lease name."""
    out = {}
    for lease in doc.get("items") or []:
        meta = lease.get("metadata") or {}
        addr = (meta.get("annotations") or {}).get(PEER_ADDRESS_ANNOTATION)
        if addr:
            out[addr] = meta.get("name", "")
            out[addr.rsplit(":", 1)[0]] = meta.get("name", "")
    return out


def discover_replicas(kube: Kube) -> list[Replica]:
    """The live apiserver replicas: ``default/kubernetes`` EndpointSlices, else its Endpoints.

    Joined with the identity Leases in ``kube-system`` where they can be matched
    (the peer-advertise-address annotation); unmatched replicas keep no identity.
    """
    api = kube.api_client
    addrs: list[tuple[str, int]] = []
    try:
        resp = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=kubernetes", _preload_content=False,
            _request_timeout=kube.timeout * 2)
        addrs = _endpoint_slice_replicas(orjson.loads(resp.data))
    except ApiException as e:
        log.info("EndpointSlice discovery failed (HTTP %s); falling back to Endpoints", e.status)
    if not addrs:
        resp = kube.core.read_namespaced_endpoints("kubernetes", "default", _preload_content=False,
                                                   _request_timeout=kube.timeout * 2)
        addrs = _endpoints_replicas(orjson.loads(resp.data))
    identities: dict[str, str] = {}
    try:
        resp = client.CoordinationV1Api(api).list_namespaced_lease(
            "kube-system", label_selector=IDENTITY_LABEL, _preload_content=False, _request_timeout=kube.timeout * 2)
        identities = _lease_identities(orjson.loads(resp.data))
    except ApiException as e:
        log.info("identity leases not readable (HTTP %s); replicas are named by address only", e.status)
    out = []
    for ip, port in sorted(set(addrs)):
        host = f"[{ip}]" if ":" in ip else ip
        address = f"{host}:{port}"
        out.append(Replica(address, f"https://{address}", identities.get(address) or identities.get(ip, "")))
    return out


# --- Events -------------------------------------------------------------------


def _now_rfc3339() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def emit_event(kube: Kube, *, namespace: str, pod_name: str, pod_uid: str, reason: str, message: str,
               key: str = "", event_type: str = "Warning") -> None:
    """Create a core/v1 Event about a pod, or bump its count if it exists (aggregated, never repeated).

    The Event name is derived from the pod, its UID, the reason and ``key``, so
    every guard instance aggregates into the same Event.
    """
    import hashlib
    import socket

    digest = hashlib.sha256(f"{pod_uid}/{reason}/{key}".encode()).hexdigest()[:16]
    name = f"{pod_name[:200]}.{digest}"
    now = _now_rfc3339()
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod_name, "uid": pod_uid},
        "reason": reason, "message": visible(message)[:1024], "type": event_type,
        "source": {"component": "ghost-guard", "host": socket.gethostname()},
        "reportingComponent": "ghost-guard", "reportingInstance": socket.gethostname(),
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        kube.core.create_namespaced_event(namespace, body, _request_timeout=kube.timeout * 2)
        return
    except ApiException as e:
        if e.status != 409:
            raise
    resp = kube.core.read_namespaced_event(name, namespace, _preload_content=False, _request_timeout=kube.timeout * 2)
    count = int((orjson.loads(resp.data).get("count") or 1)) + 1
    kube.core.patch_namespaced_event(name, namespace, {"count": count, "lastTimestamp": now, "message": visible(message)[:1024]},
                                     _content_type="application/merge-patch+json", _request_timeout=kube.timeout * 2)


def emit_node_event(kube: Kube, node: str, reason: str, message: str) -> None:
    """A Warning Event about a Node (namespace default, as the node controller's), or its time and message
    bumped when it exists (aggregated, one per Node and reason)."""
    import hashlib
    import socket

    name = f"{node[:200]}.{hashlib.sha256(f'{node}/{reason}'.encode()).hexdigest()[:16]}"
    now = _now_rfc3339()
    body = {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
        "reason": reason, "message": visible(message)[:1024], "type": "Warning",
        "source": {"component": "ghost-guard", "host": socket.gethostname()},
        "reportingComponent": "ghost-guard", "reportingInstance": socket.gethostname(),
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        kube.core.create_namespaced_event("default", body, _request_timeout=kube.timeout * 2)
    except ApiException as e:
        if e.status != 409:
            raise
        kube.core.patch_namespaced_event(name, "default", {"lastTimestamp": now, "message": visible(message)[:1024]},
                                         _content_type="application/merge-patch+json",
                                         _request_timeout=kube.timeout * 2)


# --- GhostPod audit records (kube-ghost-guard.io/v1alpha1, manifests/crd) ------------------

GHOSTPOD_GROUP = "kube-ghost-guard.io"
GHOSTPOD_VERSION = "v1alpha1"
GHOSTPOD_PLURAL = "ghostpods"


class GhostPodError(Exception):
    """A GhostPod call failed. ``status`` is the HTTP status (0: no answer: timeout, refused, TLS),
    ``reason`` the Status reason (``AlreadyExists``, ``Conflict``, ``NotFound``, ...).
    ``missing``: a 404 for the object itself (not for the resource: a CRD that is not installed)."""

    def __init__(self, status: int, reason: str, message: str, *, missing: bool = False, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.missing = missing
        self.kind = kind  # the Status details' kind: "ghostpods", "namespaces" (the namespace is gone), ...

    @property
    def transient(self) -> bool:
        """Worth retrying later: no answer, 429, 5xx, or the resource not served (yet) / not allowed (yet).
        Not a 404 of the object's namespace (deleted: the record can never be written there)."""
        return self.status == 0 or self.status == 429 or self.status >= 500 or self.status in (401, 403) or (
            self.status == 404 and not self.missing and self.kind != "namespaces")


class GhostPods:
    """Raw calls on GhostPod objects; every client error becomes a :class:`GhostPodError`."""

    def __init__(self, kube: Kube, *, timeout: float = 5.0, list_timeout: float = 60.0) -> None:
        self.kube = kube
        self.timeout = timeout
        self.list_timeout = list_timeout  # a page of a LIST (an apiserver may not paginate, as the lab does not)
        self.api = client.CustomObjectsApi(kube.api_client)

    def _call(self, what: str, fn, *args, timeout: float | None = None, **kwargs) -> dict:
        timeout = self.timeout if timeout is None else timeout
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
            return orjson.loads(resp.data) if resp.data else {}
        except ApiException as e:
            if not e.status:
                raise GhostPodError(0, "", f"{what}: TLS error talking to the apiserver") from e
            reason, body = _status_reason(e)
            raw_details = body.get("details")
            details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
            message = str(body.get("message") or e.reason or "")[:300]
            raise GhostPodError(e.status, reason, f"{what}: HTTP {e.status} {reason}: {message}",
                                missing=e.status == 404 and details.get("kind") == GHOSTPOD_PLURAL,
                                kind=str(details.get("kind") or "")) from e
        except urllib3.exceptions.NewConnectionError as e:
            raise GhostPodError(0, "", f"{what}: connection error: {type(e).__name__}") from e
        except (urllib3.exceptions.TimeoutError, TimeoutError) as e:
            raise GhostPodError(0, "", f"{what}: timeout after {timeout:g}s") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise GhostPodError(0, "", f"{what}: connection error: {type(e).__name__}") from e
        except (orjson.JSONDecodeError, ValueError) as e:
            raise GhostPodError(0, "", f"{what}: undecodable apiserver reply: {type(e).__name__}") from e

    def create(self, namespace: str, body: dict) -> dict:
        return self._call(f"create ghostpod in {namespace}", self.api.create_namespaced_custom_object,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, body)

    def get(self, namespace: str, name: str) -> dict:
        """A quorum read (no resourceVersion): the newest object, to retry a write after a conflict."""
        return self._call(f"get ghostpod {namespace}/{name}", self.api.get_namespaced_custom_object,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name)

    def patch_status(self, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of the status subresource (``patch`` may carry metadata.resourceVersion:
        then the apiserver applies it only to that version, else 409 Conflict)."""
        return self._call(f"patch ghostpod {namespace}/{name} status", self.api.patch_namespaced_custom_object_status,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name, patch,
                          _content_type="application/merge-patch+json")

    def list(self, namespace: str | None, *, limit: int = 500, cont: str | None = None) -> tuple[list[dict], str | None]:
        """One page of GhostPods (every namespace when ``namespace`` is None) and the continue token."""
        kwargs: dict = {"limit": limit, "timeout": self.list_timeout}
        if cont:
            kwargs["_continue"] = cont
        if namespace is None:
            doc = self._call("list ghostpods", self.api.list_cluster_custom_object, GHOSTPOD_GROUP, GHOSTPOD_VERSION,
                             GHOSTPOD_PLURAL, **kwargs)
        else:
            doc = self._call(f"list ghostpods in {namespace}", self.api.list_namespaced_custom_object, GHOSTPOD_GROUP,
                             GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, **kwargs)
        raw_items = doc.get("items")
        items: list[Any] = raw_items if isinstance(raw_items, list) else []
        return [i for i in items if isinstance(i, dict)], ((doc.get("metadata") or {}).get("continue") or None)

    def delete(self, namespace: str, name: str, *, uid: str, resource_version: str) -> None:
        """Delete exactly this version of the object (preconditions): a record written since is kept."""
        self._call(f"delete ghostpod {namespace}/{name}", self.api.delete_namespaced_custom_object,
                   GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name,
                   body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                       uid=uid, resource_version=resource_version)))
