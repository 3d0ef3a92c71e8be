"""Quorum reads of the guard's apiserver: a pod's GET (the verdict's evidence), a Node's, readiness.

:class:`Kube` is the guard's client of its apiserver: the quorum GET of one pod on its own kept-alive
connections (guard/kube/transport.py), a Node's GET, ``/version``, and (from
:class:`guard.kube.writes.PodWrites`) the heal's writes. Build one per process *after* gunicorn forks
(TLS connections shared across a fork corrupt: kubernetes-client/python#1000). Every call carries a
timeout; every client error is translated into data (:class:`~guard.core.verdict.QuorumRead`) so the
callers never see a client exception. Calls go through :func:`guard.kube.api.open_api`: the official
``kubernetes`` client, or its light twin for the CLI.
"""

from __future__ import annotations

import copy
import threading
from typing import Any
from urllib.parse import quote

import orjson
import urllib3

from guard.core.heal_plan import is_placeholder
from guard.core.verdict import QuorumRead
from guard.kube.api import ApiError, error_reason, open_api
from guard.kube.config import connection_settings
from guard.kube.transport import Connections, GetError
from guard.kube.writes import PodWrites


class Kube(PodWrites):
    """The guard's apiserver client: quorum GETs, readiness, and the heal's writes (PodWrites)."""

    def __init__(self, configuration: Any, *, timeout: float, pool_size: int) -> None:
        configuration.connection_pool_maxsize = max(pool_size, 1)
        # No urllib3 retries: a retry would blow the per-GET budget; the caller fails open instead.
        configuration.retries = False
        self.timeout = timeout
        self.configuration = configuration
        # The official client, or its light twin for the CLI (guard/kube/api.py).
        self.api = open_api(configuration)
        self.core = self.api.CoreV1Api()
        self.version = self.api.VersionApi()
        self.host = configuration.host
        # The client's own pool (TLS and proxy from the configuration), for quorum_get through a proxy.
        self._pool: urllib3.PoolManager = self.api.pool_manager
        # quorum_get's copy of the configuration, for its auth headers and URL. The kubeconfig
        # loader's token hook assigns ``host`` again on every call, and while the proxy counts as
        # "from the environment" that assignment re-reads every environment variable
        # (urllib.request.getproxies: 140 us with 38 variables, more in a pod with service links).
        # The pool was built with the proxy resolved once and never looks again, so the copy pins
        # it: the same proxy, token, hooks and host as the client's own calls, without the scan.
        self._auth: Any = copy.deepcopy(configuration)
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
            reason, body = error_reason(data, reason)
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
        headers = {**self.api.default_headers, "Accept": "application/json"}
        if self.api.cookie:
            headers["Cookie"] = self.api.cookie
        for auth in self._auth.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers
    # --- writes (ghost-guard heal; guard/engine/healer.py) ----------------------------------------------
    # Each returns the object as JSON or raises KubeWriteError (status 0: no answer).

    def read_node(self, name: str, timeout: float | None = None) -> QuorumRead:
        """GET the Node ``name`` with no resourceVersion: served by etcd, never by a watch cache.
        Found (with its uid), not-found (the apiserver's own "nodes NAME not found"), or failed
        with a short reason: any other answer is no evidence, the caller fails open."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            resp = self.core.read_node(name, _preload_content=False, _request_timeout=timeout)
            obj = orjson.loads(resp.data)
        except ApiError as e:
            if not e.status:
                return QuorumRead.failed("connection error")
            reason, body = error_reason(e.body, e.reason)
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
        except ApiError as e:
            return f"apiserver answered HTTP {e.status}"
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return f"apiserver unreachable: {type(e).__name__}"
        return None

    def close(self) -> None:
        with self._wire_lock:
            if self._wire is not None:
                self._wire.close()
        self.api.close()
