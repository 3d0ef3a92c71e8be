import orjson
import pytest

from guard.core.admission import build_response, parse_review
from guard.core.extender import ProtocolError
from guard.core.verdict import PodRef


def review(**req) -> bytes:
    base = {"uid": "rev-1", "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "binding",
            "name": "web-1", "namespace": "default", "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Binding",
                       "metadata": {"name": "web-1", "namespace": "default", "uid": "uid-1"},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}}
    base.update(req)
    return orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": base})


@pytest.mark.parametrize("body,pod", [
    pytest.param(review(), PodRef("default", "web-1", "uid-1"), id="binding"),
    pytest.param(review(object={"metadata": {}}, namespace="ns2", name="p"), PodRef("ns2", "p", ""),
                 id="binding-without-metadata-uses-request-name"),
    pytest.param(review(subResource="status"), None, id="pods-status-not-checked"),
    pytest.param(review(operation="UPDATE"), None, id="update-not-checked"),
    pytest.param(review(resource={"group": "apps", "version": "v1", "resource": "pods"}), None, id="other-group"),
])
def test_parse_review(body, pod):
    r = parse_review(body)
    assert r.uid == "rev-1"
    assert r.pod == pod


@pytest.mark.parametrize("body,reason", [
    pytest.param(b"nope", "request body is not valid JSON", id="garbage"),
    pytest.param(orjson.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}),
                 "expected apiVersion admission.k8s.io/v1 kind AdmissionReview", id="v1beta1"),
    pytest.param(orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
                 "AdmissionReview.request is missing", id="no-request"),
    pytest.param(review(uid=None), "AdmissionReview.request.uid is missing", id="no-uid"),
    pytest.param(review(object=None), "AdmissionReview.request.object (the Binding) is missing", id="no-object"),
])
def test_bad_reviews(body, reason):
    with pytest.raises(ProtocolError) as e:
        parse_review(body)
    assert str(e.value).startswith(reason)


def test_responses():
    assert orjson.loads(build_response("u", allowed=True)) == {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": "u", "allowed": True}}
    assert orjson.loads(build_response("u", allowed=False, message="ghost pod: x")) == {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "response": {"uid": "u", "allowed": False, "status": {"code": 403, "reason": "Forbidden", "message": "ghost pod: x"}}}
