"""Who may call what: each endpoint belongs to one caller role, each role to client-certificate names.

Pure. With ``--client-ca`` every caller presents a certificate signed by the guard's
CA; that proves it is *a* caller, not *which*. The scheduler's certificate must not
be able to answer admission reviews, the apiserver's must not drive ``/filter``,
and a monitoring certificate (which Prometheus and the probes hold, and which is
copied around more freely) must reach nothing but ``/metrics`` and the probes.

A certificate's names are its subject common names and its DNS subject
alternative names, as ``ssl.SSLSocket.getpeercert()`` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guard.core.settings import Settings, parse_identities

SCHEDULER, APISERVER, MONITORING = "scheduler", "apiserver", "monitoring"

#: The role each route requires, by the route exactly as the app declares it. A path spelled any
#: other way (``//filter``, ``/%66ilter``, ``/./filter``, ``/FILTER``, ``/filter/``, ``/filter;x``) is
#: no route: guard.http.app answers it 404 before any role check or route runs (:func:`exact_route`).
ROLE_OF_PATH = {
    "/filter": SCHEDULER,
    "/preempt": SCHEDULER,
    "/validate/binding": APISERVER,
    "/metrics": MONITORING,
    "/healthz": MONITORING,
    "/readyz": MONITORING,
}

#: The role of each Flask endpoint (blueprint.view) that serves a route of ROLE_OF_PATH: the app checks
#: at start-up that its URL map routes each path of ROLE_OF_PATH to the endpoint named here, and
#: nothing else, so the role checked is the role of the view that runs.
ROLE_OF_ENDPOINT = {
    "extender.filter_nodes": SCHEDULER,
    "extender.preempt": SCHEDULER,
    "binding.validate_binding": APISERVER,
    "probes.prometheus": MONITORING,
    "probes.healthz": MONITORING,
    "probes.readyz": MONITORING,
}

_FLAG = {SCHEDULER: "--scheduler-identities", APISERVER: "--apiserver-identities",
         MONITORING: "--monitoring-identities"}


def exact_route(raw_target: str | None, script_name: str, path_info: str) -> str | None:
    """The route a request names, when it names one exactly, else None (the caller answers 404).

    ``raw_target`` is the request target as sent (WSGI ``RAW_URI``: path, then maybe ``?query``),
    ``path_info`` the server's decoded path. Exact means: the target's path is byte for byte one of
    ROLE_OF_PATH and the server decoded it to itself (no percent-encoding, no duplicate slash, dot
    segment, case, trailing slash, ``;`` parameter, NUL, fragment or absolute form), with no
    SCRIPT_NAME. A query string is allowed: it is no part of the route. Without a raw target (a
    server that gives none) the decoded path alone must be exact."""
    if script_name or path_info not in ROLE_OF_PATH:
        return None
    if raw_target is not None and raw_target.partition("?")[0] != path_info:
        return None
    return path_info


def certificate_names(peer_cert: dict[str, Any] | None) -> tuple[str, ...]:
    """The subject CNs, then the DNS SANs, of a certificate in ``getpeercert()`` form."""
    if not peer_cert:
        return ()
    names = [value for rdn in peer_cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    names += [value for kind, value in peer_cert.get("subjectAltName", ()) if kind == "DNS"]
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RolePolicy:
    """The certificate names allowed per role."""

    identities: dict[str, frozenset[str]]

    @classmethod
    def from_settings(cls, settings: Settings) -> RolePolicy:
        return cls({SCHEDULER: parse_identities(settings.scheduler_identities),
                    APISERVER: parse_identities(settings.apiserver_identities),
                    MONITORING: parse_identities(settings.monitoring_identities)})

    def refuse(self, path: str, peer_cert: dict[str, Any] | None) -> tuple[str, str] | None:
        """None when the certificate may call the route ``path``, else (required role, reason for the 403).

        ``path`` must be a route exactly (:func:`exact_route`); anything else is refused, whatever
        the certificate (the app answers such paths 404 before asking)."""
        role = ROLE_OF_PATH.get(path)
        if role is None:
            return "route", f"{path[:200]!r} is not a route of the guard"
        names = certificate_names(peer_cert)
        if any(name in self.identities[role] for name in names):
            return None
        shown = ", ".join(names[:4]) if names else "no CN or DNS name"
        return role, (f"client certificate ({shown}) is not allowed to call {path}: it needs {'an' if role[:1] in 'aeiou' else 'a'} {role} identity "
                      f"({_FLAG[role]})")
