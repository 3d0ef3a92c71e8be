"""The shipped manifests on a real kube-apiserver (issue 24, item 4; issue 25, hole 9).

- Every overlay under manifests/overlays passes ``kubectl apply --dry-run=server -k`` UNCHANGED, and so does
  docs/INSTALL.md's site overlay with the control-plane-cidr component. (The namespace ``ghost-guard`` is
  created first: a server-side dry run persists nothing, so a dry run of a fresh install cannot see the
  Namespace it would create; a real ``kubectl apply -k`` creates it first.)
- The heal overlay applied for real: its ValidatingAdmissionPolicy lets the guard's ServiceAccount (a real token,
  from the TokenRequest API) heal a deleted ghost and a replaced one through the real ``ghost-guard heal`` code
  path, and refuses, with the policy's message, every other pod write RBAC would let that token make.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from clirun import ghost_guard

from guard.core import heal_plan
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.kube.writes import KubeWriteError
from guard.lab.harness import create, eventually, make_ghost, node_manifest, pod_manifest, quorum_pod

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
OVERLAYS = sorted(p.parent.name for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
GUARD_NS, GUARD_SA = "ghost-guard", "ghost-guard"
POLICY = "ValidatingAdmissionPolicy 'ghost-guard-heal' with binding 'ghost-guard-heal' denied request"


def kubectl(lab, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "--kubeconfig", lab.kubeconfig(0), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def guard_namespace(real_lab):
    real_lab.ensure_namespace(GUARD_NS)
    return GUARD_NS


def dry_run(lab, directory: Path) -> None:
    out = kubectl(lab, "apply", "--dry-run=server", "-k", str(directory))
    assert out.returncode == 0, f"{directory}:\n{out.stderr}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines and all(line.endswith("(server dry run)") for line in lines), out.stdout


def test_overlays_are_the_four_shipped():
    assert OVERLAYS == ["deployment", "deployment-heal", "deployment-webhook", "sidecar"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_passes_a_server_side_dry_run_unchanged(real_lab, guard_namespace, overlay):
    dry_run(real_lab, MANIFESTS / "overlays" / overlay)


def test_install_site_overlay_with_the_cidr_component_passes_a_server_side_dry_run(real_lab, guard_namespace, tmp_path):
    """docs/INSTALL.md step 3, as written there (the test in tests/repo/test_manifests.py extracts the same text)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("unit_manifests", REPO / "tests/repo/test_manifests.py")
    assert spec and spec.loader
    unit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unit)
    for base in ("deployment", "deployment-heal", "deployment-webhook"):
        (tmp_path / base).mkdir()
        site = unit.install_site_overlay(tmp_path / base, base)
        dry_run(real_lab, site)


# --- the heal policy -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heal_installed(real_lab, guard_namespace, tmp_path_factory):
    """deployment-heal applied for real; a kubeconfig holding a token of the guard's ServiceAccount."""
    out = kubectl(real_lab, "apply", "-k", str(MANIFESTS / "overlays" / "deployment-heal"))
    assert out.returncode == 0, out.stderr
    tok = real_lab.core_v1(0).create_namespaced_service_account_token(
        GUARD_SA, GUARD_NS, {"spec": {"expirationSeconds": 3600}}, _request_timeout=10).status.token
    cfg = json.loads(Path(real_lab.kubeconfig(0)).read_text())
    cfg["users"][0]["user"] = {"token": tok}
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return str(path)


def sa_kube(kubeconfig: str) -> Kube:
    return Kube(load_configuration(kubeconfig), timeout=5, pool_size=2)


def refused(kube: Kube, write) -> KubeWriteError:
    with pytest.raises(KubeWriteError) as e:
        write()
    return e.value


def wait_enforced(lab, kube: Kube, namespace: str) -> None:
    """The policy binds asynchronously (its type check, the informer): wait until a forbidden create is refused."""
    body = heal_plan.placeholder_pod("probe-enforced", ["u"], at="t")
    body["metadata"]["labels"]["app"] = "x"

    def enforced() -> bool:
        try:
            kube.create_pod(namespace, body)
        except KubeWriteError as e:
            return e.status == 403 and POLICY in e.message
        lab.core_v1(0).delete_namespaced_pod("probe-enforced", namespace, grace_period_seconds=0, _request_timeout=5)
        eventually(lambda: quorum_pod(lab.core_v1(0), "probe-enforced", namespace=namespace) is None, 10,
                   what="probe pod deleted")
        return False  # created before the policy took effect: try again

    eventually(enforced, 30, what="the heal ValidatingAdmissionPolicy enforced")


