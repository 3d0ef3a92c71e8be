"""The contract between the serving worker (guard.serving.worker) and this app: the WSGI environ
and ``app.extensions`` keys the worker reads and fills, and what the worker calls on the direct
lane (:class:`DirectLane`). guard.serving imports it; it imports nothing of the guard."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

# The WSGI environ key the worker adds: the verified client certificate (ssl.getpeercert() form, or None).
PEER_CERT = "ghost_guard.peer_cert"

# The WSGI environ key the worker adds for a large call: the Codec (below) that decodes a verb call's body and
# encodes its answer (guard.serving.offload's helper processes); absent: guard.http.filter.LOCAL.
CODEC = "ghost_guard.codec"


class Codec(Protocol):
    """Who turns a verb call's body into its arguments and the decision into the answer's bytes, the two
    steps whose CPU grows with the body (guard.http.filter.LOCAL in the worker; guard.serving.offload
    hands a large call's to a helper process, so that no other call waits on the GIL for them)."""

    def parse(self, path: str, body: bytes, max_nodes: int | None) -> Any:
        """The arguments (anything with the ``pod``, a PodRef). Raises ProtocolError."""

    def encode(self, args: Any, block_reason: str | None, ghosts: Mapping[str, object]) -> tuple[bytes, int]:
        """(answer, candidates dropped as ghost Nodes): guard.core.extender.verb_reply's contract."""


# The key under which a WSGI app offers its direct lane (``app.extensions[DIRECT_LANE]``): a DirectLane.
DIRECT_LANE = "ghost_guard.direct_lane"

# A client certificate as ssl.getpeercert() gives it, or None.
PeerCert = dict[str, Any] | None
# (HTTP status, JSON payload)
Reply = tuple[int, bytes]


class Waiting(Protocol):
    """A call the event loop decoded but could not answer (DirectLane.answer_now): ``joined``, it is
    parked on its pod's quorum GET in flight; else it goes to a pool thread at once. Either way a pool
    thread that takes it over answers it as it is (DirectLane.answer_taken), never decoding it again.
    The worker reads only when its budget began (``arrived``, time.monotonic), to hand a parked one to
    a pool thread before that budget ends."""

    @property
    def arrived(self) -> float: ...

    @property
    def joined(self) -> bool: ...


W = TypeVar("W", bound=Waiting)


class DirectLane(Protocol[W]):
    """What the worker calls for a verb call in exactly kube-scheduler's shape (``POST`` over HTTP/1.1, a
    JSON body with a Content-Length: guard.serving.framing.plain_call), without WSGI.

    In the event loop, which must never wait: :meth:`answer_now`, then, for a parked call, once the
    GET it waits for has landed, :meth:`answer_landed`. From a pool thread: :meth:`answer_taken` for a
    call the loop decoded (a Waiting), the lane itself for the request's bytes."""

    # The paths it answers, and the largest body the event loop hands to answer_now.
    paths: frozenset[str]
    max_body: int

    def answer_now(self, path: str, body: bytes, remote: str | None, peer_cert: PeerCert,
                   wake: Callable[[], None] | None = None) -> Reply | W | None:
        """The reply when it needs no waiting; a Waiting, joined (``wake`` is called, on another
        thread, when its GET lands) or for a pool thread (:meth:`answer_taken`); or None, with nothing
        counted: the worker hands the request's bytes to a pool thread (the lane itself)."""
        ...

    def answer_landed(self, waiting: W) -> Reply | None:
        """The reply of a parked call whose GET has landed, or None: a pool thread answers it
        (:meth:`answer_taken`)."""
        ...

    def answer_taken(self, waiting: W) -> Reply:
        """The reply of a call the event loop decoded (a Waiting), from a pool thread: it may wait,
        within the budget that began at the call's arrival."""
        ...

    def __call__(self, path: str, body: bytes, remote: str | None, peer_cert: PeerCert,
                 arrived: float | None = None, codec: Codec = ...) -> Reply:
        """The reply, from a pool thread; ``arrived`` (time.monotonic): when the call's budget began,
        if it was parked first (default: now); ``codec``: who decodes and encodes a large call (default:
        this process)."""
        ...
