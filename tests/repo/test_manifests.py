"""manifests/: every kustomization renders, every object passes the Kubernetes
schemas offline (kubernetes-validate, strict), and the pieces agree with each
other and with the guard's code (RBAC verbs, the extender fields
KubeSchedulerConfiguration's ``extenders[]`` accepts, ports, paths, metric names).

Rendering uses ``kubectl kustomize`` when it is installed and always the small
renderer below (resources, JSON 6902 patches, components and replacements from a
local-config ConfigMap: the only kustomize features the manifests use; it refuses
any other). Where both exist their output must be
identical, so the renderer is checked against the real thing.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from guard.core.settings import SCHEDULER_HTTP_TIMEOUT, WEBHOOK_TIMEOUT_SECONDS, Settings
from guard.core.verdict import Verdict

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
ALL_KUSTOMIZATIONS = sorted(p.parent.relative_to(MANIFESTS).as_posix() for p in MANIFESTS.rglob("kustomization.yaml"))
COMPONENTS = [k for k in ALL_KUSTOMIZATIONS if yaml.safe_load((MANIFESTS / k / "kustomization.yaml").read_text())["kind"] == "Component"]
KUSTOMIZATIONS = [k for k in ALL_KUSTOMIZATIONS if k not in COMPONENTS]  # a Component builds only inside a Kustomization
LOCAL_CONFIG = "config.kubernetes.io/local-config"  # kustomize reads such an object and never emits it
NODE_PODS = ["scheduler/kube-scheduler.yaml", "overlays/sidecar/node/kube-scheduler.yaml"]
SCHEDULER_CONFIGS = ["scheduler/kube-scheduler-config.yaml", "overlays/sidecar/node/scheduler-config.yaml"]
CRD_KINDS = {"PrometheusRule", "ServiceMonitor"}  # monitoring.coreos.com: no schema in kubernetes-validate
K8S_VERSIONS = ["1.31", "1.36"]
NAMESPACE = "ghost-guard"
SIDECAR_USER = "ghost-guard-sidecar"  # the CN of the sidecar's client certificate (docs/INSTALL.md)


# --- a small kustomize ----------------------------------------------------


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json6902(obj: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] in ("replace", "add") and isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            else:
                node[index] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            if last not in node:
                raise KeyError(f"replace of missing {op['path']}")
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"unsupported JSON 6902 op {op['op']!r}")


def _patch(directory: Path, objs: list[dict], patch: dict) -> None:
    target, ops = patch["target"], yaml.safe_load(patch["patch"])
    hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])
            and o["metadata"].get("namespace") == target.get("namespace", o["metadata"].get("namespace"))]
    assert hits, f"{directory}: patch target {target} matches nothing"
    for o in hits:
        _json6902(o, ops)


def _replace(directory: Path, objs: list[dict], rep: dict) -> None:
    """A replacement from one field of one object (a dotted fieldPath) into dotted fieldPaths of the targets."""
    src = rep["source"]
    sources = [o for o in objs if o["kind"] == src["kind"] and o["metadata"]["name"] == src["name"]]
    assert len(sources) == 1, f"{directory}: nothing selected by {src['kind']}/{src['name']}:{src['fieldPath']}"
    value = sources[0]
    for key in src["fieldPath"].split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    for target in rep["targets"]:
        sel = target["select"]
        hits = [o for o in objs if o["kind"] == sel["kind"] and o["metadata"]["name"] == sel.get("name", o["metadata"]["name"])
                and o["metadata"].get("namespace") == sel.get("namespace", o["metadata"].get("namespace"))]
        assert hits, f"{directory}: replacement target {sel} matches nothing"
        for o in hits:
            for field in target["fieldPaths"]:
                *parents, last = field.split(".")
                node = o
                for key in parents:
                    node = node[int(key)] if isinstance(node, list) else node[key]
                node[int(last) if isinstance(node, list) else last] = copy.deepcopy(value)


def render(directory: Path, *, top: bool = True) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(k) - {"apiVersion", "kind", "resources", "patches", "components", "replacements"}
    assert not unsupported, f"{directory}: the test renderer does not implement {sorted(unsupported)}"
    assert k["kind"] == "Kustomization", f"{directory}: a {k['kind']} is not built alone"
    objs: list[dict] = []
    for ref in k.get("resources", []):
        path = (directory / ref).resolve()
        objs += render(path, top=False) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        _patch(directory, objs, patch)
    for rep in k.get("replacements", []):
        _replace(directory, objs, rep)
    for ref in k.get("components", []):  # after this kustomization's own resources and patches, as kustomize does
        path = (directory / ref).resolve()
        comp = yaml.safe_load((path / "kustomization.yaml").read_text())
        assert comp["kind"] == "Component" and set(comp) <= {"apiVersion", "kind", "patches", "replacements"}, path
        for patch in comp.get("patches", []):
            _patch(path, objs, patch)
        for rep in comp.get("replacements", []):
            _replace(path, objs, rep)
    if top:
        objs = [o for o in objs if (o["metadata"].get("annotations") or {}).get(LOCAL_CONFIG) != "true"]
    ids = [ident(o) for o in objs]
    assert len(ids) == len(set(ids)), f"{directory}: duplicate objects"
    return objs


def ident(o: dict) -> tuple[str, str, str]:
    return o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: render(MANIFESTS / k) for k in KUSTOMIZATIONS}


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    (obj,) = by_kind(objs, kind)
    return obj


def named(objs: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
    return obj


def test_heal_nodes_policy_names_the_placeholder_node_heal_makes(rendered):
    """manifests/heal's ghost-guard-heal-nodes policy spells guard/engine/node_healer.py's placeholder Node (labels,
    taint) and allows only CREATE and DELETE of it; the heal role may create and delete nodes."""
    from guard.engine import node_healer

    policy = named(rendered["heal"], "ValidatingAdmissionPolicy", "ghost-guard-heal-nodes")
    binding = named(rendered["heal"], "ValidatingAdmissionPolicyBinding", "ghost-guard-heal-nodes")
    assert binding["spec"] == {"policyName": "ghost-guard-heal-nodes", "validationActions": ["Deny"]}
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes", "nodes/*"]
    text = "\n".join(x["expression"] for x in policy["spec"]["variables"] + policy["spec"]["validations"])
    for k, v in node_healer.PLACEHOLDER_LABELS.items():
        assert f"'{k}'].orValue('') == '{v}'" in text
    assert f"t.key == '{node_healer.TAINT_KEY}'" in text
    body = node_healer.placeholder("n")
    assert set(body["spec"]) == {"unschedulable", "taints"} and body["metadata"]["labels"] == node_healer.PLACEHOLDER_LABELS
    role = named(rendered["heal"], "ClusterRole", "ghost-guard-heal")
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["create", "delete"]} in role["rules"]


# --- rendering --------------------------------------------------------------

EXPECTED = {
    "base": {("Namespace", "", NAMESPACE), ("ServiceAccount", NAMESPACE, "ghost-guard"),
             ("ClusterRole", "", "ghost-guard"), ("ClusterRoleBinding", "", "ghost-guard"),
             ("Role", "default", "ghost-guard-apiserver-endpoints"), ("RoleBinding", "default", "ghost-guard-apiserver-endpoints"),
             ("Role", "kube-system", "ghost-guard-apiserver-leases"), ("RoleBinding", "kube-system", "ghost-guard-apiserver-leases"),
             ("Deployment", NAMESPACE, "ghost-guard"), ("PodDisruptionBudget", NAMESPACE, "ghost-guard"),
             ("Service", NAMESPACE, "ghost-guard"), ("NetworkPolicy", NAMESPACE, "ghost-guard"),
             ("ResourceQuota", NAMESPACE, "ghost-guard-critical-pods"),
             ("CustomResourceDefinition", "", "ghostpods.kube-ghost-guard.io"),
             ("CustomResourceDefinition", "", "ghostnodes.kube-ghost-guard.io"),
             ("ClusterRole", "", "ghost-guard-ghostpods-view")},
    "webhook": {("ValidatingWebhookConfiguration", "", "ghost-guard")},
    "monitoring": {("ServiceMonitor", NAMESPACE, "ghost-guard"), ("PrometheusRule", NAMESPACE, "ghost-guard")},
}
EXPECTED["rbac"] = {i for i in EXPECTED["base"] if i[0] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")}
EXPECTED["crd"] = {("CustomResourceDefinition", "", "ghostpods.kube-ghost-guard.io"),
                   ("CustomResourceDefinition", "", "ghostnodes.kube-ghost-guard.io")}
EXPECTED["overlays/deployment"] = EXPECTED["base"]
EXPECTED["overlays/deployment-webhook"] = EXPECTED["base"] | EXPECTED["webhook"]
EXPECTED["heal"] = {("ClusterRole", "", "ghost-guard-heal"), ("ClusterRoleBinding", "", "ghost-guard-heal"),
                    ("ValidatingAdmissionPolicy", "", "ghost-guard-heal"),
                    ("ValidatingAdmissionPolicyBinding", "", "ghost-guard-heal"),
                    ("ValidatingAdmissionPolicy", "", "ghost-guard-heal-nodes"),
                    ("ValidatingAdmissionPolicyBinding", "", "ghost-guard-heal-nodes")}
EXPECTED["overlays/deployment-heal"] = EXPECTED["base"] | EXPECTED["heal"]
EXPECTED["overlays/sidecar"] = EXPECTED["rbac"] | EXPECTED["crd"]


def test_every_kustomization_is_known():
    assert KUSTOMIZATIONS == sorted(EXPECTED)
    assert COMPONENTS == ["components/control-plane-cidr"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_expected_objects(rendered, kustomization):
    assert {ident(o) for o in rendered[kustomization]} == EXPECTED[kustomization]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed; the Python renderer alone was used")
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kubectl_kustomize_agrees(rendered, kustomization):
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS / kustomization)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=ident)
    assert real == sorted(rendered[kustomization], key=ident)


def every_object():
    params = [pytest.param(o, id=f"{k}:{o['kind']}/{o['metadata']['name']}") for k in KUSTOMIZATIONS for o in render(MANIFESTS / k)]
    params += [pytest.param(yaml.safe_load((MANIFESTS / f).read_text()), id=f"{f}:Pod/kube-scheduler") for f in NODE_PODS]
    return params


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("obj", every_object())
def test_schema_valid_strict(obj, version):
    if obj["kind"] in CRD_KINDS:
        pytest.skip(f"{obj['kind']} is a CRD (monitoring.coreos.com): checked structurally below")
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {e.message}")


def test_every_manifest_file_is_commented():
    files = sorted(MANIFESTS.rglob("*.yaml"))
    assert len(files) >= 20
    uncommented = [str(f.relative_to(MANIFESTS)) for f in files if not f.read_text().startswith("#")]
    assert uncommented == []


# --- RBAC: exactly these permissions ------------------------------------------

EXPECTED_RULES = {
    # (namespace or "*" for cluster-wide, apiGroup, resource, verb)
    ("*", "", "pods", "get"), ("*", "", "pods", "list"), ("*", "", "pods", "watch"),
    ("*", "", "events", "create"), ("*", "", "events", "get"), ("*", "", "events", "patch"),
    ("*", "", "nodes", "get"), ("*", "", "nodes", "list"), ("*", "", "nodes", "watch"),  # ghost Nodes
    ("default", "", "endpoints", "get"),
    ("default", "discovery.k8s.io", "endpointslices", "list"),
    ("kube-system", "coordination.k8s.io", "leases", "list"),
    # the GhostPod audit records (--audit-store kubernetes, guard/audit/ghostpods.py)
    ("*", "kube-ghost-guard.io", "ghostpods", "create"), ("*", "kube-ghost-guard.io", "ghostpods", "get"),
    ("*", "kube-ghost-guard.io", "ghostpods", "list"), ("*", "kube-ghost-guard.io", "ghostpods", "delete"),
    ("*", "kube-ghost-guard.io", "ghostpods/status", "patch"),
    # the GhostNode audit records (cluster-scoped; the same writes)
    ("*", "kube-ghost-guard.io", "ghostnodes", "create"), ("*", "kube-ghost-guard.io", "ghostnodes", "get"),
    ("*", "kube-ghost-guard.io", "ghostnodes", "list"), ("*", "kube-ghost-guard.io", "ghostnodes", "delete"),
    ("*", "kube-ghost-guard.io", "ghostnodes/status", "patch"),
}
VIEW_ROLE = "ghost-guard-ghostpods-view"  # for people, aggregated to `view`; bound to nobody here


def granted(objs: list[dict]) -> set[tuple[str, str, str, str]]:
    out = set()
    for role in by_kind(objs, "ClusterRole") + by_kind(objs, "Role"):
        if role["metadata"]["name"] == VIEW_ROLE:
            continue
        scope = role["metadata"].get("namespace", "*")
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/nonResourceURLs surprises
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert "*" not in (g, r, v), rule
                        out.add((scope, g, r, v))
    return out


@pytest.mark.parametrize("kustomization", ["base", "overlays/sidecar"])
def test_rbac_exact(rendered, kustomization):
    assert granted(rendered[kustomization]) == EXPECTED_RULES


HEAL_RULES = {("*", "", "pods", "create"), ("*", "", "pods", "delete"), ("*", "", "pods", "patch"),
              ("*", "", "nodes", "create"), ("*", "", "nodes", "delete")}  # nodes: heal node/NAME (ghost Nodes)


@pytest.mark.parametrize("kustomization", ["rbac", "base", "overlays/deployment", "overlays/deployment-webhook",
                                           "overlays/sidecar"])
def test_no_default_install_can_write_pods(rendered, kustomization):
    """Writing pods (the heal) is opt-in: only manifests/heal grants it."""
    assert not {r for r in granted(rendered[kustomization]) if r[2] == "pods" and r[3] not in ("get", "list", "watch")}


def test_the_heal_overlay_adds_exactly_the_pod_and_node_writes_and_turns_heal_on(rendered):
    assert granted(rendered["heal"]) == HEAL_RULES
    assert granted(rendered["overlays/deployment-heal"]) == EXPECTED_RULES | HEAL_RULES
    (binding,) = [b for b in by_kind(rendered["heal"], "ClusterRoleBinding")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ghost-guard", "namespace": NAMESPACE}]
    (container,) = one(rendered["overlays/deployment-heal"], "Deployment")["spec"]["template"]["spec"]["containers"]
    assert args_to_settings(container["args"]).heal is True
    (default,) = one(rendered["base"], "Deployment")["spec"]["template"]["spec"]["containers"]
    assert args_to_settings(default["args"]).heal is False


def test_heal_admission_policy_names_what_heal_writes(rendered):
    """The ValidatingAdmissionPolicy (manifests/heal) spells the placeholder the code makes, the one annotation it
    patches, and the identities heal runs as; it ships with the heal overlay. Its behaviour is tested on a real
    apiserver (tests/real/test_manifests_real.py)."""
    from guard.core import heal_plan

    for k in ("heal", "overlays/deployment-heal"):
        policy, binding = named(rendered[k], "ValidatingAdmissionPolicy", "ghost-guard-heal"), \
            named(rendered[k], "ValidatingAdmissionPolicyBinding", "ghost-guard-heal")
        assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/*"] and {"CREATE", "UPDATE", "DELETE"} <= set(rule["operations"])
    (cond,) = spec["matchConditions"]
    sa = one(rendered["base"], "ServiceAccount")["metadata"]
    assert f"'system:serviceaccount:{sa['namespace']}:{sa['name']}'" in cond["expression"]
    assert f"'{SIDECAR_USER}'" in cond["expression"]
    text = yaml.safe_dump(spec)
    body = heal_plan.placeholder_pod("n", ["u"], at="t")
    assert f"'{heal_plan.PLACEHOLDER_IMAGE}'" in text and f"'{heal_plan.PLACEHOLDER_GATE}'" in text
    assert f"'{heal_plan.HEAL_ANNOTATION}'" in text
    for key, value in body["metadata"]["labels"].items():
        assert f"'{key}'" in text, key
        if key != heal_plan.GHOST_UID_KEY:
            assert f"'{value}'" in text, value
    assert [c["name"] for c in body["spec"]["containers"]] == ["placeholder"] and "c.name == 'placeholder'" in text


@pytest.mark.parametrize("kustomization,subject", [
    ("base", {"kind": "ServiceAccount", "name": "ghost-guard", "namespace": NAMESPACE}),
    ("overlays/sidecar", {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": SIDECAR_USER}),
], ids=["deployment-serviceaccount", "sidecar-own-user"])
def test_bindings_bind_each_role_to_the_guard(rendered, kustomization, subject):
    objs = rendered[kustomization]
    roles = {(o["kind"], o["metadata"].get("namespace", "")) + (o["metadata"]["name"],) for o in objs
             if o["kind"] in ("Role", "ClusterRole") and o["metadata"]["name"] != VIEW_ROLE}
    bound = set()
    for b in by_kind(objs, "ClusterRoleBinding") + by_kind(objs, "RoleBinding"):
        assert b["subjects"] == [subject]
        ns = b["metadata"].get("namespace", "") if b["roleRef"]["kind"] == "Role" else ""
        bound.add((b["roleRef"]["kind"], ns, b["roleRef"]["name"]))
    assert bound == roles


# --- the Deployment and its neighbours -----------------------------------------


def args_to_settings(args: list[str]) -> Settings:
    """``serve --flag=value ...`` -> Settings, so the guard's own validation judges the manifest's flags."""
    assert args[0] == "serve", args
    kwargs: dict[str, object] = {}
    for arg in args[1:]:
        assert arg.startswith("--"), arg
        flag, eq, value = arg[2:].partition("=")
        kwargs[flag.replace("-", "_")] = value if eq else True
    return Settings(**kwargs).validate()


@pytest.fixture(scope="module")
def base(rendered) -> list[dict]:
    return rendered["base"]


@pytest.fixture(scope="module")
def pod(base) -> dict:
    return one(base, "Deployment")["spec"]["template"]


def test_deployment_shape(base, pod):
    dep = one(base, "Deployment")
    spec = pod["spec"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["serviceAccountName"] == one(base, "ServiceAccount")["metadata"]["name"]
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 65532 and psc["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    csc = c["securityContext"]
    assert csc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                   "capabilities": {"drop": ["ALL"]}}
    assert set(c["resources"]["requests"]) == {"cpu", "memory"} and "memory" in c["resources"]["limits"]


def test_deployment_args_are_valid_guard_settings_and_files_are_mounted(pod):
    (c,) = pod["spec"]["containers"]
    s = args_to_settings(c["args"])
    assert (s.insecure_http, s.host_port()) == (False, ("0.0.0.0", 8443))
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    tls_dir = "/etc/ghost-guard/tls"
    assert {s.tls_cert, s.tls_key, s.client_ca} == {f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt"}
    assert volumes[mounts[tls_dir]]["secret"]["secretName"] == "ghost-guard-tls"
    assert volumes[mounts[tls_dir]]["secret"]["defaultMode"] == 0o440
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts["/var/lib/ghost-guard"]]
    env = {e["name"]: e["value"] for e in c["env"]}
    from guard.core.settings import DEFAULT_AUDIT_DB

    assert env["GHOST_GUARD_AUDIT_DB"] == DEFAULT_AUDIT_DB and DEFAULT_AUDIT_DB.startswith("/var/lib/ghost-guard/")
    # The probes call /healthz and /readyz: the monitoring role's certificate (guard.core.identity).
    assert {env["GHOST_GUARD_PROBE_CERT"], env["GHOST_GUARD_PROBE_KEY"]} == {f"{tls_dir}/monitoring.crt",
                                                                             f"{tls_dir}/monitoring.key"}
    assert (s.client_ca, s.monitoring_identities) == (f"{tls_dir}/ca.crt", "ghost-guard-monitoring")
    assert c["ports"] == [{"name": "https", "containerPort": 8443, "protocol": "TCP"}]


def test_deployment_probes_hit_healthz_and_readyz_over_https(pod):
    (c,) = pod["spec"]["containers"]
    live, ready = c["livenessProbe"]["exec"]["command"], c["readinessProbe"]["exec"]["command"]
    assert live[:2] == ["python", "-c"] and ready[:3] == live[:3]
    assert (live[3], ready[3]) == ("https://127.0.0.1:8443/healthz", "https://127.0.0.1:8443/readyz")


def test_pdb_service_networkpolicy_match_the_pods(base, pod):
    labels = pod["metadata"]["labels"]
    pdb, svc, np = one(base, "PodDisruptionBudget"), one(base, "Service"), one(base, "NetworkPolicy")
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]


ANY_SOURCE = [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]


def test_networkpolicy_admits_the_verbs_from_any_address_and_monitoring_to_the_metrics(base, pod):
    """As shipped, rule 1 admits any address (every overlay applies unchanged; the client certificate is what
    authenticates); the control-plane-cidr component narrows it (docs/INSTALL.md, step 3)."""
    np = one(base, "NetworkPolicy")
    (container,) = pod["spec"]["containers"]
    serving = {p["containerPort"] for p in container["ports"]}
    verbs, scrape = np["spec"]["ingress"]
    for rule in (verbs, scrape):
        assert rule["from"], "the component replaces /spec/ingress/0/from: it must be there"
        assert {(p["protocol"], p["port"]) for p in rule["ports"]} <= {("TCP", port) for port in serving}
    assert verbs["from"] == ANY_SOURCE
    assert verbs["ports"] == [{"protocol": "TCP", "port": args_to_settings(container["args"]).host_port()[1]}]
    # 2. metrics: only from the monitoring namespace (by the label every namespace carries)
    assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert len(scrape["ports"]) == 1


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_shipped_value_the_apiserver_checks_is_valid(rendered, kustomization):
    """What kubernetes-validate's schemas do not check and the apiserver does: every ipBlock CIDR (and its
    excepts) parses, and no placeholder is left for the installer (the REPLACE_WITH_CONTROL_PLANE_CIDR the
    apiserver refused, issue 24). Server-side, tests/real/test_manifests_real.py dry-runs every overlay."""
    for o in rendered[kustomization]:
        assert "REPLACE_WITH" not in yaml.safe_dump(o), ident(o)
        for node in _walk(o):
            if "ipBlock" in node:
                block = node["ipBlock"]
                for cidr in [block["cidr"], *block.get("except", [])]:
                    ipaddress.ip_network(cidr)  # strict: host bits set is an error, as in the apiserver


def install_site_overlay(directory: Path, base: str = "deployment") -> Path:
    """docs/INSTALL.md's own overlay (step 3: the two heredocs, with the monitoring-namespace patch appended),
    written under ``directory`` next to a ``manifests`` link to this checkout, as a platform engineer would."""
    install = (REPO / "docs/INSTALL.md").read_text()
    site = directory / "ghost-guard-site"
    site.mkdir()
    for name in ("kustomization.yaml", "control-plane.yaml"):
        m = re.search(rf"^    cat > ghost-guard-site/{name} <<'EOF'\n(.*?)^    EOF$", install, re.S | re.M)
        assert m, f"docs/INSTALL.md lost its site overlay's {name}"
        text = "\n".join(line.removeprefix("    ") for line in m.group(1).splitlines()) + "\n"
        if name == "kustomization.yaml":
            text = text.replace("overlays/deployment\n", f"overlays/{base}\n")
            extra = re.search(r"^    (patches:\n.*?)\n\n", install[install.index("If Prometheus runs in another namespace"):], re.M | re.S)
            assert extra, "docs/INSTALL.md lost the monitoring-namespace patch"
            text += "\n".join(line.removeprefix("    ") for line in extra.group(1).splitlines()) + "\n"
        (site / name).write_text(text)
    (directory / "manifests").symlink_to(MANIFESTS)
    return site


SITE_CIDR = "10.0.0.0/24"  # the example in docs/INSTALL.md


def test_install_site_overlay_sets_the_cidr(tmp_path):
    site = install_site_overlay(tmp_path)
    objs = render(site)
    assert {ident(o) for o in objs} == EXPECTED["overlays/deployment"]  # the local-config ConfigMap is not sent
    np = one(objs, "NetworkPolicy")
    kubernetes_validate.validate(np, K8S_VERSIONS[-1], strict=True)
    verbs, scrape = np["spec"]["ingress"]
    assert verbs["from"] == [{"ipBlock": {"cidr": SITE_CIDR}}]
    assert verbs["ports"] == one(render(MANIFESTS / "base"), "NetworkPolicy")["spec"]["ingress"][0]["ports"]
    assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "YOUR-MONITORING-NAMESPACE"}}}]
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(site)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=ident) == sorted(objs, key=ident)


def test_component_without_its_cidr_fails_to_build(tmp_path):
    """Forgetting the CIDR is a build error before anything reaches the cluster, never a half-applied install."""
    site = install_site_overlay(tmp_path)
    (site / "control-plane.yaml").unlink()
    k = yaml.safe_load((site / "kustomization.yaml").read_text())
    k["resources"].remove("control-plane.yaml")
    (site / "kustomization.yaml").write_text(yaml.safe_dump(k))
    with pytest.raises(AssertionError, match="nothing selected by ConfigMap/ghost-guard-control-plane"):
        render(site)
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(site)], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "nothing selected" in out.stderr


def test_critical_priority_quota_covers_the_rollout(base, pod):
    quota = one(base, "ResourceQuota")
    assert quota["spec"]["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": [pod["spec"]["priorityClassName"]]}]
    dep = one(base, "Deployment")
    assert int(quota["spec"]["hard"]["pods"]) >= dep["spec"]["replicas"] + dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"]


def test_everything_namespaced_lives_in_the_guard_namespace(base):
    for o in base:
        ns = o["metadata"].get("namespace")
        if o["kind"] in ("Role", "RoleBinding"):
            assert ns in ("default", "kube-system")
        elif o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert ns == NAMESPACE, ident(o)


# --- webhook ---------------------------------------------------------------------


def test_webhook(rendered):
    vwc = one(rendered["webhook"], "ValidatingWebhookConfiguration")
    (wh,) = vwc["webhooks"]
    assert wh["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                            "resources": ["pods/binding"], "scope": "Namespaced"}]
    assert (wh["failurePolicy"], wh["timeoutSeconds"], wh["sideEffects"], wh["admissionReviewVersions"]) == \
        ("Ignore", WEBHOOK_TIMEOUT_SECONDS, "NoneOnDryRun", ["v1"])
    assert wh["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]}]}
    svc = one(rendered["base"], "Service")
    assert wh["clientConfig"]["service"] == {"namespace": svc["metadata"]["namespace"], "name": svc["metadata"]["name"],
                                             "path": "/validate/binding", "port": svc["spec"]["ports"][0]["port"]}
    assert base64.b64decode(wh["clientConfig"]["caBundle"], validate=True) == b"CA_BUNDLE_PLACEHOLDER"


def test_apiserver_admission_files_agree():
    cfg = yaml.safe_load((MANIFESTS / "webhook/apiserver-admission-config.yaml").read_text())
    assert (cfg["apiVersion"], cfg["kind"]) == ("apiserver.config.k8s.io/v1", "AdmissionConfiguration")
    (plugin,) = cfg["plugins"]
    assert plugin["name"] == "ValidatingAdmissionWebhook"
    assert plugin["configuration"]["kind"] == "WebhookAdmissionConfiguration"
    assert plugin["configuration"]["kubeConfigFile"] == "/etc/kubernetes/ghost-guard/webhook-kubeconfig.yaml"
    kc = yaml.safe_load((MANIFESTS / "webhook/apiserver-webhook-kubeconfig.yaml").read_text())
    (user,) = kc["users"]
    assert user["name"] == f"ghost-guard.{NAMESPACE}.svc"  # the Service's DNS name, port 443 omitted
    # kube-apiserver's own certificate: /validate/binding answers only the apiserver role (guard.core.identity).
    assert user["user"] == {"client-certificate": "/etc/kubernetes/ghost-guard/apiserver.crt",
                            "client-key": "/etc/kubernetes/ghost-guard/apiserver.key"}
    from guard.tools.certs import APISERVER_COMMON_NAME
    from guard.core.settings import Settings

    assert APISERVER_COMMON_NAME in Settings().apiserver_identities.split(",")


# --- kube-scheduler registration (extenders[] keys, pkg/scheduler/extender.go) ------

EXTENDER_KEYS = {"urlPrefix", "filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb", "weight", "enableHTTPS",
                 "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable"}
TLS_KEYS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert m, text
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


@pytest.mark.parametrize("path", SCHEDULER_CONFIGS, ids=["deployment", "sidecar"])
def test_scheduler_config_extender(path):
    cfg = yaml.safe_load((MANIFESTS / path).read_text())
    assert (cfg["apiVersion"], cfg["kind"]) == ("kubescheduler.config.k8s.io/v1", "KubeSchedulerConfiguration")
    assert cfg["clientConnection"] == {"kubeconfig": "/etc/kubernetes/scheduler.conf"}
    assert cfg["leaderElection"] == {"leaderElect": True}
    (ext,) = cfg["extenders"]
    assert set(ext) <= EXTENDER_KEYS, set(ext) - EXTENDER_KEYS
    assert (ext["filterVerb"], ext["preemptVerb"], ext["nodeCacheCapable"], ext["ignorable"]) == ("filter", "preempt", True, True)
    for absent in ("managedResources", "bindVerb", "prioritizeVerb", "weight"):
        assert absent not in ext, absent
    assert parse_duration(ext["httpTimeout"]) == SCHEDULER_HTTP_TIMEOUT > Settings().get_timeout
    if ext["enableHTTPS"]:
        assert set(ext["tlsConfig"]) <= TLS_KEYS, set(ext["tlsConfig"]) - TLS_KEYS
        assert ext["tlsConfig"]["caFile"], "with enableHTTPS and no CA the scheduler silently skips verification"
        assert ext["tlsConfig"]["serverName"] == f"ghost-guard.{NAMESPACE}.svc"
        assert ext["tlsConfig"].get("insecure") is not True
        assert ext["urlPrefix"] == "https://GHOST_GUARD_SERVICE_IP:443"
    else:
        assert "tlsConfig" not in ext
        assert ext["urlPrefix"] == "http://127.0.0.1:8443"


def static_pod(path: str) -> dict:
    return yaml.safe_load((MANIFESTS / path).read_text())


@pytest.mark.parametrize("pod_path,config_path", list(zip(NODE_PODS, SCHEDULER_CONFIGS)), ids=["deployment", "sidecar"])
def test_static_pod_mounts_what_the_scheduler_config_names(pod_path, config_path):
    p = static_pod(pod_path)
    sched = next(c for c in p["spec"]["containers"] if c["name"] == "kube-scheduler")
    assert "--config=/etc/kubernetes/ghost-guard/scheduler-config.yaml" in sched["command"]
    assert not any(a.startswith("--kubeconfig") for a in sched["command"])  # ignored with --config
    assert [a for a in sched["command"] if a.startswith("--leader-elect")] == ["--leader-elect=true"]
    mounts = {m["mountPath"]: m for m in sched["volumeMounts"]}
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    cfg = yaml.safe_load((MANIFESTS / config_path).read_text())
    (ext,) = cfg["extenders"]
    needed = ["/etc/kubernetes/ghost-guard/scheduler-config.yaml", cfg["clientConnection"]["kubeconfig"]]
    needed += [ext["tlsConfig"][k] for k in ("caFile", "certFile", "keyFile")] if ext["enableHTTPS"] else []
    for f in needed:
        mount = next((m for path, m in mounts.items() if f == path or f.startswith(path + "/")), None)
        assert mount is not None, f"{f} not mounted into kube-scheduler"
        assert mount["readOnly"] is True
        assert "hostPath" in volumes[mount["name"]]
    assert p["spec"]["hostNetwork"] is True


def test_sidecar_guard_container():
    p = static_pod("overlays/sidecar/node/kube-scheduler.yaml")
    (guard,) = [c for c in p["spec"]["containers"] if c["name"] == "ghost-guard"]
    s = args_to_settings(guard["args"])
    assert s.insecure_http and s.host_port() == ("127.0.0.1", 8443)  # loopback only
    assert "ports" not in guard  # nothing published beyond the node's loopback
    cfg = yaml.safe_load((MANIFESTS / "overlays/sidecar/node/scheduler-config.yaml").read_text())
    assert cfg["extenders"][0]["urlPrefix"] == f"http://{s.bind}"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = guard[probe]["httpGet"]
        assert (get["host"], get["port"], get["path"], get["scheme"]) == ("127.0.0.1", 8443, path, "HTTP")


def test_sidecar_runs_non_root_with_a_read_only_root():
    p = static_pod("overlays/sidecar/node/kube-scheduler.yaml")
    (guard,) = [c for c in p["spec"]["containers"] if c["name"] == "ghost-guard"]
    assert guard["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert p["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    dockerfile_user = re.search(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert dockerfile_user and tuple(map(int, dockerfile_user.groups())) == (65532, 65532)
    # under the read-only root, the audit store's directory and /tmp are volumes the guard may write
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in guard["volumeMounts"]}
    env = {e["name"]: e["value"] for e in guard["env"]}
    audit_dir = env["GHOST_GUARD_AUDIT_DB"].rsplit("/", 1)[0]
    for path in (audit_dir, "/tmp"):
        assert path in mounts and not mounts[path].get("readOnly"), path
        volume = volumes[mounts[path]["name"]]
        assert "emptyDir" in volume or volume["hostPath"]["type"] == "DirectoryOrCreate", volume
    assert mounts["/tmp"]["name"] != mounts[audit_dir]["name"]
    writable = {path for path, m in mounts.items() if not m.get("readOnly")}
    assert writable == {audit_dir, "/tmp"}


def test_sidecar_uses_its_own_kubeconfig_not_the_schedulers():
    p = static_pod("overlays/sidecar/node/kube-scheduler.yaml")
    (guard,) = [c for c in p["spec"]["containers"] if c["name"] == "ghost-guard"]
    (sched,) = [c for c in p["spec"]["containers"] if c["name"] == "kube-scheduler"]
    s = args_to_settings(guard["args"])
    cfg = yaml.safe_load((MANIFESTS / "overlays/sidecar/node/scheduler-config.yaml").read_text())
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    guard_mounts = {m["mountPath"]: m for m in guard["volumeMounts"]}
    sched_volumes = {m["name"] for m in sched["volumeMounts"]}
    kube_dir = s.kubeconfig.rsplit("/", 1)[0]
    assert s.kubeconfig != cfg["clientConnection"]["kubeconfig"]
    assert kube_dir in guard_mounts and guard_mounts[kube_dir]["readOnly"] is True
    guard_kube = volumes[guard_mounts[kube_dir]["name"]]["hostPath"]
    # a missing directory is created empty: the guard container fails, kube-scheduler still starts
    assert guard_kube["type"] == "DirectoryOrCreate"
    # no volume is shared: the guard cannot read the scheduler's credentials, nor the scheduler the guard's
    assert not {m["name"] for m in guard["volumeMounts"]} & sched_volumes
    host_paths = {volumes[n]["hostPath"]["path"] for n in sched_volumes if "hostPath" in volumes[n]}
    assert not any(guard_kube["path"] == h or guard_kube["path"].startswith(h + "/") for h in host_paths)
    install = (REPO / "docs/INSTALL.md").read_text()
    assert f"{guard_kube['path']}/kubeconfig" in install and f"/CN={SIDECAR_USER}" in install


# --- deadlines: the callers' timeouts and the guard's request budget agree ----------
#
# kube-scheduler waits httpTimeout for /filter and /preempt, the apiserver waits the
# webhook's timeoutSeconds for /validate/binding. The guard answers within its
# --request-budget (every quorum GET of --get-timeout included), and the budget must
# leave a margin: at most 60% of every caller's timeout.


def guard_containers() -> list[pytest.param]:
    """Every guard container the manifests run: the Deployment's and the sidecar's."""
    (dep,) = [d for d in yaml.safe_load_all((MANIFESTS / "base/deployment.yaml").read_text()) if d]
    (deployment,) = dep["spec"]["template"]["spec"]["containers"]
    sidecar = next(c for c in static_pod("overlays/sidecar/node/kube-scheduler.yaml")["spec"]["containers"]
                   if c["name"] == "ghost-guard")
    return [pytest.param(deployment, id="deployment"), pytest.param(sidecar, id="sidecar")]


def caller_timeouts() -> dict[str, float]:
    out = {}
    for path in SCHEDULER_CONFIGS:
        (ext,) = yaml.safe_load((MANIFESTS / path).read_text())["extenders"]
        out[f"{path} httpTimeout"] = parse_duration(ext["httpTimeout"])
    vwc = yaml.safe_load((MANIFESTS / "webhook/validatingwebhookconfiguration.yaml").read_text())
    for wh in vwc["webhooks"]:
        out[f"webhook {wh['name']} timeoutSeconds"] = float(wh["timeoutSeconds"])
    return out


def effective_deadlines(container: dict) -> tuple[float, float]:
    """(request_budget, get_timeout) the container runs with: its args, else its GHOST_GUARD_* env, else the default."""
    defaults = Settings()
    values = {"request-budget": defaults.request_budget, "get-timeout": defaults.get_timeout}
    for e in container.get("env", []):
        for flag in values:
            if e["name"] == "GHOST_GUARD_" + flag.upper().replace("-", "_"):
                values[flag] = float(e["value"])
    args = container.get("args", [])
    for i, arg in enumerate(args):
        for flag in values:
            if arg.startswith(f"--{flag}="):
                values[flag] = float(arg.split("=", 1)[1])
            elif arg == f"--{flag}":
                values[flag] = float(args[i + 1])
    return values["request-budget"], values["get-timeout"]


def test_callers_timeouts_are_the_guards_constants():
    timeouts = caller_timeouts()
    assert len(timeouts) == len(SCHEDULER_CONFIGS) + 1
    for where, seconds in timeouts.items():
        expected = WEBHOOK_TIMEOUT_SECONDS if where.startswith("webhook") else SCHEDULER_HTTP_TIMEOUT
        assert seconds == expected, f"{where} is {seconds:g}s; guard.core.settings says {expected:g}s"


def test_default_budget_fits_every_caller():
    s = Settings()
    for where, seconds in caller_timeouts().items():
        assert s.request_budget <= 0.6 * seconds, f"default --request-budget {s.request_budget:g}s vs {where} {seconds:g}s"
    assert s.get_timeout <= s.request_budget


def deadline_problems(container: dict) -> list[str]:
    budget, get_timeout = effective_deadlines(container)
    problems = [f"--request-budget {budget:g}s is over 60% of {where} ({seconds:g}s)"
                for where, seconds in caller_timeouts().items() if budget > 0.6 * seconds]
    if get_timeout > budget:
        problems.append(f"--get-timeout {get_timeout:g}s exceeds --request-budget {budget:g}s")
    return problems


@pytest.mark.parametrize("container", guard_containers())
def test_manifest_deadlines_fit_every_caller(container):
    assert deadline_problems(container) == []


@pytest.mark.parametrize("args,env,expected", [
    (["serve", "--request-budget=3.5"], [], (3.5, Settings().get_timeout)),
    (["serve", "--get-timeout", "2.5"], [], (Settings().request_budget, 2.5)),
    (["serve"], [{"name": "GHOST_GUARD_REQUEST_BUDGET", "value": "4"}], (4.0, Settings().get_timeout)),
], ids=["flag=value", "flag value", "env"])
def test_deadline_check_reads_flags_and_env(args, env, expected):
    """The check above can fail: each of these containers is refused."""
    container = {"args": args, "env": env}
    assert effective_deadlines(container) == expected
    assert deadline_problems(container) != []
    assert deadline_problems({"args": ["serve"]}) == []


# --- monitoring ------------------------------------------------------------------


def test_prometheus_rules_use_real_metrics(rendered):
    from prometheus_client import REGISTRY

    import guard.metrics  # noqa: F401  (registers the guard's metrics)

    exposed = {s.name for fam in REGISTRY.collect() for s in fam.samples} | {fam.name for fam in REGISTRY.collect()}
    rule = one(rendered["monitoring"], "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"GhostGuardGhostsBlocked", "GhostGuardStaleApiserverReplica", "GhostGuardFailingOpen",
                           "GhostGuardDown", "GhostGuardPodsMissingFromReplica", "GhostGuardApiserverReplicaFrozen",
                           "GhostGuardReplicaWatchDown", "GhostGuardAuditStoreUnwritable", "GhostGuardHealFailing",
                           "GhostGuardAuditRecordsDropped", "GhostGuardForgedGhosts"}
    used = set()
    for a in alerts.values():
        assert set(a) == {"alert", "expr", "for", "labels", "annotations"}
        assert a["labels"]["severity"] in ("warning", "critical")
        used |= set(re.findall(r"\bghost_guard_[a-z_]+", a["expr"] + a["annotations"]["description"]))
    assert used >= {"ghost_guard_verdicts_total", "ghost_guard_stale_replica", "ghost_guard_fail_open_total",
                    "ghost_guard_replica_pods_missing", "ghost_guard_replica_frozen", "ghost_guard_replica_watch_up",
                    "ghost_guard_audit_store_healthy"}
    families = {fam.name for fam in REGISTRY.collect()}
    for name in used:  # counters are registered without _total, exposed with it
        assert name in exposed or name.removesuffix("_total") in families, name
    ghosts = re.search(r'verdict=~"([^"]+)"', alerts["GhostGuardGhostsBlocked"]["expr"]).group(1).split("|")
    assert sorted(ghosts) == sorted(v.value for v in Verdict if v.value not in ("alive", "unknown"))
    assert 'job="ghost-guard"' in alerts["GhostGuardDown"]["expr"]


def test_servicemonitor_scrapes_with_the_monitoring_cert(rendered, base):
    sm = one(rendered["monitoring"], "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["scheme"], ep["path"]) == (one(base, "Service")["spec"]["ports"][0]["name"], "https", "/metrics")
    tls = ep["tlsConfig"]
    assert (tls["ca"]["secret"], tls["cert"]["secret"], tls["keySecret"]) == (
        {"name": "ghost-guard-tls", "key": "ca.crt"}, {"name": "ghost-guard-tls", "key": "monitoring.crt"},
        {"name": "ghost-guard-tls", "key": "monitoring.key"})
    assert sm["spec"]["selector"]["matchLabels"].items() <= one(base, "Service")["metadata"]["labels"].items()


# --- the GhostPod CRD and its RBAC (issue 14) --------------------------------------------------


@pytest.fixture(scope="module")
def crd(rendered) -> dict:
    return named(rendered["crd"], "CustomResourceDefinition", "ghostpods.kube-ghost-guard.io")


@pytest.fixture(scope="module")
def node_crd(rendered) -> dict:
    return named(rendered["crd"], "CustomResourceDefinition", "ghostnodes.kube-ghost-guard.io")


def test_ghostnode_crd_names_scope_and_columns_match_the_client_and_the_lab(node_crd):
    """GhostNode: cluster-scoped like Nodes, the group and version of GhostPod, the plural guard/kube/client.py
    calls, and the printer columns the lab serves (guard/lab/api.py)."""
    from guard.kube.writes import GHOSTNODE_PLURAL, GHOSTPOD_GROUP, GHOSTPOD_VERSION
    from guard.lab.api import resource_for

    spec = node_crd["spec"]
    assert node_crd["metadata"]["name"] == f"{GHOSTNODE_PLURAL}.{GHOSTPOD_GROUP}"
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        GHOSTPOD_GROUP, "Cluster", "GhostNode", GHOSTNODE_PLURAL)
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"], version["subresources"]) == (
        GHOSTPOD_VERSION, True, True, {"status": {}})
    columns = [(c["name"], c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    lab = resource_for(GHOSTPOD_GROUP, GHOSTPOD_VERSION, GHOSTNODE_PLURAL)
    assert lab is not None and lab.custom and not lab.namespaced and list(lab.printer_columns) == columns


def test_ghostnode_schema_holds_what_the_guard_writes(node_crd):
    """Every field the GhostNode writer puts in spec and status (guard/audit/ghostpods.py record_node and
    record_node_heal, through guard/core/ghostpod_mapping.py) is in the schema: a structural schema prunes the rest."""
    from guard.core.ghostpod_mapping import MAX_HEALS, MAX_REPLICAS, apply_ops, node_spec

    schema = node_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec, status = schema["spec"], schema["status"]["properties"]
    assert set(node_spec("node-a", "u", {})) == set(spec["properties"]) and set(spec["required"]) == {"nodeName", "nodeUID"}
    written = apply_ops({}, [
        {"op": "block", "counter": "timesDetected", "count": 1, "first": 1.0, "last": 2.0},
        {"op": "probe", "replica": "10.0.0.2:6443", "serves": True, "rv": None, "error": None, "at": 3.0},
        {"op": "probe", "replica": "10.0.0.2:6443", "serves": False, "rv": None, "error": None, "at": 4.0},
        {"op": "heal", "action": "placeholder", "outcome": "healed", "detail": "d", "at": 5.0},
    ])
    assert set(written) <= set(status), set(written) - set(status)
    assert "timesBlocked" not in written and written["timesDetected"] == 1
    assert status["replicas"]["maxItems"] == MAX_REPLICAS and status["heals"]["maxItems"] == MAX_HEALS
    assert set(written["replicas"][0]) <= set(status["replicas"]["items"]["properties"])


def test_ghostpod_crd_names_and_scope(crd):
    from guard.kube.writes import GHOSTPOD_GROUP, GHOSTPOD_PLURAL, GHOSTPOD_VERSION

    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{GHOSTPOD_PLURAL}.{GHOSTPOD_GROUP}"
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        GHOSTPOD_GROUP, "Namespaced", "GhostPod", GHOSTPOD_PLURAL)
    # The same domain as the webhook's name: the project's own.
    webhook = one(rendered_webhook := render(MANIFESTS / "webhook"), "ValidatingWebhookConfiguration")
    assert rendered_webhook and all(w["name"].endswith("." + GHOSTPOD_GROUP) for w in webhook["webhooks"])
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (GHOSTPOD_VERSION, True, True)
    assert version["subresources"] == {"status": {}}


def test_ghostpod_crd_printer_columns_match_the_lab(crd):
    """kubectl get ghostpods -A shows pod, verdict, stale replicas, times blocked, last seen, age; the lab serves
    the same columns (guard/lab/api.py)."""
    from guard.lab.api import resource_for

    columns = [(c["name"], c["type"], c["jsonPath"]) for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert [c[0] for c in columns] == ["Pod", "Verdict", "Stale Replicas", "Times Blocked", "Last Seen", "Age"]
    lab = resource_for("kube-ghost-guard.io", "v1alpha1", "ghostpods")
    assert lab is not None and lab.custom and list(lab.printer_columns) == columns


def test_ghostpod_schema_holds_what_the_guard_writes(crd):
    """Every field guard/audit/ghostpods.py writes is in the schema (structural schemas prune unknown fields),
    with the verdicts of guard/core/verdict.py and the store's bounds."""
    from guard.core.ghostpod_mapping import MAX_HEALS, MAX_REPLICAS, apply_ops

    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec, status = schema["spec"], schema["status"]["properties"]
    assert set(spec["required"]) == {"podName", "podUID", "verdict"}
    assert set(spec["properties"]["verdict"]["enum"]) == {v.value for v in Verdict}
    assert spec["properties"]["evidence"]["x-kubernetes-preserve-unknown-fields"] is True
    written = apply_ops({}, [
        {"op": "block", "count": 1, "first": 1.0, "last": 2.0},
        {"op": "probe", "replica": "10.0.0.2:6443", "serves": True, "rv": "5", "error": "x", "at": 3.0},
        {"op": "heal", "action": "restart", "outcome": "ok", "detail": "d", "at": 4.0},
        {"op": "retract", "at": 5.0},
    ])
    assert set(written) <= set(status), set(written) - set(status)
    assert status["replicas"]["maxItems"] == MAX_REPLICAS and status["heals"]["maxItems"] == MAX_HEALS
    replica_fields = {"replica", "serves", "cacheResourceVersion", "error", "lastChecked", "firstSeenServing", "healedAt"}
    assert set(status["replicas"]["items"]["properties"]) == replica_fields
    assert set(status["heals"]["items"]["properties"]) == {"at", "action", "outcome", "detail"}


