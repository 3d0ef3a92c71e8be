"""``ghost-guard diagnose NAMESPACE/NAME``: the incident write-up's checks in one go.

1. the quorum GET (no resourceVersion: etcd's answer through the apiserver);
2. each apiserver replica's watch cache (LIST ``resourceVersion=0``, one name), dialled directly;
3. optionally, etcd itself: ``/registry/pods/NS/NAME`` through etcd's JSON gateway
   (``POST /v3/kv/range``; Kubernetes stores protobuf there, so only presence and
   ``mod_revision`` are read).

A replica is *stale* when its cache serves a ghost (``guard.core.verdict.serves_ghost``, the
same rule the running guard's attribution uses): it lists, as a pod to schedule, the pod
etcd no longer has, another UID than etcd's, or the pod unbound/not terminating when etcd
has it bound/terminating. Rendering is in :mod:`guard.core.rendering`.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

import orjson
import urllib3

from guard.core.attribution import ReplicaObservation
from guard.kube.reads import Kube
from guard.kube.watch import ReplicaClient
from guard.core.rendering import render_diagnosis
from guard.core.verdict import ReadStatus, serves_ghost


@dataclass(frozen=True)
class EtcdAccess:
    endpoint: str  # https://IP:2379
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = "/registry"


def read_etcd(access: EtcdAccess, namespace: str, name: str, timeout: float = 3.0) -> str:
    key = f"{access.prefix.rstrip('/')}/pods/{namespace}/{name}".encode()
    http = urllib3.PoolManager(ca_certs=access.ca, cert_file=access.cert, key_file=access.key,
                               cert_reqs="CERT_REQUIRED" if access.ca else "CERT_NONE", retries=False)
    try:
        resp = http.request("POST", access.endpoint.rstrip("/") + "/v3/kv/range",
                            body=orjson.dumps({"key": base64.b64encode(key).decode(), "keys_only": True}),
                            headers={"Content-Type": "application/json"}, timeout=urllib3.Timeout(total=timeout))
    except urllib3.exceptions.HTTPError as e:
        return f"unreachable: {type(e).__name__}"
    if resp.status != 200:
        return f"HTTP {resp.status}"
    doc = orjson.loads(resp.data)
    kvs = doc.get("kvs") or []
    if not kvs:
        return f"absent (etcd revision {(doc.get('header') or {}).get('revision', '?')})"
    return f"present, mod_revision {kvs[0].get('mod_revision')}"


def diagnose(kube: Kube, replicas: list[ReplicaClient], namespace: str, name: str, *,
             etcd: EtcdAccess | None = None, output: str = "table") -> tuple[str, list[str]]:
    """Run the checks; return the rendered report and the stale replicas."""
    read = kube.quorum_get(namespace, name)
    if read.status is ReadStatus.FOUND:
        detail = f"found uid={read.uid} rv={read.resource_version}"
        if read.node_name:
            detail += f" nodeName={read.node_name}"
        if read.deletion_timestamp:
            detail += f" deletionTimestamp={read.deletion_timestamp}"
        status: int | None = 200
    elif read.status is ReadStatus.NOT_FOUND:
        status, detail = 404, "NotFound"
    else:
        status, detail = (read.http_status or None), read.error
    now = time.time()
    observations = []
    for client in replicas:
        items, rv, error = client.read_cache(namespace, name)
        if error or read.status is ReadStatus.ERROR:
            observations.append(ReplicaObservation(client.replica.address, None, rv, error or "quorum read failed", now))
        else:
            observations.append(ReplicaObservation(client.replica.address, serves_ghost(items, read), rv, None, now))
    etcd_detail = read_etcd(etcd, namespace, name) if etcd else None
    text = render_diagnosis(namespace=namespace, name=name, quorum_status=status, quorum_detail=detail,
                            observations=observations, etcd_detail=etcd_detail, output=output)
    return text, sorted(o.replica for o in observations if o.serves_ghost)
