"""Per-replica faults (Python API and /lab/faults), replica restarts, etcd outages."""

from __future__ import annotations

import pytest
import urllib3
from kubernetes.client import ApiException

from fixtures_lab import raw

from guard.lab.harness import cached_names, eventually, make_ghost, pod_manifest


def test_status_429_for_a_counted_number_of_matching_requests(shared_lab, lab_namespace):
    r = shared_lab.replicas[0]
    api = shared_lab.core_v1(0)
    path = f"/api/v1/namespaces/{lab_namespace}/pods/p"
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    r.faults.add("status", method="GET", path=r"/api/v1/namespaces/[^/]+/pods/[^/]+", status=429, count=3)
    for _ in range(2):
        assert raw(shared_lab, 0, "GET", path) == (429, {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Too many requests, please try again later.", "reason": "TooManyRequests",
            "details": {"retryAfterSeconds": 1}, "code": 429})
    # The official client (urllib3's default Retry) honours Retry-After on a 429 and retries by itself.
    assert api.read_namespaced_pod("p", lab_namespace, _request_timeout=5).metadata.name == "p"
    assert [(x.status, x.source) for x in r.requests(method="GET", path=path)] == [
        (429, "fault"), (429, "fault"), (429, "fault"), (200, "etcd")]
    assert r.faults.rules() == []


def test_status_500_only_for_the_matching_method_and_path(shared_lab, lab_namespace):
    r = shared_lab.replicas[1]
    api = shared_lab.core_v1(1)
    r.faults.add("status", method="POST", path=r".*/binding", status=500)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    with pytest.raises(ApiException) as e:
        api.create_namespaced_pod_binding("p", lab_namespace, {"metadata": {"name": "p"}, "target": {"name": "n"}},
                                          _preload_content=False, _request_timeout=5)
    assert e.value.status == 500
    assert '"reason":"InternalError"' in e.value.body
    assert api.read_namespaced_pod("p", lab_namespace, _request_timeout=5).spec.node_name is None


def test_latency_delays_matching_requests(shared_lab):
    r = shared_lab.replicas[2]
    rule = r.faults.add("latency", path=r"/api/v1/nodes", seconds=1.0)
    with pytest.raises(urllib3.exceptions.HTTPError):
        raw(shared_lab, 2, "GET", "/api/v1/nodes", timeout=0.2)
    assert raw(shared_lab, 2, "GET", "/api/v1/nodes", timeout=5)[0] == 200
    assert raw(shared_lab, 2, "GET", "/api/v1/namespaces", timeout=0.5)[0] == 200
    assert rule.hits == 2


def test_late_serves_the_write_and_holds_its_answer_back(shared_lab, lab_namespace):
    r = shared_lab.replicas[0]
    path = f"/api/v1/namespaces/{lab_namespace}/pods"
    rule = r.faults.add("late", method="POST", path=path, seconds=60, count=1)
    with pytest.raises(urllib3.exceptions.HTTPError):  # the client gives up waiting for the answer...
        raw(shared_lab, 0, "POST", path, body=pod_manifest("p"), timeout=0.5)
    # ...while etcd already has the pod
    assert shared_lab.core_v1(1).read_namespaced_pod("p", lab_namespace, _request_timeout=5).metadata.name == "p"
    assert rule.hits == 1 and r.faults.rules() == []  # counted: spent, the next request is answered at once
    assert raw(shared_lab, 0, "GET", f"{path}/p", timeout=5)[0] == 200
    r.faults.remove(rule.id)  # lets the held answer go


def test_hang_until_cleared(shared_lab):
    r = shared_lab.replicas[0]
    r.faults.add("hang", path=r"/api/v1/nodes")
    with pytest.raises(urllib3.exceptions.HTTPError):
        raw(shared_lab, 0, "GET", "/api/v1/nodes", timeout=0.3)
    r.faults.clear()
    assert raw(shared_lab, 0, "GET", "/api/v1/nodes")[0] == 200


