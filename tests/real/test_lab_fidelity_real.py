"""The real twin of tests/lab/test_lab_fidelity.py: the same requests (tests/fidelity_cases.py) answered by
a real kube-apiserver, on both replicas (one through its etcd fault proxy, both through their watch caches), so
the table of expected answers the lab is held to stays the real apiserver's (docs/LAB.md, "Lab fidelity")."""

from __future__ import annotations

import pytest

import fidelity_cases

from guard.core import heal_plan


@pytest.mark.parametrize("replica", [0, 1])
def test_the_real_apiserver_answers_every_case_as_recorded(real_lab, real_namespace, replica):
    ns = f"{real_namespace}-r{replica}"  # the cases create pods: one namespace per run
    real_lab.ensure_namespace(ns)
    got = fidelity_cases.run(real_lab.urls[replica], real_lab.token, real_lab.ca_path, ns)
    wrong = {case.id: (answer, fidelity_cases.expected(case, ns)) for case, answer in got
             if answer != fidelity_cases.expected(case, ns)}
    assert wrong == {}, "\n".join(f"{k}: real {a!r}, recorded {e!r}" for k, (a, e) in wrong.items())


def test_the_real_apiserver_refuses_a_placeholder_under_a_forged_name(real_lab, real_namespace):
    from kubernetes.client.exceptions import ApiException

    body = heal_plan.placeholder_pod("web-0,metadata.namespace=default", ["u"], at="t")
    with pytest.raises(ApiException) as e:
        real_lab.core_v1(0).create_namespaced_pod(real_namespace, body, _request_timeout=5)
    assert e.value.status == 422
