"""The names-mode splice (guard.core.extender: a live pod's node names copied through as the request's own
bytes) over real HTTP, against a running guard: kube-scheduler's body at 5,000 names over one
kept-alive connection, and hostile bodies that must not take it."""

from __future__ import annotations

import http.client

import orjson
import pytest

from guard.lab.harness import eventually, make_ghost, pod_manifest

TAIL = b',"FailedNodes":{},"FailedAndUnresolvableNodes":{},"Error":""}'


@pytest.fixture(scope="module")
def guard(_shared_lab_session, module_guard, tmp_path_factory):
    db = tmp_path_factory.mktemp("names-splice") / "audit.db"
    return module_guard(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--audit-db", str(db), "--no-events"])


def scheduler_body(pod: dict, names: bytes) -> bytes:
    """As kube-scheduler's encoding/json writes ExtenderArgs in names mode."""
    return b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":' + names + b"}"


def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_a_live_pod_gets_its_own_node_names_back_byte_for_byte(guard, shared_lab, lab_namespace):
    live = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("live"), _request_timeout=5)
    pod = {"metadata": {"name": "live", "namespace": lab_namespace, "uid": live.metadata.uid}, "spec": {}}
    names = orjson.dumps([f"ip-10-0-{i // 250}-{i % 250}.ec2.internal" for i in range(5000)])
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
    try:
        for _ in range(5):  # one kept-alive connection, as kube-scheduler calls (first call: its GET; then cached)
            status, reply = post(conn, scheduler_body(pod, names))
            assert status == 200
            assert reply == b'{"Nodes":null,"NodeNames":' + names + TAIL
    finally:
        conn.close()


@pytest.mark.parametrize("tail,expected", [
    pytest.param(b'["a"],"NodeNames":["b"]', ["b"], id="duplicate-key: the last wins, as decoding whole"),
    pytest.param(b'["a\\u0062","c\\"d"]', ["ab", 'c"d'], id="escapes decoded"),
    pytest.param(b'["a",["b"],7]', ["a", ["b"], 7], id="non-strings passed back as sent"),
    pytest.param(b'[ "a" ,\n"b" ]', ["a", "b"], id="whitespace"),
])
def test_bodies_the_splice_refuses_are_answered_as_decoded(guard, shared_lab, lab_namespace, tail, expected):
    live = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("odd"), _request_timeout=5)
    pod = {"metadata": {"name": "odd", "namespace": lab_namespace, "uid": live.metadata.uid}}
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
    try:
        status, reply = post(conn, scheduler_body(pod, tail))
    finally:
        conn.close()
    assert status == 200 and orjson.loads(reply)["NodeNames"] == expected


@pytest.mark.parametrize("tail,reason", [
    (b'["a""b"]', "request body is not valid JSON"),
    (b'["a"]]', "request body is not valid JSON"),
    (b'["a\x01"]', "request body is not valid JSON"),
])
def test_a_malformed_names_array_is_a_400_never_echoed(guard, tail, reason):
    pod = {"metadata": {"name": "x", "namespace": "default", "uid": "u"}}
    conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
    try:
        status, reply = post(conn, scheduler_body(pod, tail))
    finally:
        conn.close()
    assert status == 400 and orjson.loads(reply)["error"].startswith(reason)


def test_a_ghost_with_spliced_names_fails_every_name(guard, shared_lab, lab_namespace):
    uid = make_ghost(shared_lab, lab_namespace, "gone", stale=0)
    pod = {"metadata": {"name": "gone", "namespace": lab_namespace, "uid": uid}}
    names = [f"node-{i}" for i in range(300)]

    def answer() -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
        try:
            status, reply = post(conn, scheduler_body(pod, orjson.dumps(names)))
        finally:
            conn.close()
        assert status == 200
        return orjson.loads(reply)

    # a read that misses its budget on a loaded machine fails open (the names pass): the next call reads again
    out = eventually(lambda: (lambda a: a if a["FailedAndUnresolvableNodes"] else None)(answer()), 30,
                     what="the ghost rejected", interval=0.5)
    assert out["NodeNames"] == [] and sorted(out["FailedAndUnresolvableNodes"]) == sorted(names)