def test_admin_endpoint_adds_lists_and_removes_faults(shared_lab):
    status, rule = raw(shared_lab, 1, "POST", "/lab/faults", body={"action": "status", "status": 429, "path": "/api/v1/nodes", "count": 1})
    assert status == 201
    assert rule == {"id": rule["id"], "action": "status", "method": None, "path": "/api/v1/nodes", "query": None,
                    "status": 429, "seconds": None, "count": 1, "hits": 0}
    status, drop = raw(shared_lab, 1, "POST", "/lab/faults", body={"action": "drop-deletes", "namespace": "default", "name": "x"})
    assert status == 201
    status, snap = raw(shared_lab, 1, "GET", "/lab/faults")
    assert status == 200
    assert [x["id"] for x in snap["rules"]] == [rule["id"]]
    assert snap["dropDeletes"] == [{"id": drop["id"], "resource": "pods", "namespace": "default", "name": "x", "count": None, "dropped": 0}]
    assert raw(shared_lab, 1, "GET", "/api/v1/nodes")[0] == 429
    assert raw(shared_lab, 1, "DELETE", f"/lab/faults/{drop['id']}")[0] == 200
    assert raw(shared_lab, 1, "DELETE", f"/lab/faults/{drop['id']}")[0] == 404
    assert raw(shared_lab, 1, "POST", "/lab/faults", body={"action": "freeze-watch"}) == (201, {"watchFrozen": True})
    status, snap = raw(shared_lab, 1, "DELETE", "/lab/faults")
    assert (status, snap["watchFrozen"], snap["rules"], snap["dropDeletes"]) == (200, False, [], [])


@pytest.mark.parametrize(("body", "message"), [
    ({"action": "explode"}, "action must be one of latency, status, hang, cut, late, not 'explode'"),
    ({"action": "status", "status": 200}, "status needs a status code between 400 and 599"),
    ({"action": "latency"}, "latency needs seconds >= 0"),
    ({"action": "late", "seconds": -1}, "late needs seconds >= 0"),
    ({"action": "hang", "path": "("}, "path is not a valid regex: missing ), unterminated subpattern at position 0"),
    ({"action": "hang", "count": 0}, "count must be >= 1"),
    ({"action": "hang", "colour": "red"}, "unknown field(s): colour"),
    ({"action": "drop-deletes", "name": 3}, "name has the wrong type"),
    ([], "body must be a JSON object"),
], ids=["unknown-action", "status-not-an-error", "latency-without-seconds", "late-negative", "bad-regex", "zero-count",
        "unknown-field", "wrong-type", "not-an-object"])
def test_admin_endpoint_rejects_bad_faults_with_400(shared_lab, body, message):
    status, out = raw(shared_lab, 0, "POST", "/lab/faults", body=body)
    assert (status, out["reason"], out["message"]) == (400, "BadRequest", message)


def test_frozen_watch_stalls_the_cache_and_consistent_lists_fall_back_to_etcd(lab_factory):
    lab = lab_factory(2, consistent_read_timeout=0.3)
    lab.replicas[1].faults.freeze_watch()
    lab.core_v1(0).create_namespaced_pod("default", pod_manifest("p"), _request_timeout=5)
    assert lab.wait_synced(replicas=[0])
    assert cached_names(lab, 1, "default") == []
    assert lab.replicas[1].cache_revision < lab.revision()
    listed = lab.core_v1(1).list_namespaced_pod("default", _request_timeout=5)
    assert [p.metadata.name for p in listed.items] == ["p"]
    assert [x.source for x in lab.replicas[1].requests(method="GET", path="/api/v1/namespaces/default/pods")][-1] == "etcd"
    lab.replicas[1].faults.unfreeze_watch()
    assert lab.wait_synced()
    assert cached_names(lab, 1, "default") == ["p"]


def test_restart_rebuilds_the_cache_from_etcd_and_heals_the_ghost(lab):
    make_ghost(lab, "default", "web-1", stale=1)
    assert cached_names(lab, 1, "default") == ["web-1"]
    lab.replicas[1].restart()
    assert cached_names(lab, 1, "default") == []
    assert lab.replicas[1].faults.drop_rules() != []  # faults survive a restart; the missed event doesn't come back


