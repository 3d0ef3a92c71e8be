"""The contract between the serving worker (guard.serving.worker) and this app: the WSGI environ
and ``app.extensions`` keys the worker reads and fills. guard.serving imports it; it imports nothing."""

from __future__ import annotations

# The WSGI environ key the worker adds: the verified client certificate (ssl.getpeercert() form, or None).
PEER_CERT = "ghost_guard.peer_cert"

# The key under which a WSGI app offers its direct lane (``app.extensions[DIRECT_LANE]``): a callable
# ``lane(path, body, remote_ip, peer_cert) -> (status, JSON payload)``, with ``lane.paths`` (the paths
# it answers) and ``lane.max_body`` (the largest body it takes).
DIRECT_LANE = "ghost_guard.direct_lane"
