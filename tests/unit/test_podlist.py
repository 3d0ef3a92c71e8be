"""guard.core.podlist: a PodList read one pod at a time gives what decoding it whole gives, reduced,
for kube-apiserver's bodies and for any other shape (which is decoded whole), with a peak of
memory near the body's size instead of several times it."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.core.podlist import lean, read_pod_list


def apiserver_pod(i: int, **extra) -> dict:
    """A pending pod as kube-apiserver serves it (managedFields, containers, status: the bulk)."""
    return {
        "metadata": {"name": f"p-{i:05d}", "namespace": "ns", "uid": f"uid-{i}", "resourceVersion": str(100 + i),
                     "creationTimestamp": f"2026-12-02T07:{i % 60:02d}:00Z", "labels": {"app": "web"},
                     "managedFields": [{"manager": "python", "operation": "Update", "apiVersion": "v1",
                                        "time": "2026-12-02T07:00:00Z", "fieldsType": "FieldsV1",
                                        "fieldsV1": {"f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {}}}}}]},
        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
                 "restartPolicy": "Always", "schedulerName": "default-scheduler", **extra},
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


def pod_list(items: list, rv: str = "4711") -> bytes:
    return orjson.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items})


def whole(body: bytes):
    doc = orjson.loads(body)
    return str(doc["metadata"].get("resourceVersion") or ""), [lean(i) for i in doc.get("items") or []]


NESTED = {"volumes": [{"name": "v", "ephemeral": {"volumeClaimTemplate": {"metadata": {"labels": {"a": "b"}}}}}],
          "x": [{"a": 1}, {"metadata": {"name": "not-a-pod"}}]}  # "},{"metadata":{" inside a pod


@pytest.mark.parametrize("body", [
    pytest.param(pod_list([apiserver_pod(i) for i in range(3)]), id="apiserver"),
    pytest.param(pod_list([]), id="empty"),
    pytest.param(pod_list([apiserver_pod(0)]), id="one"),
    pytest.param(pod_list([apiserver_pod(0, **NESTED), apiserver_pod(1)]), id="separator-inside-a-pod"),
    pytest.param(pod_list([apiserver_pod(0, nodeName="n1"), {**apiserver_pod(1), "metadata": {
        **apiserver_pod(1)["metadata"], "deletionTimestamp": "2026-12-02T08:00:00Z"}}]), id="bound-and-terminating"),
    pytest.param(pod_list([apiserver_pod(0)]) + b"\n  ", id="trailing-whitespace"),
    pytest.param(orjson.dumps({"kind": "PodList", "items": [apiserver_pod(0)], "metadata": {"resourceVersion": "9"}}),
                 id="items-before-metadata"),
    pytest.param(orjson.dumps({"kind": "PodList", "metadata": {"resourceVersion": "9"},
                               "items": [apiserver_pod(0)]}, option=orjson.OPT_INDENT_2), id="indented"),
    pytest.param(pod_list([{"spec": {}, "metadata": {"name": "spec-first", "uid": "u"}}]), id="spec-first"),
    pytest.param(pod_list([1, "x", None]), id="not-objects"),
    pytest.param(b'{"items":[],"metadata":{"resourceVersion":"1"},"items":[{"metadata":{"name":"b"}}]}',
                 id="duplicate-items-key: the last wins"),
    pytest.param(b'{"metadata":{"resourceVersion":"1"},"items":[{"metadata":{"name":"a\\"},{\\"metadata\\":{"}}]}',
                 id="separator-escaped-in-a-string"),
])
def test_read_as_decoding_whole(body):
    assert read_pod_list(body) == whole(body)


def test_only_the_fields_the_guard_reads_are_kept():
    rv, items = read_pod_list(pod_list([apiserver_pod(7, nodeName="n")]))
    assert rv == "4711"
    assert items == [{"metadata": {"name": "p-00007", "namespace": "ns", "uid": "uid-7", "resourceVersion": "107",
                                   "creationTimestamp": "2026-12-02T07:07:00Z"}, "spec": {"nodeName": "n"}}]


@pytest.mark.parametrize("body", [
    pod_list([apiserver_pod(0)])[:-3],
    pod_list([apiserver_pod(0), apiserver_pod(1)]).replace(b'},{"metadata":{', b'},,{"metadata":{', 1),
    pod_list([apiserver_pod(0), apiserver_pod(1)]).replace(b'},{"metadata":{', b'}{"metadata":{', 1),
    b"",
    b"[]]",
])
def test_a_body_that_is_not_json_raises(body):
    with pytest.raises(ValueError):
        read_pod_list(body)


@settings(max_examples=100, deadline=None, database=None)
@given(pods=st.lists(st.fixed_dictionaries({"metadata": st.dictionaries(
    st.sampled_from(["name", "uid", "namespace", "x", "metadata"]),
    st.text(max_size=6) | st.lists(st.dictionaries(st.sampled_from(["metadata", "a"]), st.integers(-2**63, 2**63 - 1)), max_size=2)),
    "spec": st.dictionaries(st.sampled_from(["nodeName", "metadata"]), st.text(max_size=4))}), max_size=6),
    cut=st.integers(0, 300), junk=st.sampled_from([b"", b"}", b",", b'{"metadata":{', b'"', b"]"]))
def test_any_listing_or_corruption_reads_as_decoding_whole(pods, cut, junk):
    body = pod_list(pods)
    body = body[:cut] + junk + body[cut:]
    try:
        expected = whole(body)
    except (ValueError, AttributeError, KeyError, TypeError):
        return  # not a PodList at all: the whole decode is the reference only for what it reads
    assert read_pod_list(body) == expected


def test_the_peak_is_near_the_body_not_every_pod_decoded():
    body = pod_list([apiserver_pod(i) for i in range(3000)])
    tracemalloc.start()
    try:
        read_pod_list(body)
        _, split_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        whole(body)
        _, whole_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert split_peak < len(body) + 2 * 1024 * 1024  # the lean items (~1 MB here), plus one pod at a time
    assert whole_peak > 3 * len(body)  # the old way: every field of every pod