def test_a_stopped_replica_refuses_connections(shared_lab):
    shared_lab.replicas[2].stop()
    with pytest.raises(urllib3.exceptions.HTTPError):
        raw(shared_lab, 2, "GET", "/healthz", token=None)
    shared_lab.replicas[2].start()
    assert raw(shared_lab, 2, "GET", "/readyz", token=None) == (200, "ok")


def test_etcd_outage_fails_quorum_reads_while_caches_keep_serving(lab):
    api = lab.core_v1(0)
    api.create_namespaced_pod("default", pod_manifest("p"), _request_timeout=5)
    assert lab.wait_synced()
    lab.etcd.stop()
    with pytest.raises(ApiException) as e:
        api.read_namespaced_pod("p", "default", _request_timeout=10)
    assert e.value.status == 500
    assert '"reason":"InternalError"' in e.value.body
    assert cached_names(lab, 0, "default") == ["p"]
    lab.etcd.start()
    api.create_namespaced_pod("default", pod_manifest("q"), _request_timeout=5)
    assert lab.wait_synced(timeout=10)
    # Waited for, not read once: in one loaded full run (of ~40) every cache had reached etcd's revision while
    # none served q yet (not reproduced in 15 runs alone; the cause is not known). A cache that never gets q
    # still fails here.
    eventually(lambda: [cached_names(lab, i, "default") for i in range(3)] == [["p", "q"]] * 3, 10,
               what="every cache to serve p and q after etcd came back")


def test_a_replica_restarted_while_etcd_is_down_answers_429_until_its_cache_is_ready(lab):
    lab.etcd.stop()
    r = lab.replicas[2]
    r.stop()
    r.start(wait_ready=0)
    status, body = raw(lab, 2, "GET", "/api/v1/pods?resourceVersion=0")
    assert (status, body["reason"], body["message"]) == (429, "TooManyRequests", "storage is (re)initializing")
    assert raw(lab, 2, "GET", "/readyz", token=None)[0] == 500
    lab.etcd.start()
    assert r.cache.ready.wait(10)
    assert raw(lab, 2, "GET", "/api/v1/pods?resourceVersion=0")[0] == 200
    assert raw(lab, 2, "GET", "/readyz", token=None) == (200, "ok")


def test_stop_closes_kept_alive_connections(lab):
    """A stopped replica must not keep serving a client's pooled (kept-alive) TLS connection."""
    http = urllib3.PoolManager(ca_certs=lab.ca_path, cert_reqs="CERT_REQUIRED", retries=False, maxsize=1)
    url = lab.replicas[1].url + "/api/v1/namespaces"
    headers = {"Authorization": f"Bearer {lab.token}"}
    assert http.request("GET", url, headers=headers, timeout=5).status == 200  # the connection stays pooled
    lab.replicas[1].stop()
    with pytest.raises(urllib3.exceptions.HTTPError):
        http.request("GET", url, headers=headers, timeout=5)
    lab.replicas[1].start()
    assert http.request("GET", url, headers=headers, timeout=5).status == 200


def test_admin_request_log_and_cache_state(lab):
    lab.core_v1(2).create_namespaced_pod("default", pod_manifest("p"), _request_timeout=5)
    assert lab.wait_synced()
    status, log = raw(lab, 2, "GET", "/lab/requests")
    assert status == 200
    assert [(r["method"], r["path"], r["status"]) for r in log["requests"]] == [("POST", "/api/v1/namespaces/default/pods", 201)]
    status, cache = raw(lab, 2, "GET", "/lab/cache")
    assert status == 200
    assert (cache["ready"], cache["resourceVersion"], cache["relists"]) == (True, str(lab.revision()), 1)


def test_a_query_regex_targets_only_quorum_gets(shared_lab, lab_namespace):
    """query="" matches requests without a query string: the quorum GET, not the cache read."""
    shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    path = f"/api/v1/namespaces/{lab_namespace}/pods/p"
    status, _ = raw(shared_lab, 1, "POST", "/lab/faults", body={"action": "status", "status": 500, "method": "GET",
                                                                "path": path, "query": ""})
    assert status == 201
    assert raw(shared_lab, 1, "GET", path)[0] == 500
    assert raw(shared_lab, 1, "GET", path + "?resourceVersion=0")[0] == 200
