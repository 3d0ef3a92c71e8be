"""The direct lane (guard.serving.framing.plain_call -> guard.http.filter.DirectLane) over real HTTP.

kube-scheduler's calls skip gunicorn's parser and WSGI; they must get the same answers, the
same metrics and the same connection handling as the WSGI lanes, which still take every
other request (HTTP/1.0 here, which goes through FastLane).
"""

from __future__ import annotations

import select
import socket
import threading
import time

import orjson
import pytest

from guard.lab.harness import eventually, make_ghost, pod_manifest


def exchange(port: int, raw: bytes, *, closed: bool = True) -> tuple[bytes, bytes, bool]:
    """(status line, body, whether the guard closed the connection after the reply) of one raw request;
    the status line ends in " [wsgi]" when gunicorn's response object wrote the reply. ``closed=False``
    returns as soon as the reply is in, without waiting up to a second to see the connection closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += s.recv(65536)
        if closed:
            s.settimeout(1.0)
            try:
                closed = s.recv(1) == b""
            except TimeoutError:
                closed = False
    lines = head.split(b"\r\n")
    # gunicorn's Response names itself; the direct lane's reply does not: which lane answered.
    status = lines[0] + (b" [wsgi]" if any(l.lower().startswith(b"server: gunicorn") for l in lines) else b"")
    return status, body, closed


def call(path: str, body: bytes, version: str = "HTTP/1.1", extra: str = "") -> bytes:
    return (f"POST {path} {version}\r\nHost: guard\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def guard(_shared_lab_session, module_guard, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("direct") / "audit.db")
    return module_guard(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--audit-db", db, "--no-prepare",
                         "--no-events"])


@pytest.mark.parametrize("path", ["/filter", "/preempt"])
def test_both_lanes_answer_alike_for_a_live_pod_and_a_ghost(guard, shared_lab, lab_namespace, path):
    live = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("live"), _request_timeout=5)
    ghost_uid = make_ghost(shared_lab, lab_namespace, "gone", stale=1)
    answers = {}
    for name, uid in (("live", live.metadata.uid), ("gone", ghost_uid)):
        pod = {"metadata": {"name": name, "namespace": lab_namespace, "uid": uid}}
        body = orjson.dumps({"Pod": pod, "NodeNames": ["a", "b"], "Nodes": None} if path == "/filter" else
                            {"Pod": pod, "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0}}})
        before = guard.metric("ghost_guard_requests_total", endpoint=path, code="200")
        direct = exchange(guard.port, call(path, body), closed=False)
        fast = exchange(guard.port, call(path, body, version="HTTP/1.0"), closed=False)
        assert guard.metric("ghost_guard_requests_total", endpoint=path, code="200") == before + 2
        assert direct[0] == b"HTTP/1.1 200 OK" and fast[0].endswith(b" 200 OK [wsgi]")
        assert orjson.loads(direct[1]) == orjson.loads(fast[1])
        answers[name] = orjson.loads(direct[1])
    if path == "/filter":
        assert answers["live"]["NodeNames"] == ["a", "b"] and not answers["live"]["FailedAndUnresolvableNodes"]
        assert set(answers["gone"]["FailedAndUnresolvableNodes"]) == {"a", "b"}
    else:
        assert answers["live"]["NodeNameToMetaVictims"] and not answers["gone"]["NodeNameToMetaVictims"]


def test_keep_alive_and_close_as_the_client_asks(guard):
    body = orjson.dumps({"Pod": {"metadata": {"name": "x", "namespace": "default", "uid": "u"}}, "NodeNames": ["a"]})
    assert exchange(guard.port, call("/filter", body))[2] is False
    assert exchange(guard.port, call("/filter", body, extra="Connection: close\r\n"))[2] is True


def test_a_bad_body_gets_the_same_400_reason_in_both_lanes(guard):
    direct = exchange(guard.port, call("/filter", b'{"Pod": 1}'), closed=False)
    fast = exchange(guard.port, call("/filter", b'{"Pod": 1}', version="HTTP/1.0"), closed=False)
    assert direct[0] == b"HTTP/1.1 400 Bad Request" and fast[0].endswith(b" 400 Bad Request [wsgi]")
    assert orjson.loads(direct[1]) == orjson.loads(fast[1]) and orjson.loads(direct[1])["error"]


def test_a_prepared_verdict_is_answered_while_every_pool_thread_waits_on_etcd(_parked_guard_process, shared_lab,
                                                                            lab_namespace):
    """With one pool thread held by a call whose quorum GET is held in the apiserver, a call for a pod
    verified ahead is still answered at once: the worker's event loop answers it (Checker.answer, now), it
    does not queue behind the pool. (The module's --threads 1 guard below; the held GET is let go only once
    that answer is in, so a call queued behind the pool thread would be answered after the slow one.)"""
    g = _parked_guard_process
    ns = lab_namespace
    exchange(g.port, call("/filter", orjson.dumps({"Pod": {"metadata": {"name": "warm", "namespace": ns,
                                                                        "uid": "w"}}, "NodeNames": ["a"]})))
    verified = g.metric("ghost_guard_prepare_verified_total", verdict="alive")
    live = shared_lab.core_v1(0).create_namespaced_pod(ns, pod_manifest("ready"), _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_prepare_verified_total", verdict="alive") >= verified + 1, 20,
               what="the pod verified ahead")
    faults = shared_lab.replicas[0].faults
    rule = faults.add("latency", seconds=30, method="GET", path=f"/api/v1/namespaces/{ns}/pods/slow")
    before = g.metric("ghost_guard_verdicts_prepared_total")  # /metrics needs the pool thread: read it first
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as slow:
        slow.sendall(call("/filter", orjson.dumps(
            {"Pod": {"metadata": {"name": "slow", "namespace": ns, "uid": "s"}}, "NodeNames": ["a"]})))
        try:
            eventually(lambda: rule.hits >= 1, 10, what="the slow call's GET held in the apiserver")
            status, body, _ = exchange(g.port, call("/filter", orjson.dumps(
                {"Pod": {"metadata": {"name": "ready", "namespace": ns, "uid": live.metadata.uid}},
                 "NodeNames": ["a"]})), closed=False)
            # Not queued behind the one pool thread: the slow call is not answered yet (its reply would be in
            # this socket's buffer: a reply on loopback is delivered as it is sent).
            assert select.select([slow], [], [], 0)[0] == [], "the slow call was answered first"
        finally:
            faults.remove(rule.id)  # the slow call's GET lands now (it would be cut at the budget otherwise)
        assert slow.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert status == b"HTTP/1.1 200 OK" and orjson.loads(body)["NodeNames"] == ["a"]
    assert g.metric("ghost_guard_verdicts_prepared_total") == before + 1


# --- parked calls -----------------------------------------------------------------------------------
# A scheduler call whose pod's quorum GET is already in flight (the guard's background verification
# of a pod it has just seen) is parked in the worker's event loop, without a pool thread, and answered
# there when the GET lands (guard.serving.connection.ConnectionLoop._landed; Checker.answer with a wake, then again once woken). The GET is
# held in the lab replica (a "latency" fault) until the test lets it land. With --threads 1, the one
# pool thread still answers /metrics while the call is parked, and /metrics shows it parked.

BUDGET = 3.0


@pytest.fixture(scope="module")
def _parked_guard_process(_shared_lab_session, module_guard):
    return module_guard(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--threads", "1",
                         "--get-timeout", str(BUDGET), "--request-budget", str(BUDGET), "--no-events"])


@pytest.fixture
def parked_guard(_parked_guard_process, shared_lab, lab_namespace):
    """The module's parked-call guard, with no call parked from an earlier test, just called by a scheduler
    (so it verifies new pods ahead: --prepare-idle-after counts from the last call)."""
    g = _parked_guard_process
    eventually(lambda: g.metric("ghost_guard_calls_parked") == 0, 10, what="no call parked from an earlier test")
    warm = {"Pod": {"metadata": {"name": "warm", "namespace": lab_namespace, "uid": "w"}}, "NodeNames": ["a"]}
    exchange(g.port, call("/filter", orjson.dumps(warm)))  # a scheduler call: the guard verifies new pods ahead
    return g


class Parked:
    """A pod created with its quorum GET held in the lab replica, and a /filter call for it on a thread."""

    def __init__(self, guard, lab, ns: str, name: str) -> None:
        self.guard, self.ns, self.name = guard, ns, name
        self.faults = lab.replicas[0].faults
        # Delayed past the budget unless the test lets it go (land), then served from etcd as it is then.
        self.rule = self.faults.add("latency", seconds=30, method="GET", path=f"/api/v1/namespaces/{ns}/pods/{name}")
        self.uid = lab.core_v1(0).create_namespaced_pod(ns, pod_manifest(name), _request_timeout=5).metadata.uid
        eventually(lambda: self.rule.hits >= 1, 20, what="the background verification's GET held in the apiserver")
        self.answer: tuple[bytes, dict] | None = None
        self.elapsed = 0.0
        self.thread = threading.Thread(target=self._call, daemon=True)

    def _call(self) -> None:
        body = orjson.dumps({"Pod": {"metadata": {"name": self.name, "namespace": self.ns, "uid": self.uid}},
                             "NodeNames": ["a", "b"]})
        start = time.monotonic()
        status, payload, _ = exchange(self.guard.port, call("/filter", body), closed=False)
        self.elapsed = time.monotonic() - start
        self.answer = status, orjson.loads(payload)

    def start(self) -> None:
        self.thread.start()
        eventually(lambda: self.guard.metric("ghost_guard_calls_parked") >= 1, 10,
                   what="the call parked in the event loop (its GET in flight; /metrics answered by the one pool thread)")

    def land(self) -> None:
        self.faults.remove(self.rule.id)

    def result(self) -> tuple[bytes, dict]:
        self.thread.join(10)
        assert self.answer is not None, "no answer"
        return self.answer


def test_a_parked_call_is_answered_alive_when_its_get_lands(parked_guard, shared_lab, lab_namespace):
    g = parked_guard
    before = {k: g.metric(k) for k in ("ghost_guard_verdicts_shared_read_total", "ghost_guard_verdicts_prepared_total",
                                       "ghost_guard_verdicts_inline_total")}
    alive = g.metric("ghost_guard_verdicts_total", verdict="alive")
    p = Parked(g, shared_lab, lab_namespace, "parked-alive")
    p.start()
    p.land()
    status, answer = p.result()
    assert status == b"HTTP/1.1 200 OK"
    assert answer["NodeNames"] == ["a", "b"] and not answer["FailedAndUnresolvableNodes"]
    assert g.metric("ghost_guard_verdicts_shared_read_total") == before["ghost_guard_verdicts_shared_read_total"] + 1
    assert g.metric("ghost_guard_verdicts_total", verdict="alive") == alive + 1
    for k in ("ghost_guard_verdicts_prepared_total", "ghost_guard_verdicts_inline_total"):
        assert g.metric(k) == before[k], k  # no verdict ahead was used, and no GET of its own
    eventually(lambda: g.metric("ghost_guard_calls_parked") == 0, 10, what="no call parked any more")


def test_a_parked_call_whose_pod_was_deleted_meanwhile_is_rejected_as_a_ghost(parked_guard, shared_lab, lab_namespace):
    g = parked_guard
    blocked = g.metric("ghost_guard_ghosts_blocked_total")
    took = g.metric("ghost_guard_request_duration_seconds_sum", endpoint="/filter")
    p = Parked(g, shared_lab, lab_namespace, "parked-gone")
    p.start()
    shared_lab.core_v1(0).delete_namespaced_pod(p.name, lab_namespace, grace_period_seconds=0, _request_timeout=5)
    p.land()  # the GET reads etcd now: 404. The loop hands the call to a pool thread, which decides and records it
    status, answer = p.result()
    assert status == b"HTTP/1.1 200 OK"
    assert answer["NodeNames"] == [] and set(answer["FailedAndUnresolvableNodes"]) == {"a", "b"}
    assert g.metric("ghost_guard_ghosts_blocked_total") == blocked + 1
    # The request's recorded duration counts the time it was parked, not only the pool thread's part.
    assert g.metric("ghost_guard_request_duration_seconds_sum", endpoint="/filter") - took >= 0.5 * p.elapsed


def test_a_parked_call_whose_get_never_lands_is_answered_within_its_budget(parked_guard, shared_lab, lab_namespace):
    """The GET hangs past the call's budget: a pool thread takes the call over just before the budget
    runs out, or the GET's own timeout lands first; either way the answer is a pass (fail open, counted)
    within the budget."""
    g = parked_guard
    failed_open = g.metric("ghost_guard_fail_open_total")
    p = Parked(g, shared_lab, lab_namespace, "parked-hung")
    try:
        p.start()
        status, answer = p.result()
    finally:
        p.land()
    assert status == b"HTTP/1.1 200 OK" and answer["NodeNames"] == ["a", "b"]
    assert p.elapsed < BUDGET + 0.5
    assert g.metric("ghost_guard_fail_open_total") == failed_open + 1
