"""How clients find and tell replicas apart, discovery documents, authentication.

No response header names the replica that served a request: clients find each
replica's advertise IP in the ``default/kubernetes`` Endpoints/EndpointSlice
(pkg/controlplane/reconcilers/lease.go) and its identity Lease in ``kube-system``.
"""

from __future__ import annotations

from kubernetes import client

from fixtures_lab import raw


def test_endpoints_and_endpointslice_list_every_live_replica(lab):
    ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    ep = lab.core_v1(2).read_namespaced_endpoints("kubernetes", "default", _request_timeout=5)
    assert [a.ip for a in ep.subsets[0].addresses] == ips
    assert [(p.name, p.port, p.protocol) for p in ep.subsets[0].ports] == [("https", lab.port, "TCP")]
    slices = lab.discovery_v1(0).list_namespaced_endpoint_slice(
        "default", label_selector="kubernetes.io/service-name=kubernetes", _request_timeout=5).items
    assert [s.metadata.name for s in slices] == ["kubernetes"]
    assert [e.addresses for e in slices[0].endpoints] == [[ip] for ip in ips]
    assert slices[0].address_type == "IPv4"

    lab.replicas[1].stop()  # a replica shutting down removes itself (lease endpoint reconciler)
    ep = lab.core_v1(0).read_namespaced_endpoints("kubernetes", "default", _request_timeout=5)
    assert [a.ip for a in ep.subsets[0].addresses] == ["127.0.0.1", "127.0.0.3"]
    lab.replicas[1].start()
    slices = lab.discovery_v1(1).list_namespaced_endpoint_slice("default", _request_timeout=5).items
    assert [e.addresses for e in slices[0].endpoints] == [[ip] for ip in ips]


def test_identity_leases_one_per_replica(shared_lab):
    leases = shared_lab.coordination_v1(1).list_namespaced_lease(
        "kube-system", label_selector="apiserver.kubernetes.io/identity=kube-apiserver", _request_timeout=5).items
    assert len(leases) == 3
    by_host = {l.metadata.labels["kubernetes.io/hostname"]: l for l in leases}
    assert sorted(by_host) == ["lab-apiserver-0", "lab-apiserver-1", "lab-apiserver-2"]
    for lease in leases:
        assert lease.metadata.name.startswith("apiserver-")
        assert lease.spec.holder_identity.startswith(lease.metadata.name + "_")
        assert lease.spec.lease_duration_seconds == 3600
    assert shared_lab.replicas[0].identity_lease["metadata"]["name"] == by_host["lab-apiserver-0"].metadata.name


def test_discovery_documents(shared_lab):
    api_client = shared_lab.api_client(0)
    assert client.VersionApi(api_client).get_code(_request_timeout=5).git_version.startswith("v1.")
    assert client.CoreApi(api_client).get_api_versions(_request_timeout=5).versions == ["v1"]
    groups = {g.name for g in client.ApisApi(api_client).get_api_versions(_request_timeout=5).groups}
    assert groups == {"coordination.k8s.io", "discovery.k8s.io", "events.k8s.io", "kube-ghost-guard.io"}
    resources = {r.name for r in client.CoreV1Api(api_client).get_api_resources(_request_timeout=5).resources}
    assert {"pods", "pods/binding", "pods/status", "nodes", "events", "endpoints"} <= resources
    for path in ("/healthz", "/livez", "/readyz"):
        assert raw(shared_lab, 2, "GET", path, token=None) == (200, "ok")


def test_a_wrong_or_missing_token_is_401(shared_lab):
    unauthorized = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Unauthorized", "reason": "Unauthorized", "code": 401}
    assert raw(shared_lab, 0, "GET", "/api/v1/pods", token=None) == (401, unauthorized)
    assert raw(shared_lab, 0, "GET", "/api/v1/pods", token="wrong") == (401, unauthorized)
    assert raw(shared_lab, 0, "GET", "/healthz", token="wrong") == (401, unauthorized)
    assert raw(shared_lab, 0, "GET", "/lab/faults", token=None)[0] == 401


def test_unknown_paths_and_methods_are_status_errors(shared_lab):
    status, body = raw(shared_lab, 0, "GET", "/api/v1/widgets")
    assert (status, body["reason"]) == (404, "NotFound")
    status, body = raw(shared_lab, 0, "PUT", "/api/v1/pods")
    assert (status, body["reason"]) == (405, "MethodNotAllowed")
    status, body = raw(shared_lab, 0, "GET", "/api/v1/pods?resourceVersion=abc")
    assert (status, body["reason"]) == (400, "BadRequest")


def test_a_crashed_replica_stays_listed(lab):
    lab.replicas[2].stop(graceful=False)
    ep = lab.core_v1(0).read_namespaced_endpoints("kubernetes", "default", _request_timeout=5)
    assert [a.ip for a in ep.subsets[0].addresses] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def test_identity_leases_carry_the_peer_address_only_when_asked(lab_factory, shared_lab):
    plain = shared_lab.coordination_v1(0).list_namespaced_lease(
        "kube-system", label_selector="apiserver.kubernetes.io/identity=kube-apiserver", _request_timeout=5).items
    assert [l.metadata.annotations for l in plain] == [None, None, None]
    lab = lab_factory(2, peer_advertise_address=True)
    leases = lab.coordination_v1(0).list_namespaced_lease(
        "kube-system", label_selector="apiserver.kubernetes.io/identity=kube-apiserver", _request_timeout=5).items
    by_host = {l.metadata.labels["kubernetes.io/hostname"]: l.metadata.annotations for l in leases}
    assert by_host == {f"lab-apiserver-{i}": {"kubernetes.io/peer-advertise-address": f"127.0.0.{i + 1}:{lab.port}"}
                       for i in range(2)}