def heal(lab, kubeconfig: str, *args: str) -> tuple[int, dict, str]:
    r = ghost_guard("heal", *args, "--kubeconfig", kubeconfig, "--apiserver-replicas", ",".join(lab.urls), "-o", "json")
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {}
    return r.returncode, doc, r.stderr


def test_heal_heals_a_deleted_ghost_through_the_policy_as_the_service_account(real_lab, real_namespace, heal_installed):
    ns = real_namespace
    wait_enforced(real_lab, sa_kube(heal_installed), ns)
    who = subprocess.run(["kubectl", "--kubeconfig", heal_installed, "auth", "whoami", "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    assert who.returncode == 0 and json.loads(who.stdout)["status"]["userInfo"]["username"] == \
        f"system:serviceaccount:{GUARD_NS}:{GUARD_SA}"
    ghost = make_ghost(real_lab, ns, "web-0", stale=1)
    real_lab.replicas[1].faults.clear()  # the watch lost the delete and flows on
    rc, doc, err = heal(real_lab, heal_installed, f"{ns}/web-0")
    assert rc == 0, (err, doc)
    (res,) = doc["results"]
    assert (res["action"], res["outcome"], res["writes"], res["ghostUIDs"]) == ("placeholder", "healed", 2, [ghost])
    assert quorum_pod(real_lab.core_v1(0), "web-0", namespace=ns) is None  # the placeholder is gone
    assert all(real_lab.cached_pod(i, ns, "web-0") is None for i in range(2))


def test_heal_heals_a_replaced_ghost_by_its_one_annotation_as_the_service_account(real_lab, real_namespace, heal_installed):
    ns = real_namespace
    wait_enforced(real_lab, sa_kube(heal_installed), ns)
    api = real_lab.core_v1(0)
    ghost = create(api, pod_manifest("web-1", namespace=ns))["metadata"]["uid"]
    assert real_lab.wait_synced(20)
    real_lab.replicas[1].faults.drop_deletes(namespace=ns, name="web-1", count=1)
    real_lab.replicas[1].faults.drop_creates(namespace=ns, name="web-1", count=1)
    api.delete_namespaced_pod("web-1", ns, grace_period_seconds=0, _request_timeout=5)
    live = create(api, pod_manifest("web-1", namespace=ns, labels={"app": "web"}))
    assert real_lab.wait_synced(20)
    real_lab.replicas[1].faults.clear()
    assert (real_lab.cached_pod(1, ns, "web-1") or {}).get("metadata", {}).get("uid") == ghost
    rc, doc, err = heal(real_lab, heal_installed, f"{ns}/web-1")
    assert rc == 0, (err, doc)
    (res,) = doc["results"]
    assert (res["action"], res["outcome"], res["writes"]) == ("annotate", "healed", 1)
    after = quorum_pod(api, "web-1", namespace=ns)
    assert after["metadata"]["uid"] == live["metadata"]["uid"]
    assert heal_plan.HEAL_ANNOTATION in after["metadata"]["annotations"]
    assert after["metadata"]["labels"] == {"app": "web"}


NODE_POLICY = "ValidatingAdmissionPolicy 'ghost-guard-heal-nodes' with binding 'ghost-guard-heal-nodes' denied request"


def test_heal_node_heals_a_ghost_node_through_the_policy_and_touches_no_real_node(real_lab, heal_installed):
    """As the guard's ServiceAccount: `heal node/NAME` creates and deletes its placeholder Node, and the
    policy refuses deleting a real Node and creating any other Node (issue 27)."""
    from guard.engine import node_healer
    from guard.kube.api import ApiError  # the guard's client raises its own error (guard/kube/api.py)

    api = real_lab.core_v1(0)
    sa = sa_kube(heal_installed).core
    create(api, node_manifest("victim-node"))

    def refused_delete() -> bool:
        try:
            sa.delete_node("victim-node", _request_timeout=5)
        except ApiError as e:
            return e.status == 403 and NODE_POLICY in str(e.body)
        create(api, node_manifest("victim-node"))  # deleted before the policy took effect: again
        return False

    eventually(refused_delete, 30, what="the heal-nodes policy enforced")
    assert api.read_node("victim-node", _request_timeout=5).metadata.name == "victim-node"
    for body in (node_manifest("evil-node"), {**node_healer.placeholder("evil-node"),
                                              "metadata": {"name": "evil-node", "labels": {"app": "x"}}}):
        with pytest.raises(ApiError) as e:
            sa.create_node(body, _request_timeout=5)
        assert e.value.status == 403 and NODE_POLICY in str(e.value.body)

    create(api, node_manifest("ghost-node-h"))
    assert real_lab.wait_synced(20, resource="nodes")
    # Replica 2 loses this Node's DELETE. Waited on by this rule's own count: the faults' ``dropped`` list is the
    # shared lab's whole history (an earlier test's ghost is in it), and a rule cleared before the DELETE
    # reached the proxy lets it through. The rule stays until both caches are past the DELETE.
    stale = real_lab.replicas[1].faults
    rule = stale.drop_deletes(name="ghost-node-h", resource="nodes")
    api.delete_node("ghost-node-h", _request_timeout=5)
    eventually(lambda: rule.dropped >= 1, 30, what="replica 2 lost the Node's DELETE")
    served = lambda i: "ghost-node-h" in {n.metadata.name for n in real_lab.core_v1(i).list_node(  # noqa: E731
        resource_version="0", _request_timeout=5).items}
    eventually(lambda: not served(0), 30, what="replica 1 drops it")
    assert real_lab.wait_synced(20, resource="nodes")
    assert served(1)
    stale.clear()  # one lost delete; the watch flows on (the heal's own placeholder DELETE must reach it)
    rc, doc, err = heal(real_lab, heal_installed, "node/ghost-node-h", "node/victim-node")
    assert rc == 0, (err, doc)
    outcomes = {n["node"]: n["outcome"] for n in doc["nodes"]}
    assert outcomes == {"ghost-node-h": "healed", "victim-node": "etcd-has-it"}
    assert not served(1) and not served(0)  # no restart
    assert api.read_node("victim-node", _request_timeout=5).metadata.name == "victim-node"


def _placeholder(name: str) -> dict:
    return heal_plan.placeholder_pod(name, ["00000000-0000-0000-0000-000000000000"], at="2026-12-02T00:00:00Z")


def _forbidden_creates() -> list[tuple[str, dict, str]]:
    out = []
    b = _placeholder("token-mount")
    b["spec"]["automountServiceAccountToken"] = True
    out.append(("a pod mounting a service account token", b, "no service account token"))
    b = _placeholder("privileged")
    b["spec"]["containers"][0]["securityContext"]["privileged"] = True
    b["spec"]["containers"][0]["securityContext"].pop("capabilities")
    b["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")  # the API refuses it with privileged
    out.append(("a privileged pod", b, "not privileged"))
    b = _placeholder("host-path")
    b["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
    b["spec"]["containers"][0]["volumeMounts"] = [{"name": "root", "mountPath": "/host"}]
    out.append(("a pod mounting the node's root", b, "no volumes"))
    b = _placeholder("no-gate")
    del b["spec"]["schedulingGates"]
    out.append(("a pod without the scheduling gate", b, "the scheduling gate"))
    b = _placeholder("adoptable")
    b["metadata"]["labels"]["app"] = "web"
    out.append(("a pod a ReplicaSet could adopt", b, "only the labels"))
    b = _placeholder("other-image")
    b["spec"]["containers"][0]["image"] = "registry.example/miner:1"
    out.append(("another image", b, "registry.k8s.io/pause:3.10"))
    b = _placeholder("other-account")
    b["spec"]["serviceAccountName"] = "other"
    out.append(("another ServiceAccount", b, "no service account token"))
    b = _placeholder("quota-hog")
    b["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "64", "memory": "256Gi"},
                                               "limits": {"cpu": "64", "memory": "256Gi"}}
    out.append(("requests that eat the namespace's quota", b, "cpu 1m and memory 8Mi only"))
    b = _placeholder("gpu")
    b["spec"]["containers"][0]["resources"]["limits"]["example.com/gpu"] = "8"
    b["spec"]["containers"][0]["resources"]["requests"]["example.com/gpu"] = "8"
    out.append(("an extended resource", b, "cpu 1m and memory 8Mi only"))
    b = _placeholder("command")
    b["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "id"]
    out.append(("a command", b, "no command"))
    return out


def test_every_other_pod_write_of_the_service_account_is_refused_with_the_policys_message(real_lab, real_namespace,
                                                                                          heal_installed):
    ns = real_namespace
    admin = real_lab.core_v1(0)
    admin.create_namespaced_service_account(ns, {"metadata": {"name": "other"}}, _request_timeout=10)
    kube = sa_kube(heal_installed)
    wait_enforced(real_lab, kube, ns)
    for what, body, why in _forbidden_creates():
        e = refused(kube, lambda: kube.create_pod(ns, body))
        assert e.status == 403 and POLICY in e.message and why in e.message, (what, e)
        assert quorum_pod(admin, body["metadata"]["name"], namespace=ns) is None, what

    live = create(admin, pod_manifest("live", namespace=ns, labels={"app": "web"}))
    rv = live["metadata"]["resourceVersion"]
    for what, patch in [
        ("patching a label", {"metadata": {"labels": {"app": "stolen"}}}),
        ("patching another annotation", {"metadata": {"annotations": {"example.com/x": "y"}}}),
        ("removing a label", {"metadata": {"labels": {"app": None}}}),
        ("changing the spec", {"spec": {"activeDeadlineSeconds": 1}}),
        ("adding a finalizer", {"metadata": {"finalizers": ["example.com/keep"]}}),
    ]:
        e = refused(kube, lambda: kube.merge_patch_pod(ns, "live", patch))
        assert e.status == 403 and POLICY in e.message and "only change the annotation" in e.message, (what, e)
    e = refused(kube, lambda: kube.delete_pod(ns, "live", live["metadata"]["uid"]))
    assert e.status == 403 and POLICY in e.message and "only delete its placeholders" in e.message, e
    after = quorum_pod(admin, "live", namespace=ns)
    assert after["metadata"]["resourceVersion"] == rv  # nothing was written

    # what heal writes still goes through, written by the same code heal uses
    patched = kube.merge_patch_pod(ns, "live", heal_plan.annotation_patch(rv, ["u"], at="t"))
    assert patched["metadata"]["labels"] == {"app": "web"}
    created = kube.create_pod(ns, _placeholder("web-9"))
    kube.delete_pod(ns, "web-9", created["metadata"]["uid"])
    eventually(lambda: quorum_pod(admin, "web-9", namespace=ns) is None, 10, what="placeholder deleted")

    # a pods subresource (eviction) is refused even if RBAC were widened: RBAC already refuses it here
    e = refused(kube, lambda: kube._write(lambda t: kube.core.create_namespaced_pod_eviction(
        "live", ns, {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "live", "namespace": ns}},
        _preload_content=False, _request_timeout=t), 5))
    assert e.status == 403

    # the policy holds the guard's identities only: an administrator still writes what it likes
    admin.patch_namespaced_pod("live", ns, {"metadata": {"labels": {"app": "other"}}}, _request_timeout=5)


def test_the_policy_shipped_is_the_policy_applied(real_lab, heal_installed):
    got = subprocess.run(["kubectl", "--kubeconfig", real_lab.kubeconfig(0), "get", "validatingadmissionpolicy",
                          "ghost-guard-heal", "-o", "json"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    live = json.loads(got.stdout)
    shipped = next(d for d in yaml.safe_load_all((MANIFESTS / "heal/validatingadmissionpolicy.yaml").read_text())
                   if d["kind"] == "ValidatingAdmissionPolicy")
    assert [v["expression"] for v in live["spec"]["validations"]] == \
        [v["expression"] for v in copy.deepcopy(shipped)["spec"]["validations"]]
    # (status.typeChecking is written by kube-controller-manager's validatingadmissionpolicy-status-controller,
    # which this lab does not run; the expressions are compiled by the apiserver when they are used, and the
    # tests above exercise every validation)
