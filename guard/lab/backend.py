"""``LabBackend``: what scenario code (``guard.lab.harness``, the demo, the tests) may use of a lab, so the
same code runs on the Python lab (:class:`guard.lab.lab.Lab`) and on the real backend
(:class:`guard.lab.real.controlplane.RealLab`). Replica numbering is 0-based here (``kubeconfig(0)`` is
127.0.0.1); the CLI prints 1-based numbers (replica N is 127.0.0.N) on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


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
