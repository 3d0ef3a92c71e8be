"""The extender client: HTTPExtender of pkg/scheduler/extender.go (filter and preempt verbs)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import urllib3

from guard.lab.scheduler.config import ExtenderConfig, Obj, TLSConfig


class ExtenderError(Exception):
    """An extender call failed: transport error, non-200, bad JSON or a non-empty ``Error``."""


def _field(reply: Mapping[str, Any], name: str) -> Any:
    """Go's encoding/json matches keys case-insensitively."""
    if name in reply:
        return reply[name]
    lowered = name.lower()
    for key, value in reply.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


def _wire(obj: Obj) -> Obj:
    """An object as Go marshals an embedded one: TypeMeta left empty, so no apiVersion/kind."""
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    return out


class ExtenderClient:
    """HTTPExtender (pkg/scheduler/extender.go): POST urlPrefix/verb, JSON both ways."""

    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        self._tmpfiles: list[str] = []
        kwargs: dict[str, Any] = {}
        tls = config.tls_config or TLSConfig()
        if config.enable_https:
            has_ca = bool(tls.ca_file or tls.ca_data)
            if tls.insecure or not has_ca:  # makeTransport: no CA means Insecure
                kwargs["cert_reqs"] = "CERT_NONE"
                kwargs["assert_hostname"] = False
            else:
                kwargs["cert_reqs"] = "CERT_REQUIRED"
                if tls.ca_file:
                    kwargs["ca_certs"] = tls.ca_file
                else:
                    kwargs["ca_cert_data"] = tls.ca_data.decode()
                if tls.server_name:
                    kwargs["server_hostname"] = tls.server_name
                    kwargs["assert_hostname"] = tls.server_name
            cert = tls.cert_file or self._tmp(tls.cert_data)
            key = tls.key_file or self._tmp(tls.key_data)
            if cert:
                kwargs["cert_file"] = cert
                kwargs["key_file"] = key or None
        self._pool = urllib3.PoolManager(
            num_pools=2, maxsize=2, retries=False, timeout=urllib3.Timeout(total=config.http_timeout), **kwargs
        )

    def _tmp(self, data: bytes) -> str:
        if not data:
            return ""
        fd, path = tempfile.mkstemp(prefix="sched-ext-", suffix=".pem")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self._tmpfiles.append(path)
        return path

    def close(self) -> None:
        self._pool.clear()
        for path in self._tmpfiles:
            try:
                os.unlink(path)
            except OSError:
                pass

    def interested(self, pod: Obj) -> bool:
        """IsInterested: no managedResources means every pod."""
        managed = set(self.config.managed_resources)
        if not managed:
            return True
        spec = pod.get("spec") or {}
        for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
            resources = container.get("resources") or {}
            for part in ("requests", "limits"):
                if managed & set(resources.get(part) or {}):
                    return True
        return False

    def send(self, verb: str, args: Obj) -> Obj:
        url = self.config.url_prefix.rstrip("/") + "/" + verb
        try:
            resp = self._pool.request(
                "POST", url, body=json.dumps(args).encode(), headers={"Content-Type": "application/json"}
            )
        except urllib3.exceptions.HTTPError as e:
            raise ExtenderError(f"{verb} at {url}: {e}") from e
        if resp.status != 200:
            raise ExtenderError(f"failed {verb} with extender at URL {url}, code {resp.status}")
        try:
            reply = json.loads(resp.data)
        except ValueError as e:
            raise ExtenderError(f"{verb} at {url}: undecodable reply: {e}") from e
        if not isinstance(reply, dict):
            raise ExtenderError(f"{verb} at {url}: reply is not a JSON object")
        return reply

    def filter(self, pod: Obj, nodes: Sequence[Obj]) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """Filter: returns (passing node names, FailedNodes, FailedAndUnresolvableNodes)."""
        by_name = {n["metadata"]["name"]: n for n in nodes}
        if self.config.node_cache_capable:
            args = {"Pod": _wire(pod), "Nodes": None, "NodeNames": list(by_name)}
        else:
            args = {"Pod": _wire(pod), "Nodes": {"metadata": {}, "items": [_wire(n) for n in nodes]}, "NodeNames": None}
        reply = self.send(self.config.filter_verb, args)
        error = _field(reply, "Error")
        if error:
            raise ExtenderError(str(error))
        passed: list[str] = []
        names = _field(reply, "NodeNames")
        node_list = _field(reply, "Nodes")
        if self.config.node_cache_capable and names is not None:
            for name in names:
                if name not in by_name:
                    raise ExtenderError(
                        f"extender {self.config.url_prefix!r} claims a filtered node {name!r} "
                        "which is not found in the input node list"
                    )
                passed.append(name)
        elif node_list is not None:
            for item in _field(node_list, "items") or []:
                name = ((item or {}).get("metadata") or {}).get("name", "")
                if name not in by_name:
                    raise ExtenderError(f"extender returned node {name!r} which was not in the request")
                passed.append(name)
        failed = {str(k): str(v) for k, v in (_field(reply, "FailedNodes") or {}).items()}
        unresolvable = {str(k): str(v) for k, v in (_field(reply, "FailedAndUnresolvableNodes") or {}).items()}
        return passed, failed, unresolvable

    def process_preemption(
        self, pod: Obj, victims: Mapping[str, list[Obj]], pods_on_node: Mapping[str, Sequence[Obj]]
    ) -> dict[str, list[Obj] | None]:
        """ProcessPreemption: candidates in, the extender's candidates (as pods) out."""
        if self.config.node_cache_capable:
            args = {
                "Pod": _wire(pod),
                "NodeNameToVictims": None,
                "NodeNameToMetaVictims": {
                    node: {"Pods": [{"UID": p["metadata"].get("uid", "")} for p in pods], "NumPDBViolations": 0}
                    for node, pods in victims.items()
                },
            }
        else:
            args = {
                "Pod": _wire(pod),
                "NodeNameToVictims": {
                    node: {"Pods": [_wire(p) for p in pods], "NumPDBViolations": 0} for node, pods in victims.items()
                },
                "NodeNameToMetaVictims": None,
            }
        reply = self.send(self.config.preempt_verb, args)
        result: dict[str, list[Obj] | None] = {}
        for node, meta in (_field(reply, "NodeNameToMetaVictims") or {}).items():
            if node not in pods_on_node:
                raise ExtenderError(f"extender returned unknown node {node!r} for preemption")
            if meta is None:
                result[node] = None
                continue
            by_uid = {p["metadata"].get("uid"): p for p in pods_on_node[node]}
            chosen = []
            for meta_pod in _field(meta, "Pods") or []:
                uid = _field(meta_pod or {}, "UID")
                if uid not in by_uid:
                    raise ExtenderError(
                        f"extender claims to preempt pod (UID: {uid}) on node: {node}, but the pod is not found on that node"
                    )
                chosen.append(by_uid[uid])
            result[node] = chosen
        return result
