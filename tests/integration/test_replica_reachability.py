"""Unreachable replicas never silently turn pre-verification off.

The guard's replica list (``--apiserver-replicas``) names a closed port and a lab replica that is
stopped: no replica can be watched. The guard then watches unscheduled pods through its
kubeconfig's own server (lab replica 0), says so once in the log, and a new pod is quorum-read
in the background *before* the scheduler's call, which finds its verdict prepared. Per replica,
``ghost_guard_replica_watch_up`` is 0 and ``/readyz`` (200 throughout) shows each watch
retrying with its error. When the stopped replica comes back, its watch syncs, the fallback
ends, and that is said once too.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest
from clirun import ghost_guard
from payloads import filter_body
from guard.lab.harness import eventually, pod_manifest

pytestmark = pytest.mark.timeout(120)

FALLBACK = "no apiserver replica can be watched"
RECOVERED = "watched again; stopped pre-verifying through the kubeconfig's server"


def details(g) -> dict:
    resp = g.session.get(g.url("/readyz"), timeout=5)
    assert resp.status_code == 200, resp.text  # informational only: never a reason for 503
    return resp.json()["details"]


@pytest.fixture
def closed_port():
    """A port nobody listens on and nobody else can take while the test runs: bound by this socket,
    never listening, so every connection to it is refused at once (a port merely free when chosen may be
    taken by another process, which then accepts and never answers: a timeout, not a refusal)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_no_replica_watchable_falls_back_to_the_kubeconfig_server(lab, start_guard, tmp_path, closed_port):
    closed = f"127.0.0.1:{closed_port}"
    stopped = lab.replicas[1]
    stopped_address = stopped.url.removeprefix("https://")
    stopped.stop()
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "a.db"), "--no-events",
                     "--apiserver-replicas", f"https://{closed},{stopped.url}",
                     "--prepare-idle-after", "0"])  # verify ahead before any scheduler call
    eventually(lambda: FALLBACK in g.logs(tail=None), 20, what="the fallback announced", process=g)
    eventually(lambda: ((f := details(g)["prepare"]["fallback"]) or {}).get("state") == "synced", 20,
               what="the fallback watch synced", process=g)
    assert g.metric("ghost_guard_watch_fallback") == 1
    assert g.metric("ghost_guard_replica_watch_up", replica=closed) == 0
    assert g.metric("ghost_guard_replica_watch_up", replica=stopped_address) == 0
    replicas = details(g)["replicas"]  # (results reused for 2 s: taken after the fallback started)
    assert {a: r["watch"]["state"] for a, r in replicas.items()} == {closed: "retrying", stopped_address: "retrying"}
    assert all(r["watch"]["error"] for r in replicas.values()), replicas

    # A new pod is verified in the background (through the kubeconfig's server) before the scheduler asks.
    # (the count before the create: the background verification may be done before the create returns)
    verified = g.metric("ghost_guard_prepare_verified_total", verdict="alive")
    uid = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("fresh"), _request_timeout=5).metadata.uid
    path = "/api/v1/namespaces/default/pods/fresh"
    eventually(lambda: lab.replicas[0].requests(method="GET", path=path, quorum=True), 10,
               what="the background quorum GET", process=g)
    # the GET reached the apiserver; its verdict is the guard's once the guard counts the pod verified
    eventually(lambda: g.metric("ghost_guard_prepare_verified_total", verdict="alive") > verified, 10,
               what="the prepared verdict stored", process=g)
    asked = time.time()
    body = filter_body("default", "fresh", uid, spec=False)
    assert g.post("/filter", body).json()["NodeNames"] == ["n1"]
    quorum = [rec for r in lab.replicas for rec in r.requests(method="GET", path=path, quorum=True)]
    assert len(quorum) == 1 and quorum[0].time < asked, quorum  # one GET, before the call
    assert g.metric("ghost_guard_verdicts_prepared_total") == 1
    assert g.metric("ghost_guard_verdicts_inline_total") == 0

    # The stopped replica comes back: its watch syncs, the fallback ends, said once.
    stopped.start()
    eventually(lambda: RECOVERED in g.logs(tail=None), 30, what="the recovery announced", process=g)
    assert g.metric("ghost_guard_replica_watch_up", replica=stopped_address) == 1
    assert g.metric("ghost_guard_replica_watch_up", replica=closed) == 0
    assert g.metric("ghost_guard_watch_fallback") == 0
    eventually(lambda: details(g)["prepare"]["fallback"] is None, 5, what="/readyz without the fallback")
    assert details(g)["replicas"][stopped_address]["watch"]["state"] == "synced"
    log = g.logs(tail=None)
    assert log.count(FALLBACK) == 1 and log.count(RECOVERED) == 1, log[-3000:]

    # A ghost: every replica's cache is probed; the closed one's failure is counted and shown.
    ghost = filter_body("default", "gone", "gone-uid", spec=False)
    assert list(g.post("/filter", ghost).json()["FailedAndUnresolvableNodes"]) == ["n1"]
    eventually(lambda: g.metric("ghost_guard_replica_probe_errors_total", replica=closed, kind="unreachable") >= 1,
               10, what="the failed probe counted", process=g)
    probes = eventually(lambda: all((d := details(g)["replicas"])[a]["last_probe"] for a in (closed, stopped_address))
                        and d, 10, what="/readyz probe details")
    assert probes[closed]["last_probe"]["outcome"] == "unreachable", probes
    assert probes[stopped_address]["last_probe"]["outcome"] == "consistent", probes

    # `ghost-guard report` shows each replica's newest probe, from the audit store.
    def reported() -> dict:
        out = ghost_guard("report", "--db", str(tmp_path / "a.db"), "-o", "json")  # in-process (tests/clirun.py)
        return {p["replica"]: p for p in orjson.loads(out.stdout)["replica_probes"]} if out.returncode in (0, 1) else {}

    report = eventually(lambda: (r := reported()) and closed in r and stopped_address in r and r, 10,
                        what="the probes in the report")
    # "unreachable: ..." (refused) as a rule; a probe thread starved past its 0.5 s deadline on a loaded machine
    # says "timeout: ..." first. Both are the class the report shows, "unreachable": no timing decides the test.
    assert report[closed]["last_probe"] == "unreachable", report
    assert report[closed]["error"].startswith(("unreachable", "timeout")), report
    assert report[stopped_address]["last_probe"] == "consistent", report
