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

from guard.settings import Settings, parse_identities

SCHEDULER, APISERVER, MONITORING = "scheduler", "apiserver", "monitoring"

#: The role an endpoint requires. Paths not listed (404s) need no particular role.
ROLE_OF_PATH = {
    "/filter": SCHEDULER,
    "/preempt": SCHEDULER,
    "/validate/binding": APISERVER,
    "/metrics": MONITORING,
    "/healthz": MONITORING,
    "/readyz": MONITORING,
}

_FLAG = {SCHEDULER: "--scheduler-identities", APISERVER: "--apiserver-identities",
         MONITORING: "--monitoring-identities"}


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
        """None when the certificate may call ``path``, else (required role, reason for the 403)."""
        role = ROLE_OF_PATH.get(path)
        if role is None:
            return None
        names = certificate_names(peer_cert)
        if any(name in self.identities[role] for name in names):
            return None
        shown = ", ".join(names[:4]) if names else "no CN or DNS name"
        return role, (f"client certificate ({shown}) is not allowed to call {path}: it needs {'an' if role[:1] in 'aeiou' else 'a'} {role} identity "
                      f"({_FLAG[role]})")
