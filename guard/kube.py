"""Kubernetes reads: the only module that imports ``kubernetes``.

Build one :class:`Kube` per process *after* gunicorn forks (TLS connections
shared across a fork corrupt: kubernetes-client/python#1000). Every call
carries a timeout; every client error is translated here into data
(:class:`~guard.verdict.QuorumRead`) so the callers never see a client
exception.
"""

from __future__ import annotations

import logging
import os

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from guard.verdict import QuorumRead

log = logging.getLogger(__name__)


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
        where = kubeconfig or os.environ.get("KUBECONFIG") or "in-cluster or ~/.kube/config"
        raise KubeConfigError(f"cannot load cluster credentials from {where}: {e}") from e
    return cfg


def _status_reason(e: ApiException) -> tuple[str, dict]:
    try:
        body = orjson.loads(e.body) if e.body else {}
    except orjson.JSONDecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return str(body.get("reason") or e.reason or ""), body


class Kube:
    """The guard's apiserver client: quorum GETs and readiness."""

    def __init__(self, configuration: client.Configuration, *, timeout: float, pool_size: int) -> None:
        configuration.connection_pool_maxsize = max(pool_size, 1)
        # No urllib3 retries: a retry would blow the per-GET budget; the caller fails open instead.
        configuration.retries = False
        self.timeout = timeout
        self.api_client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api_client)
        self.version = client.VersionApi(self.api_client)
        self.host = configuration.host

    def quorum_get(self, namespace: str, name: str) -> QuorumRead:
        """GET the pod with no resourceVersion: served by etcd (linearizable), never by a watch cache."""
        try:
            resp = self.core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=self.timeout)
            obj = orjson.loads(resp.data)
        except ApiException as e:
            if not e.status:  # the REST layer wraps TLS failures as status 0
                return QuorumRead.failed("TLS error talking to the apiserver")
            reason, body = _status_reason(e)
            details = body.get("details") if isinstance(body.get("details"), dict) else {}
            if e.status == 404 and reason == "NotFound" and details.get("kind") in ("pods", None):
                return QuorumRead.not_found()
            # A 404 that is not the apiserver's "pods NAME not found" (a proxy, a wrong path) is
            # no evidence that the pod is gone: treat it as an error and fail open.
            return QuorumRead.failed(f"HTTP {e.status} {reason or 'error'}", http_status=e.status or 0)
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return QuorumRead.failed(f"timeout after {self.timeout:g}s")
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return QuorumRead.failed(f"connection error: {type(e).__name__}")
        except (orjson.JSONDecodeError, ValueError) as e:
            return QuorumRead.failed(f"undecodable apiserver reply: {type(e).__name__}")
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        return QuorumRead.found(
            str(meta.get("uid") or ""),
            node_name=str(spec.get("nodeName") or ""),
            deletion_timestamp=str(meta.get("deletionTimestamp") or ""),
            resource_version=str(meta.get("resourceVersion") or ""),
        )

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
        self.api_client.close()