def test_ghostpod_view_role_is_read_only_and_aggregated_to_view(rendered):
    for kustomization in ("base", "overlays/sidecar"):
        (role,) = [r for r in by_kind(rendered[kustomization], "ClusterRole") if r["metadata"]["name"] == VIEW_ROLE]
        assert role["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
        assert role["rules"] == [{"apiGroups": ["kube-ghost-guard.io"], "resources": ["ghostpods", "ghostnodes"],
                                  "verbs": ["get", "list", "watch"]}]
        bound = [b for b in by_kind(rendered[kustomization], "ClusterRoleBinding") + by_kind(rendered[kustomization], "RoleBinding")
                 if b["roleRef"]["name"] == VIEW_ROLE]
        assert bound == []


def test_the_manifests_record_to_kubernetes(pod):
    """Through the environment, so that `serve` and `ghost-guard audit|report` run in the container agree."""
    (container,) = pod["spec"]["containers"]
    sidecar = static_pod("overlays/sidecar/node/kube-scheduler.yaml")
    (guard,) = [c for c in sidecar["spec"]["containers"] if c["name"] != "kube-scheduler"]
    for c in (container, guard):
        assert {"name": "GHOST_GUARD_AUDIT_STORE", "value": "kubernetes"} in c["env"]
        assert not any(a.startswith("--audit-store") for a in c["args"])
