"""``LabBackend``: what scenario code (``guard.lab.harness``, the demo, the tests) may use of a lab, so the
same code runs on the Python lab (:class:`guard.lab.lab.Lab`) and on the real backend
(:class:`guard.lab.real.controlplane.RealLab`). Replica numbering is 0-based here (``kubeconfig(0)`` is
127.0.0.1), as everywhere: the CLI prints replica N beside ``kubeconfig-N`` on both backends.

``ReplicaClients``: what both backends share to reach their replicas (a bearer-token kubeconfig per
replica, official clients built from it). ``LabLifecycle``: what both share about their life (a work
directory, a fresh etcd, ``start()`` undone when a part fails, ``close()``, ``with``, closed at exit).
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, Self, runtime_checkable


@runtime_checkable
class ReplicaLike(Protocol):
    """One apiserver replica: ``faults`` has the lab's fault vocabulary (``drop_deletes``, ``drop_creates``,
    ``freeze_watch``, ``unfreeze_watch``, ``clear``, ``dropped``...)."""

    index: int
    ip: str
    faults: Any

    @property
    def url(self) -> str: ...

    @property
    def running(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, graceful: bool = True) -> None: ...


@runtime_checkable
class LabBackend(Protocol):
    """The surface both backends share."""

    backend: str  # "python" or "real"
    n: int
    token: str
    ca_path: str
    out_dir: str
    port: int

    @property
    def replicas(self) -> Sequence[Any]: ...

    @property
    def urls(self) -> list[str]: ...

    def start(self) -> Any: ...

    def close(self) -> None: ...

    def kubeconfig(self, i: int) -> str: ...

    def api_client(self, i: int) -> Any: ...

    def core_v1(self, i: int) -> Any: ...

    def revision(self) -> int: ...

    def wait_synced(self, timeout: float = ..., replicas: list[int] | None = None) -> bool: ...

    def cached_pod(self, i: int, namespace: str, name: str) -> dict[str, Any] | None: ...

    def quorum_exists(self, namespace: str, name: str, resource: str = "pods") -> bool: ...

    def ensure_namespace(self, namespace: str, replica: int = 0) -> None: ...


class ReplicaClients:
    """A kubeconfig per replica (its server, the lab CA, the lab's bearer token) and the official client
    on it, cached per replica: shared by ``Lab`` and ``RealLab``, which set ``ca``, ``token`` and
    ``_clients`` and say where ``kubeconfig(i)`` lives."""

    ca: Any  # guard.lab.pki.CA
    token: str
    _clients: dict[int, Any]

    def kubeconfig(self, i: int) -> str:
        raise NotImplementedError

    def _write_token_kubeconfig(self, i: int, server: str) -> None:
        name = f"ghost-lab-{i}"
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
            "clusters": [{"name": name, "cluster": {"server": server,
                                                    "certificate-authority-data": base64.b64encode(self.ca.cert_pem).decode()}}],
            "users": [{"name": name, "user": {"token": self.token}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        }
        fd = os.open(self.kubeconfig(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f, indent=2)

    def _close_clients(self) -> None:
        for c in self._clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - cleanup continues
                pass
        self._clients.clear()

    def api_client(self, i: int) -> Any:
        """A ``kubernetes.client.ApiClient`` for replica ``i``, loaded from its kubeconfig (cached per replica)."""
        if i not in self._clients:
            from kubernetes import config

            self._clients[i] = config.new_client_from_config(config_file=self.kubeconfig(i))
        return self._clients[i]

    def core_v1(self, i: int) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client(i))

    def apps_v1(self, i: int) -> Any:
        from kubernetes import client

        return client.AppsV1Api(self.api_client(i))

    def discovery_v1(self, i: int) -> Any:
        from kubernetes import client

        return client.DiscoveryV1Api(self.api_client(i))

    def coordination_v1(self, i: int) -> Any:
        from kubernetes import client

        return client.CoordinationV1Api(self.api_client(i))

    def events_v1(self, i: int) -> Any:
        from kubernetes import client

        return client.EventsV1Api(self.api_client(i))


class LabLifecycle(ReplicaClients):
    """The life of a lab, shared by ``Lab`` and ``RealLab``: its work directory (made here unless given, and
    then removed at close), its token, etcd started on a fresh data directory, ``start()`` (the backend's
    :meth:`_start_parts`; everything started is stopped again if one part fails), ``close()`` (the backend's
    :meth:`_stop_parts`, then etcd and the files), ``with``, and every lab still open closed at exit."""

    etcd: Any  # guard.lab.etcd.Etcd
    n: int
    out_dir: str
    port: int

    def _init_lab(self, replicas: int, *, port: int | None, out_dir: str | None, token: str | None,
                  prefix: str) -> None:
        self.n = replicas
        self._want_port = port
        self._own_dir = out_dir is None
        self.out_dir = out_dir or tempfile.mkdtemp(prefix=prefix)
        os.makedirs(self.out_dir, exist_ok=True)
        self.token = token or secrets.token_urlsafe(24)
        self.port = 0
        self._clients = {}
        self._started = False
        _live.add(self)

    def _start_parts(self) -> None:
        raise NotImplementedError

    def _stop_parts(self) -> None:
        raise NotImplementedError

    def _fresh_etcd(self) -> None:
        """etcd started on an empty data directory (always a fresh cluster)."""
        shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
        os.makedirs(self.etcd.data_dir, exist_ok=True)
        self.etcd.start()

    def start(self) -> Self:
        try:
            self._start_parts()
            self._started = True
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self._close_clients()
        self._stop_parts()
        self.etcd.close()
        shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.out_dir, ignore_errors=True)
        self._started = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_live: weakref.WeakSet[LabLifecycle] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for lab in list(_live):
        lab.close()
