"""Authorization by the route that runs, not by the spelling (issue 25, hole 1), on a real
``ghost-guard serve`` over mTLS.

Every client certificate ``ghost-guard certs`` issues, and none, calls every route under every
spelling a router might normalize (duplicate slashes, percent-encoding, dot segments, case,
trailing slash, ``;`` parameters, NUL, a query string), raw over TLS (no client library
normalizes the target first), on the direct lane's shape (POST with a Content-Length JSON body)
and on the Flask lane's (chunked). A call *reaches* a route when the route's own view answers
(anything but an ``{"error"}`` refusal). Asserted: no call reaches a route its certificate's
role may not; a refusal is a 403 counted in ``ghost_guard_requests_forbidden_total`` or a 404;
a certificate of the route's role reaches it spelled exactly (with or without a query), and
only so. The guard's apiserver is dead (verdicts fail open): this is about who reaches what.
"""

from __future__ import annotations

import socket
import ssl
from collections import Counter

import orjson
import pytest

from guard.tools.certs import generate
from guard.lab.harness import tls_files
from role_calls import CALLS, OWNER


pytestmark = pytest.mark.timeout(300)

ROUTES = list(CALLS)
ROLES = ["client", "apiserver", "monitoring", None]  # None: no certificate at all


def spellings(route: str) -> dict[str, str]:
    """Request targets for ``route``: the exact one first, then the ones a router might take for it."""
    head, tail = route[:2], route[2:]  # "/f", "ilter"
    first = route[1]
    return {
        "exact": route,
        "query": route + "?x=1",
        "double-slash": "/" + route,
        "triple-slash": "//" + route,
        "inner-double-slash": route.replace("/", "//", 2) if route.count("/") > 1 else route + "//",
        "pct-letter": f"/%{ord(first):02x}{route[2:]}",
        "pct-letter-upper": f"/%{ord(first):02X}{route[2:]}",
        "pct-slash": "/%2F" + route[1:],
        "pct-slash-only": route.replace("/", "%2F"),
        "dot": "/." + route,
        "dot-dot": "/a/.." + route,
        "pct-dot": "/%2e" + route,
        "case": route.upper(),
        "first-upper": head.upper() + tail,
        "trailing-slash": route + "/",
        "semicolon": route + ";x",
        "semicolon-empty": route + ";",
        "nul": route + "%00",
        "pct-suffix": route + "%20",
        "backslash": "\\" + route[1:],
        "fragment": route + "#x",
        "absolute": "https://127.0.0.1" + route,
        "tab": route + "%09",
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("pki"), ips=["127.0.0.1"])


@pytest.fixture(scope="module")
def mtls_guard(pki, dead_kubeconfig, tmp_path_factory, module_guard):
    return module_guard(["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--no-prepare",
                         "--audit-db", str(tmp_path_factory.mktemp("db") / "audit.db")], tls=tls_files(pki),
                        wait="/healthz")


def context(pki, role: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    if role:
        ctx.load_cert_chain(str(getattr(pki, f"{role}_cert")), str(getattr(pki, f"{role}_key")))
    return ctx


def raw_call(port: int, ctx: ssl.SSLContext, method: str, target: str, body: bytes | None,
             chunked: bool) -> tuple[int, bytes]:
    """One request with exactly this target, on a new TLS connection: (status, body); status 0 when
    the TLS handshake refused the client (no certificate: the server requires one)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
    if body is None:
        data = head.encode("latin-1") + b"\r\n"
    elif chunked:
        data = (head + "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode("latin-1")
        data += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        data = (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
        data += body
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(data)
                while chunk := s.recv(65536):
                    reply += chunk
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as e:
            if reply:
                raise
            return 0, repr(e).encode()
    if not reply:
        return 0, b"closed without a reply"
    head_bytes, _, payload = reply.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), payload


def refusal(payload: bytes) -> bool:
    """Whether a reply body is a refusal (``{"error": ...}`` only), not a route's own answer."""
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and set(doc) == {"error"}


def test_no_spelling_reaches_a_route_the_certificate_may_not(mtls_guard, pki):
    port = mtls_guard.port
    contexts = {role: context(pki, role) for role in ROLES}
    forbidden_before = mtls_guard.metric("ghost_guard_requests_forbidden_total")
    tally: Counter[str] = Counter()
    bad: list[tuple] = []
    for route in ROUTES:
        body = CALLS[route]
        method = "GET" if body is None else "POST"
        for kind, target in spellings(route).items():
            for role in ROLES:
                for chunked in ([False, True] if body is not None else [False]):
                    status, payload = raw_call(port, contexts[role], method, target, body, chunked)
                    reached = status != 0 and not refusal(payload)
                    tally["calls"] += 1
                    tally[f"status {status}"] += 1
                    may = role is not None and OWNER[route] == role
                    if reached and not may:
                        tally["reached a forbidden route"] += 1
                        bad.append((route, kind, target, role, chunked, status, payload[:200]))
                    if not reached:
                        tally["refused"] += 1
                        if status == 403:
                            tally["forbidden 403"] += 1
                        elif status == 0 and role is None:
                            tally["refused by the TLS handshake (no certificate)"] += 1
                        elif status == 0 and not target.startswith("/"):
                            # not an origin-form target: gunicorn's request-line parser refuses it
                            tally["closed: invalid request line"] += 1
                        elif status == 0:
                            bad.append(("a certificate refused without a reply", route, kind, role, payload[:200]))
                        elif status != 404:
                            bad.append(("refused with neither 403 nor 404", route, kind, role, status, payload[:200]))
                    if kind in ("exact", "query") and may and not reached:
                        bad.append(("its own role refused", route, kind, role, chunked, status, payload[:200]))
                    if kind not in ("exact", "query") and reached:
                        bad.append(("a spelling reached a route", route, kind, role, chunked, status))
    print(f"\nroute spelling matrix: {dict(tally)}")
    assert not bad, sorted({b[:3] if b[0] != "a spelling reached a route" else b[:4] for b in bad})
    assert tally["reached a forbidden route"] == 0
    # Every 403 counted (one scrape of /metrics with the monitoring certificate is itself no refusal).
    assert mtls_guard.metric("ghost_guard_requests_forbidden_total") - forbidden_before == tally["forbidden 403"]
    assert tally["forbidden 403"] > 0 and tally["calls"] >= 6 * 20 * 4
