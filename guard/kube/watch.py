"""One apiserver replica's watch cache: reads of it (``resourceVersion=0``), consistent reads, LISTs and
WATCHes of pending pods and Nodes, each dialled at that replica (the guard's credentials, the cluster CA).
Calls go through :func:`guard.kube.api.open_api` (the official ``kubernetes`` client, or its light twin)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import urllib3

from guard.core.attribution import ReplicaObservation, http_error, transport_error
from guard.core.podlist import read_pod_list_stream
from guard.core.names import namespace_problem, pod_identity_problem, pod_name_problem
from guard.core.settings import Replica
from guard.core.verdict import shows_pending
from guard.kube.api import ApiError, open_api, status_reason


# What a token refresh hook may renew, taken back from the copy it ran on: the official client's API keys
# (kubeconfig tokens, exec plugins, in-cluster tokens) and the light configuration's token.
_CREDENTIALS = ("api_key", "api_key_prefix", "token")


def _pinned_refresh_hook(hook):
    """Token refresh hooks (in-cluster and kubeconfig alike) rewrite ``configuration.host`` (and the
    TLS settings) to the Service / kubeconfig server, then re-install themselves, on every request.

    Every thread calling this replica reads ``configuration.host`` when it builds a URL, so the hook
    must never write it, not even for a moment: a request built in between went to the kubeconfig's
    server, and another replica's cache answered for this one (seen in a loaded run: a replica's Node
    listing answered by the other replica, the ghost Node it served never seen; a healthy replica can
    be blamed the same way). The hook runs on a shallow copy; only the credentials it renewed are
    taken back, each by one assignment."""

    def refresh(cfg):
        scratch = copy.copy(cfg)
        for name in _CREDENTIALS:
            value = getattr(cfg, name, None)
            if isinstance(value, dict):
                setattr(scratch, name, dict(value))  # a hook fills the dict in place: its own copy
        hook(scratch)
        for name in _CREDENTIALS:
            if hasattr(cfg, name):
                setattr(cfg, name, getattr(scratch, name))

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
# A listing of unscheduled pods is read in pieces of this size (guard.core.podlist.read_pod_list_stream).
LIST_PIECE_BYTES = 64 * 1024
# Node lists and watches ask for metadata only (names are all the ghost-Node check needs), with
# plain JSON as the fallback for a server that does not offer it.
_META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1, application/json"
_META_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json"


class ReplicaClient:
    """A client aimed at one replica: cluster CA, configurable TLS server name, the guard's credentials."""

    def __init__(self, base: Any, replica: Replica, *, server_name: str | None, timeout: float,
                 pool_size: int = 4) -> None:
        cfg = copy.deepcopy(base)
        cfg.host = replica.url
        cfg.tls_server_name = server_name
        cfg.connection_pool_maxsize = pool_size
        cfg.retries = False
        if getattr(base, "refresh_api_key_hook", None):
            cfg.refresh_api_key_hook = _pinned_refresh_hook(base.refresh_api_key_hook)
        self.replica = replica
        self.timeout = timeout
        self.api = open_api(cfg)
        self.core = self.api.CoreV1Api()

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
        except ApiError as e:
            if not e.status:
                return [], None, transport_error("unreachable", "TLS error")
            reason, _ = status_reason(e)
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
        except ApiError as e:
            if not e.status:
                return None, transport_error("unreachable", "TLS error")
            return None, http_error(e.status, status_reason(e)[0])
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
        """LIST unscheduled pods from this replica's cache: (list resourceVersion, items), each item
        only the fields the guard reads (guard.core.podlist: the body read in pieces and decoded a pod
        at a time as they arrive, so a backlog's listing costs its lean items, not its bytes nor every
        field of every pod as Python objects)."""
        resp = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=", resource_version=resource_version,
                                                     _preload_content=False, _request_timeout=self.timeout * 5)
        try:
            return read_pod_list_stream(resp.stream(LIST_PIECE_BYTES, decode_content=True))
        except BaseException:
            resp.close()  # unread bytes may be left: this connection is not reused
            raise
        finally:
            resp.release_conn()

    def watch_pending(self, resource_version: str, *, timeout_seconds: int = 300) -> Iterator[dict]:
        """WATCH unscheduled pods from ``resource_version``: yields raw watch events (dicts).

        Raises ``WatchExpired`` on 410 Gone (the caller re-lists), ``WatchFailed`` on an error event
        or an event over ``MAX_WATCH_EVENT_BYTES``.
        """
        return self._watch(lambda: self.core.list_pod_for_all_namespaces(
            field_selector="spec.nodeName=", resource_version=resource_version, watch=True,
            allow_watch_bookmarks=True, timeout_seconds=timeout_seconds, _preload_content=False,
            _request_timeout=(self.timeout * 5, timeout_seconds + 30)), resource_version)

    def serves_node(self, name: str) -> bool | None:
        """Whether this replica's watch cache serves the Node ``name`` (LIST resourceVersion=0, one name);
        None when it gives no answer."""
        uid = self.node_uid(name)
        return None if uid is None else bool(uid)

    def node_uid(self, name: str) -> str | None:
        """The UID of the Node ``name`` as this replica's watch cache serves it (LIST resourceVersion=0, one
        name): "" when it serves none, None when it gives no answer."""
        try:
            resp = self.core.list_node(field_selector=f"metadata.name={name}", resource_version="0",
                                       _preload_content=False, _request_timeout=self.timeout)
            items = orjson.loads(resp.data).get("items") or []
        except (ApiError, urllib3.exceptions.HTTPError, OSError, ValueError, AttributeError):
            return None
        metas = [i.get("metadata") or {} for i in items if isinstance(i, dict)]
        return next((str(m.get("uid") or "-") for m in metas if m.get("name") == name), "")

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
        return self._watch(lambda: self.core.list_node(
            resource_version=resource_version, watch=True, allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds, _headers={"Accept": _META_WATCH}, _preload_content=False,
            _request_timeout=(self.timeout * 5, timeout_seconds + 30)), resource_version)

    def _watch(self, start: Callable[[], Any], resource_version: str) -> Iterator[dict]:
        """The events of the watch ``start`` opens (its call written out at each caller, where
        tests/integration/test_security.py reads the verb); WatchExpired on 410 Gone."""
        try:
            resp = start()
        except ApiError as e:
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
        self.api.close()


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): re-list."""


class WatchFailed(Exception):
    """The watch stream carried an error event."""
