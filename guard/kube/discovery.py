"""The live apiserver replicas: the ``default/kubernetes`` EndpointSlices (else its Endpoints), joined
with the kube-apiserver identity Leases (through the ``kubernetes`` client or its light twin)."""

from __future__ import annotations

import logging

import orjson

from guard.core.settings import Replica
from guard.kube.api import ApiError
from guard.kube.reads import Kube

log = logging.getLogger("guard.kube")

IDENTITY_LABEL = "apiserver.kubernetes.io/identity=kube-apiserver"
PEER_ADDRESS_ANNOTATION = "kubernetes.io/peer-advertise-address"


def _endpoint_slice_replicas(doc: dict) -> list[tuple[str, int]]:
    out = []
    for sl in doc.get("items") or []:
        ports = [p.get("port") for p in sl.get("ports") or [] if p.get("name") in ("https", None, "")]
        port = ports[0] if ports else None
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or []:
                out.append((addr, port))
    return out


def _endpoints_replicas(doc: dict) -> list[tuple[str, int]]:
    out = []
    for subset in doc.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or [] if p.get("name") in ("https", None, "")]
        if not ports:
            continue
        for addr in subset.get("addresses") or []:
            out.append((addr.get("ip"), ports[0]))
    return out


def _lease_identities(doc: dict) -> dict[str, str]:
    """Identity Leases whose peer-advertise-address annotation names an address -> lease name."""
    out = {}
    for lease in doc.get("items") or []:
        meta = lease.get("metadata") or {}
        addr = (meta.get("annotations") or {}).get(PEER_ADDRESS_ANNOTATION)
        if addr:
            out[addr] = meta.get("name", "")
            out[addr.rsplit(":", 1)[0]] = meta.get("name", "")
    return out


def discover_replicas(kube: Kube) -> list[Replica]:
    """The live apiserver replicas: ``default/kubernetes`` EndpointSlices, else its Endpoints.

    Joined with the identity Leases in ``kube-system`` where they can be matched
    (the peer-advertise-address annotation); unmatched replicas keep no identity.
    """
    addrs: list[tuple[str, int]] = []
    try:
        resp = kube.api.DiscoveryV1Api().list_namespaced_endpoint_slice(
            "default", label_selector="kubernetes.io/service-name=kubernetes", _preload_content=False,
            _request_timeout=kube.timeout * 2)
        addrs = _endpoint_slice_replicas(orjson.loads(resp.data))
    except ApiError as e:
        log.info("EndpointSlice discovery failed (HTTP %s); falling back to Endpoints", e.status)
    if not addrs:
        resp = kube.core.read_namespaced_endpoints("kubernetes", "default", _preload_content=False,
                                                   _request_timeout=kube.timeout * 2)
        addrs = _endpoints_replicas(orjson.loads(resp.data))
    identities: dict[str, str] = {}
    try:
        resp = kube.api.CoordinationV1Api().list_namespaced_lease(
            "kube-system", label_selector=IDENTITY_LABEL, _preload_content=False, _request_timeout=kube.timeout * 2)
        identities = _lease_identities(orjson.loads(resp.data))
    except ApiError as e:
        log.info("identity leases not readable (HTTP %s); replicas are named by address only", e.status)
    out = []
    for ip, port in sorted(set(addrs)):
        host = f"[{ip}]" if ":" in ip else ip
        address = f"{host}:{port}"
        out.append(Replica(address, f"https://{address}", identities.get(address) or identities.get(ip, "")))
    return out
