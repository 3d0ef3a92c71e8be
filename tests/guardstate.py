"""What a running guard says it has seen, for tests that must wait for it (``from guardstate import ...``).

A test waits on the state it asserts about, never on a pause. These read the
guard's own answers: its ``/readyz`` detail (the per-replica views of unscheduled pods) and its audit
records (each ghost's probe rounds). ``/readyz`` reuses its answer for up to 2 s: poll, do not expect
the next read to move.
"""

from __future__ import annotations

from typing import Any


def view_pods(guard: Any) -> dict[str, int]:
    """Per replica address, how many unscheduled pods the guard's view of that replica holds."""
    replicas = guard.get("/readyz", timeout=5).json()["details"]["replicas"]
    return {address: ((v or {}).get("watch") or {}).get("pods") or 0 for address, v in replicas.items()}


def views_hold(guard: Any, count: int, *, replicas: int = 3) -> bool:
    """Whether the guard has a view of ``replicas`` replicas and each holds exactly ``count`` unscheduled
    pods: e.g. ``count=0`` once every view applied a pod's DELETE (its prepared verdict is dropped)."""
    pods = view_pods(guard)
    return len(pods) == replicas and all(n == count for n in pods.values())


def probes_done(records: list[dict], replicas: int = 3) -> bool:
    """Whether every (unretracted) audit record lists a probe of each of ``replicas`` replicas.

    The first probe round writes down each replica that does not serve the ghost; one that does is
    written down by the confirmation round (``--stale-confirm-delay`` later), whatever it then finds.
    So a record naming every replica is one whose rounds, confirmation included, are done: any blame
    would have been made by then."""
    return all(r.get("retracted_at") is not None or len(r.get("replicas") or ()) >= replicas for r in records)
