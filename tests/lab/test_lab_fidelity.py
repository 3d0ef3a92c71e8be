"""The lab answers as a real kube-apiserver does: names, field and label selectors, resourceVersion parameters,
pagination (tests/fidelity_cases.py; every expected answer was recorded from a real v1.36.2 kube-apiserver, and
tests/real/test_lab_fidelity_real.py checks the same table against one whenever binaries are given).
docs/LAB.md, "Lab fidelity", lists what was found and fixed."""

from __future__ import annotations

import pytest

import fidelity_cases


def test_the_lab_answers_every_case_as_the_real_apiserver(shared_lab, lab_namespace):
    got = fidelity_cases.run(shared_lab.replicas[0].url, shared_lab.token, shared_lab.ca_path, lab_namespace)
    wrong = {case.id: (answer, fidelity_cases.expected(case, lab_namespace)) for case, answer in got
             if answer != fidelity_cases.expected(case, lab_namespace)}
    assert wrong == {}, "\n".join(f"{k}: lab {a!r}, real {e!r}" for k, (a, e) in wrong.items())


def test_every_replica_refuses_a_placeholder_name_the_apiserver_refuses(shared_lab, lab_namespace):
    """Issue 24: the lab created (and deleted) a heal placeholder named ``<pod>,metadata.namespace=default``."""
    from guard.core import heal_plan

    body = heal_plan.placeholder_pod("web-0,metadata.namespace=default", ["u"], at="t")
    for i in range(len(shared_lab.replicas)):
        api = shared_lab.core_v1(i)
        with pytest.raises(Exception) as e:
            api.create_namespaced_pod(lab_namespace, body, _request_timeout=5)
        assert getattr(e.value, "status", None) == 422


@pytest.mark.parametrize("kind,name,ok", [
    ("pods", "a" * 253, True), ("pods", "a.b-c.d", True), ("pods", "0", True),
    ("pods", "a" * 254, False), ("pods", "a\n", False), ("pods", "a.", False), ("pods", ".a", False),
    ("namespaces", "a" * 63, True), ("namespaces", "a" * 64, False), ("namespaces", "a.b", False),
    ("services", "a1", True), ("services", "1a", False),
])
def test_name_rules(kind, name, ok):
    from guard.lab.api import known_resource, name_errors

    assert (name_errors(known_resource("", "v1", kind), name) == []) is ok


def test_goquote_escapes_as_go_does():
    from guard.lab.api import goquote

    assert goquote('a"b\\c') == '"a\\"b\\\\c"'
    assert goquote("a\nb\x01\u202e") == '"a\\nb\\x01\\u202e"'
    assert goquote("é") == '"é"'
