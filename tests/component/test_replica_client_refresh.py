"""A client aimed at one apiserver replica (``ReplicaClient``) while the credentials' refresh hook runs.

The kubeconfig loader's hook (and the in-cluster one) rewrites ``configuration.host`` to the kubeconfig's
server on every request; every thread calling the replica builds its URL from ``configuration.host``. When
the hook wrote the shared configuration (and the replica's URL was put back after it), a request another
thread built in between went to the kubeconfig's server: in a loaded full run a replica's Node listing was
answered by the other replica, and the ghost Node it served was never seen. The interleaving is held here
with an event: one thread stopped inside the hook, the others looking on.
"""

from __future__ import annotations

import copy
import threading

import pytest

from guard.core.settings import Replica, parse_replicas
from guard.kube.config import load_configuration
from guard.kube.watch import ReplicaClient
from guard.lab.harness import pod_manifest


def replica(lab, i: int) -> Replica:
    (one,) = parse_replicas(lab.urls[i])  # as --apiserver-replicas makes it
    return one


@pytest.fixture
def only_on_1(shared_lab, lab_namespace) -> str:
    """A pod replica 1's cache serves and replica 0's lost (its creation dropped): which one answered shows."""
    shared_lab.replicas[0].faults.drop_creates(namespace=lab_namespace, name="only-on-1")
    shared_lab.core_v1(1).create_namespaced_pod(lab_namespace, pod_manifest("only-on-1"), _request_timeout=5)
    assert shared_lab.wait_synced()
    assert shared_lab.cached_pod(1, lab_namespace, "only-on-1") and not shared_lab.cached_pod(0, lab_namespace, "only-on-1")
    return "only-on-1"


def test_a_request_built_while_another_thread_refreshes_the_token_goes_to_the_replica(shared_lab, lab_namespace,
                                                                                      only_on_1):
    base = load_configuration(shared_lab.kubeconfig(0))  # the official loader: its hook sets replica 0's URL
    loader_hook = base.refresh_api_key_hook
    assert loader_hook is not None
    inside, release = threading.Event(), threading.Event()

    def held(cfg) -> None:
        loader_hook(cfg)  # the loader's own hook: host, TLS settings, token
        if threading.current_thread().name == "refresher":
            inside.set()
            release.wait(20)

    base.refresh_api_key_hook = held
    client = ReplicaClient(base, replica(shared_lab, 1), server_name=None, timeout=5)
    answers: list = []
    refresher = threading.Thread(target=lambda: answers.append(client.read_cache(lab_namespace, only_on_1)),
                                 name="refresher")
    refresher.start()
    try:
        assert inside.wait(20), "the refresher never reached the hook"
        # Mid-refresh: what every other thread builds its URL from is still replica 1's.
        assert client.api.configuration.host == shared_lab.urls[1]
        items, _, error = client.read_cache(lab_namespace, only_on_1)
        assert (error, [i["metadata"]["name"] for i in items]) == (None, [only_on_1])
    finally:
        release.set()
        refresher.join(20)
        client.close()
    (items, _, error), = answers
    assert (error, [i["metadata"]["name"] for i in items]) == (None, [only_on_1])  # replica 1 answered it too


def test_a_token_the_hook_renews_is_the_one_sent(shared_lab, lab_namespace, only_on_1):
    """Only the credentials come back from the hook: a renewed token is used, whether the hook replaces the
    key mapping or fills it in place (as the kubeconfig loader does)."""
    base = copy.deepcopy(load_configuration(shared_lab.kubeconfig(0)))
    for in_place in (False, True):
        base.api_key, base.api_key_prefix = {"authorization": "Bearer expired"}, {}
        calls: list[str] = []

        def renew(cfg, in_place=in_place) -> None:
            calls.append(cfg.host)
            cfg.host = shared_lab.urls[0]  # as the loader's hook does
            if in_place:
                cfg.api_key["authorization"] = f"Bearer {shared_lab.token}"
            else:
                cfg.api_key = {"authorization": f"Bearer {shared_lab.token}"}

        base.refresh_api_key_hook = renew
        client = ReplicaClient(base, replica(shared_lab, 1), server_name=None, timeout=5)
        try:
            items, _, error = client.read_cache(lab_namespace, only_on_1)
            assert (error, [i["metadata"]["name"] for i in items]) == (None, [only_on_1]), in_place
            assert calls and client.api.configuration.host == shared_lab.urls[1]
        finally:
            client.close()
