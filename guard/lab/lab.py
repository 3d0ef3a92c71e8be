"""``Lab``: real etcd plus N apiserver replicas (127.0.0.1..N, one port), a CA, a token, kubeconfigs."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from guard.lab.api import known_resource
from guard.lab.backend import LabLifecycle
from guard.lab.etcd import Etcd, free_port
from guard.lab.pki import CA
from guard.lab.registry import Registry
from guard.lab.replica import ApiserverReplica

class Lab(LabLifecycle):
    """Start with ``with Lab(replicas=3) as lab:`` (or ``start()``/``close()``). See docs/LAB.md.

    The Python backend of :class:`guard.lab.backend.LabBackend` (the real one: ``guard.lab.real.controlplane.RealLab``).
    """

    backend = "python"

    def __init__(self, replicas: int = 3, *, port: int | None = None, out_dir: str | None = None,
                 token: str | None = None, bookmark_interval: float = 1.0, history_size: int = 10000,
                 consistent_read_timeout: float = 3.0, peer_advertise_address: bool = False) -> None:
        if not 1 <= replicas <= 200:
            raise ValueError("replicas must be between 1 and 200")
        self._init_lab(replicas, port=port, out_dir=out_dir, token=token, prefix="ghost-lab-")
        self._opts = {"bookmark_interval": bookmark_interval, "history_size": history_size,
                      "consistent_read_timeout": consistent_read_timeout, "peer_advertise_address": peer_advertise_address}
        self.ca = CA()
        self.ca_path = os.path.join(self.out_dir, "ca.crt")
        with open(self.ca_path, "wb") as f:
            f.write(self.ca.cert_pem)
        self.etcd = Etcd(data_dir=os.path.join(self.out_dir, "etcd"))
        self.replicas: list[ApiserverReplica] = []

    # --- lifecycle --------------------------------------------------------------

    def _start_parts(self) -> None:
        self._fresh_etcd()
        self._bootstrap()
        self._bind_replicas()
        for r in self.replicas:
            r.start()
        for i in range(self.n):
            self._write_kubeconfig(i)

    def _bootstrap(self) -> None:
        reg = Registry(self.etcd.client)
        ns = known_resource("", "v1", "namespaces")
        svc = known_resource("", "v1", "services")
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            reg.ensure(ns, None, {"metadata": {"name": name}, "spec": {"finalizers": ["kubernetes"]},
                                  "status": {"phase": "Active"}})
        reg.ensure(svc, "default", {"metadata": {"name": "kubernetes", "labels": {"component": "apiserver", "provider": "kubernetes"}},
                                    "spec": {"clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1"], "type": "ClusterIP",
                                             "sessionAffinity": "None",
                                             "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}]}})

    def _bind_replicas(self) -> None:
        for attempt in range(20):
            port = self._want_port or free_port()
            reps = []
            try:
                for i in range(self.n):
                    ip = f"127.0.0.{i + 1}"
                    rep = ApiserverReplica(i, ip, port, self.etcd.url, self.token, self.ca.serving(ip), **self._opts)  # type: ignore[arg-type]
                    reps.append(rep)
                    rep.bind()
            except OSError:
                for rep in reps:
                    rep.close()
                if self._want_port or attempt == 19:
                    raise
                continue
            self.port = port
            self.replicas = reps
            return

    def _stop_parts(self) -> None:
        for r in self.replicas:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - cleanup continues
                pass

    # --- access -------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def kubeconfig(self, i: int) -> str:
        """Path of a kubeconfig aimed at replica ``i`` (server URL, CA data, bearer token)."""
        return os.path.join(self.out_dir, f"kubeconfig-{i}")

    def _write_kubeconfig(self, i: int) -> None:
        self._write_token_kubeconfig(i, self.replicas[i].url)


    # --- helpers for tests and the demo ---------------------------------------------------

    def revision(self) -> int:
        """etcd's current revision."""
        return self.etcd.client.revision()

    def wait_synced(self, timeout: float = 5.0, replicas: list[int] | None = None) -> bool:
        """Wait until the chosen (default: all running) replicas' caches reach etcd's current revision."""
        target = self.revision()
        deadline = time.monotonic() + timeout
        for i in replicas if replicas is not None else range(self.n):
            r = self.replicas[i]
            if not r.running or r.cache is None:
                continue
            if not r.cache.wait_for(target, max(0.0, deadline - time.monotonic())):
                return False
        return True

    def cached_pod(self, i: int, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as replica ``i``'s watch cache holds it, or None (read in-process: no request is logged)."""
        cache = self.replicas[i].cache
        if cache is None:
            return None
        obj, _ = cache.get(f"/registry/pods/{namespace}/{name}")
        return obj

    def quorum_exists(self, namespace: str, name: str, resource: str = "pods") -> bool:
        """Whether etcd holds the object (a linearizable read of its key)."""
        return self.etcd.client.get(f"/registry/{resource}/{namespace}/{name}")[0] is not None

    def ensure_namespace(self, namespace: str, replica: int = 0) -> None:
        """Create ``namespace`` if missing (in etcd directly: no replica logs a request)."""
        Registry(self.etcd.client).ensure(known_resource("", "v1", "namespaces"), None,
                                          {"metadata": {"name": namespace}, "spec": {"finalizers": ["kubernetes"]},
                                           "status": {"phase": "Active"}})


if TYPE_CHECKING:
    from guard.lab.backend import LabBackend

    def _is_a_lab_backend(lab: Lab) -> LabBackend:  # mypy checks that Lab has the shared surface
        return lab
