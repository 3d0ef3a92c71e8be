"""etcd v3 client over etcd's gRPC-JSON gateway (``/v3/kv/*``, ``/v3/watch``), no grpc.

Keys and values travel base64-encoded; revisions are JSON strings. Only what
the lab needs: range, transactional create/update/delete, and a streaming watch
with progress notifications.
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from typing import Any

import orjson
import urllib3


class EtcdUnavailable(Exception):
    """etcd could not be reached or answered with an error."""


class Compacted(Exception):
    """A watch asked for a revision etcd has compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"required revision has been compacted: {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int


@dataclass(frozen=True)
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    key: str
    value: bytes  # empty for DELETE
    mod_revision: int  # for DELETE: the revision of the deletion
    # etcd's create_revision: equal to mod_revision for the PUT that created the key (clientv3
    # Event.IsCreate; k8s.io/apiserver storage/etcd3 event.go parseEvent makes it an ADDED)
    create_revision: int = 0


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    b[-1] += 1
    return _b64(bytes(b))


def _kv(d: dict[str, Any]) -> KV:
    return KV(
        key=_unb64(d.get("key")).decode(),
        value=_unb64(d.get("value")),
        mod_revision=int(d.get("mod_revision", 0)),
        create_revision=int(d.get("create_revision", 0)),
    )


class EtcdClient:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http = urllib3.PoolManager(maxsize=32, retries=False, block=False)

    def close(self) -> None:
        self._http.clear()

    def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            r = self._http.request(
                "POST", self.url + path, body=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=urllib3.Timeout(total=timeout or self.timeout),
            )
        except urllib3.exceptions.HTTPError as e:
            raise EtcdUnavailable(f"etcd {path}: {e}") from e
        if r.status != 200:
            raise EtcdUnavailable(f"etcd {path}: HTTP {r.status}: {r.data[:300]!r}")
        return orjson.loads(r.data)

    # --- reads ------------------------------------------------------------

    def get(self, key: str) -> tuple[KV | None, int]:
        """(the key's KV or None, etcd's current revision): a linearizable read."""
        d = self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = d.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(d["header"]["revision"])

    def range_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KV], int]:
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        if revision:
            body["revision"] = str(revision)
        d = self._post("/v3/kv/range", body)
        return [_kv(x) for x in d.get("kvs") or []], int(d["header"]["revision"])

    def revision(self) -> int:
        """etcd's current revision (a linearizable read of one key)."""
        return self.get("/registry/")[1]

    # --- writes -----------------------------------------------------------

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]) -> dict[str, Any]:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def create(self, key: str, value: bytes) -> tuple[bool, int, KV | None]:
        """Put ``key`` only if absent: (created, revision, existing KV when not created)."""
        d = self.txn(
            [{"key": _b64(key), "target": "CREATE", "create_revision": "0", "result": "EQUAL"}],
            [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            [{"request_range": {"key": _b64(key)}}],
        )
        return self._outcome(d)

    def update(self, key: str, value: bytes, mod_revision: int) -> tuple[bool, int, KV | None]:
        """Put ``key`` only if unchanged since ``mod_revision``: (done, revision, current KV when not done)."""
        d = self.txn(
            [{"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"}],
            [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            [{"request_range": {"key": _b64(key)}}],
        )
        return self._outcome(d)

    def delete(self, key: str, mod_revision: int) -> tuple[bool, int, KV | None]:
        """Delete ``key`` only if unchanged since ``mod_revision``."""
        d = self.txn(
            [{"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"}],
            [{"request_delete_range": {"key": _b64(key)}}],
            [{"request_range": {"key": _b64(key)}}],
        )
        return self._outcome(d)

    def put(self, key: str, value: bytes) -> int:
        return int(self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})["header"]["revision"])

    def delete_key(self, key: str) -> int:
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)})["header"]["revision"])

    def compact(self, revision: int) -> None:
        self._post("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    @staticmethod
    def _outcome(d: dict[str, Any]) -> tuple[bool, int, KV | None]:
        rev = int(d["header"]["revision"])
        if d.get("succeeded"):
            return True, rev, None
        kvs = ((d.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        return False, rev, (_kv(kvs[0]) if kvs else None)

    # --- watch ------------------------------------------------------------

    def watch(self, prefix: str, start_revision: int) -> EtcdWatch:
        return EtcdWatch(self, prefix, start_revision)


class EtcdWatch:
    """One streaming ``POST /v3/watch`` over a prefix, from ``start_revision``.

    Iterate with ``next_batch()``: returns (events, header revision); an empty
    event list with a revision is a progress notification. Raises
    ``Compacted`` or ``EtcdUnavailable``; ``cancel()`` from another thread ends it.
    """

    def __init__(self, client: EtcdClient, prefix: str, start_revision: int) -> None:
        body = {"create_request": {
            "key": _b64(prefix), "range_end": _prefix_end(prefix),
            "start_revision": str(start_revision), "progress_notify": True,
        }}
        self._lock = threading.Lock()
        self._cancelled = False
        try:
            self._resp = client._http.request(
                "POST", client.url + "/v3/watch", body=orjson.dumps(body),
                headers={"Content-Type": "application/json"}, preload_content=False,
                timeout=urllib3.Timeout(connect=client.timeout, read=None),
            )
        except urllib3.exceptions.HTTPError as e:
            raise EtcdUnavailable(f"etcd watch: {e}") from e
        if self._resp.status != 200:
            raise EtcdUnavailable(f"etcd watch: HTTP {self._resp.status}")
        self._buf = b""

    def _readline(self) -> bytes:
        # read1: whatever has arrived (a buffered readline would wait for a full buffer)
        while b"\n" not in self._buf:
            chunk = self._resp.read1(1 << 16)
            if not chunk:
                line, self._buf = self._buf, b""
                return line
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line + b"\n"

    def next_batch(self) -> tuple[list[WatchEvent], int]:
        while True:
            try:
                line = self._readline()
            except Exception as e:  # noqa: BLE001 - any broken stream (also one closed by cancel())
                raise EtcdUnavailable(f"etcd watch stream: {e}") from e
            if not line:
                raise EtcdUnavailable("etcd watch stream ended")
            if not line.strip():
                continue
            d = orjson.loads(line)
            if "error" in d:
                raise EtcdUnavailable(f"etcd watch: {d['error']}")
            res = d.get("result") or {}
            if int(res.get("compact_revision", 0) or 0):
                raise Compacted(int(res["compact_revision"]))
            if res.get("canceled"):
                raise EtcdUnavailable(f"etcd watch canceled: {res.get('cancel_reason', '')}")
            rev = int((res.get("header") or {}).get("revision", 0))
            if res.get("created") and not res.get("events"):
                continue
            events = [
                WatchEvent(
                    type=e.get("type", "PUT"),
                    key=_unb64(e["kv"].get("key")).decode(),
                    value=_unb64(e["kv"].get("value")),
                    mod_revision=int(e["kv"].get("mod_revision", 0)),
                    create_revision=int(e["kv"].get("create_revision", 0)),
                )
                for e in res.get("events") or []
            ]
            return events, rev

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
        try:
            self._resp.shutdown()  # urllib3 >= 2.3: unblocks a reader in another thread
        except Exception:  # noqa: BLE001 - best effort, close() follows
            pass
        try:
            self._resp.close()
        except Exception:  # noqa: BLE001
            pass
