"""The contract between the serving worker (guard.serving.worker) and this app: the WSGI environ
and ``app.extensions`` keys the worker reads and fills. guard.serving imports it; it imports nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

# The WSGI environ key the worker adds: the verified client certificate (ssl.getpeercert() form, or None).
PEER_CERT = "ghost_guard.peer_cert"

# The WSGI environ key the worker adds for a large call: the Codec (below) that decodes a verb call's body and
# encodes its answer (guard.serving.offload's helper processes); absent: guard.http.filter.LOCAL.
CODEC = "ghost_guard.codec"

# The key under which a WSGI app offers its direct lane (``app.extensions[DIRECT_LANE]``): a callable
# ``lane(path, body, remote_ip, peer_cert, arrived=None, codec=LOCAL) -> (status, JSON payload)``, with
# ``lane.paths`` (the paths it answers) and ``lane.max_body`` (the largest body it takes).
DIRECT_LANE = "ghost_guard.direct_lane"


class Codec(Protocol):
    """Who turns a verb call's body into its arguments and the decision into the answer's bytes, the two
    steps whose CPU grows with the body (guard.http.filter.LOCAL in the worker; guard.serving.offload
    hands a large call's to a helper process, so that no other call waits on the GIL for them)."""

    def parse(self, path: str, body: bytes, max_nodes: int | None) -> Any:
        """The arguments (anything with the ``pod``, a PodRef). Raises ProtocolError."""

    def encode(self, args: Any, block_reason: str | None, ghosts: Mapping[str, object]) -> tuple[bytes, int]:
        """(answer, candidates dropped as ghost Nodes): guard.core.extender.verb_reply's contract."""
