"""The direct lane (guard.worker.plain_call -> guard.http.filter.DirectLane) over real HTTP.

kube-scheduler's calls skip gunicorn's parser and WSGI; they must get the same answers, the
same metrics and the same connection handling as the WSGI lanes, which still take every
other request (HTTP/1.0 here, which goes through FastLane).
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time

import orjson
import pytest

from guard.lab.harness import GuardProcess, eventually, make_ghost, pod_manifest


def exchange(port: int, raw: bytes) -> tuple[bytes, bytes, bool]:
    """(status line, body, whether the guard closed the connection after the reply) of one raw request;
    the status line ends in " [wsgi]" when gunicorn's response object wrote the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += s.recv(65536)
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
def guard(_shared_lab_session):
    db = tempfile.mktemp(prefix="audit-", suffix=".db")
    with GuardProcess(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--audit-db", db, "--no-prepare",
                       "--no-events"]) as g:
        g.wait()
        yield g


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
        direct = exchange(guard.port, call(path, body))
        fast = exchange(guard.port, call(path, body, version="HTTP/1.0"))
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
    direct = exchange(guard.port, call("/filter", b'{"Pod": 1}'))
    fast = exchange(guard.port, call("/filter", b'{"Pod": 1}', version="HTTP/1.0"))
    assert direct[0] == b"HTTP/1.1 400 Bad Request" and fast[0].endswith(b" 400 Bad Request [wsgi]")
    assert orjson.loads(direct[1]) == orjson.loads(fast[1]) and orjson.loads(direct[1])["error"]


def test_a_prepared_verdict_is_answered_while_every_pool_thread_waits_on_etcd(start_guard, shared_lab, lab_namespace):
    """With one pool thread held by a call whose quorum GET hangs, a call for a pod verified ahead
    is still answered at once: the worker's event loop answers it (Checker.answer_prepared), it
    does not queue behind the pool."""
    g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--threads", "1", "--get-timeout", "2",
                     "--request-budget", "3", "--no-events"])
    ns = lab_namespace
    exchange(g.port, call("/filter", orjson.dumps({"Pod": {"metadata": {"name": "warm", "namespace": ns,
                                                                        "uid": "w"}}, "NodeNames": ["a"]})))
    live = shared_lab.core_v1(0).create_namespaced_pod(ns, pod_manifest("ready"), _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_prepare_verified_total", verdict="alive") >= 1, 20,
               what="the pod verified ahead")
    rule = shared_lab.replicas[0].faults.add("hang", method="GET", path=f"/api/v1/namespaces/{ns}/pods/slow")
    finished: dict[str, float] = {}

    def slow() -> None:
        body = orjson.dumps({"Pod": {"metadata": {"name": "slow", "namespace": ns, "uid": "s"}}, "NodeNames": ["a"]})
        exchange(g.port, call("/filter", body))
        finished["slow"] = time.monotonic()

    before = g.metric("ghost_guard_verdicts_prepared_total")  # /metrics needs the pool thread: read it first
    t = threading.Thread(target=slow)
    t.start()
    eventually(lambda: rule.hits >= 1, 10, what="the slow call's GET hanging in the apiserver")
    status, body, _ = exchange(g.port, call("/filter", orjson.dumps(
        {"Pod": {"metadata": {"name": "ready", "namespace": ns, "uid": live.metadata.uid}}, "NodeNames": ["a"]})))
    finished["ready"] = time.monotonic()
    t.join(10)
    assert status == b"HTTP/1.1 200 OK" and orjson.loads(body)["NodeNames"] == ["a"]
    assert g.metric("ghost_guard_verdicts_prepared_total") == before + 1
    assert finished["ready"] < finished["slow"]  # not queued behind the one pool thread
