"""The set of apiserver replicas the guard dials directly, kept current.

Either the static ``--apiserver-replicas`` list (nothing else is dialled) or
discovery from ``default/kubernetes`` EndpointSlices/Endpoints, refreshed every
``--discovery-interval`` seconds. Each replica gets its own client
(:class:`guard.kube.watch.ReplicaClient`), created once and kept while the replica
is listed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from guard.kube.discovery import discover_replicas

from guard.kube.reads import Kube

from guard.kube.watch import ReplicaClient
from guard.core.settings import Replica, Settings, parse_replicas

#: Called with (added, removed) after each refresh that changed the set of replicas.
ReplicaListener = Callable[[list[ReplicaClient], list[ReplicaClient]], object]  # its return value is ignored

log = logging.getLogger("guard.replicas")


class ReplicaPool:
    def __init__(self, settings: Settings, kube: Kube) -> None:
        self.settings = settings
        self.kube = kube
        self._static = parse_replicas(settings.apiserver_replicas) if settings.apiserver_replicas else None
        self._lock = threading.Lock()
        self._clients: dict[str, ReplicaClient] = {}
        self._refreshed_at = -1e18
        self._listeners: list[ReplicaListener] = []

    def on_change(self, listener: ReplicaListener) -> None:
        """``listener(added: list[ReplicaClient], removed: list[ReplicaClient])`` after each refresh that changed the set."""
        self._listeners.append(listener)

    def clients(self) -> list[ReplicaClient]:
        """The current replicas' clients, refreshing discovery when it is due."""
        # With no replica known yet (apiserver down at start), retry discovery every few seconds.
        interval = self.settings.discovery_interval if self._clients else min(2.0, self.settings.discovery_interval)
        if time.monotonic() - self._refreshed_at >= interval:
            self.refresh()
        with self._lock:
            return list(self._clients.values())

    def refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            replicas = self._static if self._static is not None else discover_replicas(self.kube)
        except Exception as e:  # keep the last known set; discovery retries at the next interval
            log.warning("apiserver replica discovery failed (%s: %s); keeping %d known replica(s)",
                        type(e).__name__, str(e)[:200], len(self._clients))
            return
        if not replicas:
            log.warning("apiserver replica discovery found no replicas; keeping %d known", len(self._clients))
            return
        added, removed = self._apply(replicas)
        if added or removed:
            log.info("apiserver replicas: %s", ", ".join(str(c.replica) for c in self._clients.values()))
            for listener in self._listeners:
                listener(added, removed)

    def _apply(self, replicas: list[Replica]) -> tuple[list[ReplicaClient], list[ReplicaClient]]:
        wanted = {r.address: r for r in replicas}
        with self._lock:
            removed = [c for a, c in self._clients.items() if a not in wanted or c.replica != wanted[a]]
            for c in removed:
                del self._clients[c.replica.address]
            added = []
            for address, replica in wanted.items():
                if address not in self._clients:
                    self._clients[address] = ReplicaClient(
                        self.kube.configuration, replica, server_name=self.settings.apiserver_server_name or None,
                        timeout=self.settings.probe_timeout)
                    added.append(self._clients[address])
        for c in removed:
            c.close()
        return added, removed

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
