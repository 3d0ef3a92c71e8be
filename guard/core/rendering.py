"""Rendering for ``ghost-guard audit``, ``report`` and ``diagnose``, and the new-ghost log line.

Pure: no I/O and no clock. Records come in (:class:`guard.core.records.AuditRecord`,
whichever store read them), text goes out; ``now`` is passed in where needed.

Every cell that can hold upstream text (errors, evidence) is flattened to one
line with control and bidirectional characters escaped (guard.core.names.visible),
so a table cannot be broken or used to inject terminal escapes. Every command a
person may paste (``ghost-guard heal …``, ``ghost-guard diagnose …``) is built
by guard.core.names.shell_line: each argument passed through ``shlex.quote``; a pod whose name
holds control or bidirectional characters (no pod the apiserver accepts can) is
left out of the command and named, escaped, beside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final

from guard.core.attribution import (
    CONSISTENT,
    ERROR,
    NOT_READY,
    STALE,
    UNREACHABLE,
    ReplicaObservation,
    classify,
    latest,
    stale_replicas,
)
from guard.core.names import pastable, shell_line, visible
from guard.core.records import AuditRecord

OUTPUTS: Final = ("table", "json", "jsonl")
SCHEDULER_ISSUE: Final = "kubernetes#123072"

_DURATION = re.compile(r"^(\d{1,9})([smhdw])$")
_UNIT_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_CELL_MAX: Final = 120


# -- small pieces -------------------------------------------------------------


def format_time(ts: float | None) -> str:
    """``2026-11-29T19:16:49Z`` (UTC, whole seconds); ``-`` for ``None``."""
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_since(text: str, *, now: float) -> float:
    """The epoch time meant by ``--since``: a duration back from ``now`` (``90s``, ``30m``, ``1h``, ``2d``, ``1w``) or an ISO-8601 time.

    An ISO-8601 time without an offset is taken as UTC. Raises
    :class:`ValueError` with a one-line reason for anything else.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--since must be a duration like 30m, 1h, 2d or an ISO-8601 time")
    text = text.strip()
    m = _DURATION.match(text)
    if m:
        return max(0.0, now - int(m.group(1)) * _UNIT_SECONDS[m.group(2)])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp())


#: The fields of a record that the new-ghost line carries, in its order (those of ``record_to_dict``).
NEW_GHOST_FIELDS = ("namespace", "name", "uid", "verdict", "evidence", "first_seen")


def new_ghost_line(record: AuditRecord) -> str:
    """The one JSON line written to stdout for each *new* ghost, for log shippers (``guard.engine.incident``)."""
    full = record_to_dict(record)
    return json.dumps({"event": "ghost-blocked", **{k: full[k] for k in NEW_GHOST_FIELDS}},
                      sort_keys=False, separators=(",", ":"), allow_nan=False)


_WHITESPACE: Final = {ord(c): " " for c in "\t\n\v\f\r"}  # flattened to spaces; other hidden characters escaped


def _cell(value: object) -> str:
    text = "-" if value is None or value == "" else visible(str(value).translate(_WHITESPACE))
    text = "".join(c if c.isprintable() else " " for c in text)
    text = " ".join(text.split())
    if len(text) > _CELL_MAX:
        text = text[: _CELL_MAX - 3] + "..."
    return text


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "") -> list[str]:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(values: Sequence[str]) -> str:
        return (indent + "  ".join(v.ljust(widths[i]) for i, v in enumerate(values))).rstrip()

    return [line(headers)] + [line(row) for row in cells]


def _dumps(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=False, allow_nan=False)


def _check_output(output: str, allowed: Sequence[str] = OUTPUTS) -> None:
    if output not in allowed:
        raise ValueError(f"output must be one of {', '.join(allowed)}; not {output!r}")


# -- ghost-guard audit ------------------------------------------------------------


def record_to_dict(record: AuditRecord) -> dict[str, Any]:
    """The JSON shape of one record (``audit --output json|jsonl``); times are ISO-8601 UTC."""
    return {
        "namespace": record.namespace,
        "name": record.name,
        "uid": record.uid,
        "verdict": record.verdict,
        "evidence": dict(record.evidence),
        "first_seen": format_time(record.first_seen),
        "last_seen": format_time(record.last_seen),
        "times_blocked": record.times_blocked,
        "retracted_at": format_time(record.retracted_at) if record.retracted_at is not None else None,
        "stale_replicas": sorted(r.replica for r in record.replicas if r.stale),
        "heals": [{"at": format_time(h.at), "action": h.action, "outcome": h.outcome, "detail": h.detail}
                  for h in record.heals],
        "replicas": [
            {
                "replica": r.replica,
                "state": classify(r.observation()),
                "serves": r.serves,
                "cache_resource_version": r.cache_resource_version,
                "error": r.error,
                "last_checked": format_time(r.last_checked),
                "first_seen_serving": format_time(r.first_seen_serving) if r.first_seen_serving is not None else None,
                "healed_at": format_time(r.healed_at) if r.healed_at is not None else None,
            }
            for r in sorted(record.replicas, key=lambda r: r.replica)
        ],
    }


AUDIT_COLUMNS: Final = ("LAST SEEN", "NAMESPACE", "NAME", "VERDICT", "BLOCKED", "FIRST SEEN", "STALE REPLICAS", "UID")


def render_records(records: Sequence[AuditRecord], output: str = "table") -> str:
    """``ghost-guard audit`` output: an aligned table, a JSON array, or JSON lines (one record each)."""
    _check_output(output)
    if output == "json":
        return _dumps([record_to_dict(r) for r in records]) + "\n"
    if output == "jsonl":
        return "".join(json.dumps(record_to_dict(r), separators=(",", ":"), allow_nan=False) + "\n" for r in records)
    if not records:
        return "no audit records match\n"
    rows = [
        (
            format_time(r.last_seen),
            r.namespace,
            r.name,
            f"{r.verdict} (retracted)" if r.retracted_at is not None else r.verdict,
            r.times_blocked,
            format_time(r.first_seen),
            ",".join(sorted(s.replica for s in r.replicas if s.stale)) or "-",
            r.uid,
        )
        for r in records
    ]
    return "\n".join(_table(AUDIT_COLUMNS, rows) + _heal_lines(records)) + "\n"


HEAL_COLUMNS: Final = ("POD", "UID", "AT", "ACTION", "OUTCOME", "DETAIL")


def _heal_lines(records: Sequence[AuditRecord], indent: str = "  ") -> list[str]:
    """The heal attempts of these records (``serve --heal``), newest first; nothing when there are none."""
    rows = [(f"{r.namespace}/{r.name}", r.uid, h.at, h.action, h.outcome, h.detail)
            for r in records for h in r.heals]
    if not rows:
        return []
    rows.sort(key=lambda row: -row[2])
    return ["", "Heal attempts (ghost-guard serve --heal), newest first:"] + _table(
        HEAL_COLUMNS, [(p, u, format_time(at), a, o, d) for p, u, at, a, o, d in rows], indent=indent)


# -- ghost-guard report -------------------------------------------------------------


def build_report(records: Sequence[AuditRecord]) -> dict[str, Any]:
    """Per stale replica, the ghosts it serves and since when; healed replicas; unattributed ghosts; remediation.

    A replica is stale for a ghost when it was seen serving it and not seen
    healed since (a failed probe does not clear it). ``remediation`` is the
    ordered list of steps for an operator.
    """
    stale: dict[str, list[dict[str, Any]]] = {}
    healed_at: dict[str, float] = {}
    unattributed: list[dict[str, Any]] = []
    for record in records:
        serving = [s for s in record.replicas if s.stale]
        for s in serving:
            stale.setdefault(s.replica, []).append(
                {
                    "namespace": record.namespace,
                    "name": record.name,
                    "uid": record.uid,
                    "verdict": record.verdict,
                    "serving_since": s.first_seen_serving,
                    "last_checked": s.last_checked,
                    "last_result": classify(s.observation()),
                    "cache_resource_version": s.cache_resource_version,
                }
            )
        for s in record.replicas:
            if s.healed_at is not None:
                healed_at[s.replica] = max(healed_at.get(s.replica, 0.0), s.healed_at)
        if not serving:
            unattributed.append(
                {
                    "namespace": record.namespace,
                    "name": record.name,
                    "uid": record.uid,
                    "verdict": record.verdict,
                    "last_seen": record.last_seen,
                    "healed_replicas": sorted(s.replica for s in record.replicas if s.healed_at is not None),
                }
            )

    newest: dict[str, Any] = {}  # replica -> its newest probe over all records
    for record in records:
        for s in record.replicas:
            if s.replica not in newest or s.last_checked > newest[s.replica].last_checked:
                newest[s.replica] = s
    probes = [{"replica": r, "last_probe": classify(s.observation()), "last_checked": s.last_checked,
               "error": s.error} for r, s in sorted(newest.items())]

    replicas = []
    for replica in sorted(stale):
        ghosts = sorted(stale[replica], key=lambda g: (g["serving_since"], g["namespace"], g["name"]))
        replicas.append({"replica": replica, "since": ghosts[0]["serving_since"], "ghosts": ghosts})
    healed = [{"replica": r, "healed_at": t} for r, t in sorted(healed_at.items()) if r not in stale]
    return {
        "stale_replicas": replicas,
        "healed_replicas": healed,
        "unattributed_ghosts": unattributed,
        "replica_probes": probes,
        "remediation": remediation_steps(replicas, unattributed),
    }


def remediation_steps(replicas: Sequence[Mapping[str, Any]], unattributed: Sequence[Mapping[str, Any]]) -> list[str]:
    """The runbook, in order, for the stale replicas and the ghosts no replica is known to serve.

    ``ghost-guard heal`` first: a write under the ghost's name corrects every cache whose watch still
    flows, and kube-scheduler's informer with it; a restart only for a replica heal reports frozen."""
    pods, odd = _pastable_pods(f"{g['namespace']}/{g['name']}" for r in replicas for g in r["ghosts"])
    steps: list[str] = []
    if replicas:
        names = ", ".join(visible(str(r["replica"])) for r in replicas)
        steps.append(
            f"Heal without restarting anything: {_command('heal', pods)}{odd} (a placeholder created and deleted "
            "under a deleted ghost's name, or one annotation on the pod etcd has, replaces the stale copy in every "
            "watch cache that still follows etcd, and in kube-scheduler's informer with it; exit 0 when every replica "
            "agrees with etcd)."
        )
        steps.append(
            "Confirm no cache serves the ghost any more: "
            + "; ".join(_command("diagnose", [p]) for p in pods)
            + " (expect 'verdict: consistent')."
        )
        steps.append(
            f"Only if heal reports a replica frozen (its cache revision no longer moves; among {names}): restart that "
            "apiserver replica alone (its watch cache is rebuilt from etcd), run ghost-guard heal again, and restart "
            f"kube-scheduler only if it still tries to bind the ghost afterwards ({SCHEDULER_ISSUE})."
        )
    elif unattributed:
        others, odd = _pastable_pods(f"{g['namespace']}/{g['name']}" for g in unattributed)
        steps.append(
            "No replica is known to serve these ghosts now. Check: "
            + "; ".join(_command("diagnose", [p]) for p in others)
            + f"{odd}. If a replica serves one, heal it: {_command('heal', others)} (restart a replica only if heal "
            "reports it frozen)."
        )
        steps.append(
            "If the scheduler still tries to bind them, ghost-guard heal makes its informer drop them too; restart "
            f"kube-scheduler only if it still does afterwards ({SCHEDULER_ISSUE})."
        )
    return steps


def _pastable_pods(pods: Iterable[str]) -> tuple[list[str], str]:
    """The ``NS/NAME`` arguments that can go into a pasted command (sorted), and a note naming,
    escaped, those that cannot (control or bidirectional characters: no pod the apiserver accepts
    has them, so such a record came from a forged call; empty when there are none)."""
    unique = sorted(set(pods))
    ok = [p for p in unique if pastable(p)]
    left = [visible(p) for p in unique if not pastable(p)]
    note = (f" (left out of the commands, their names hold control or bidirectional characters no pod can have: "
            f"{', '.join(left)})") if left else ""
    return ok, note


def _command(verb: str, args: Sequence[str]) -> str:
    """``ghost-guard VERB ARGS…`` as one line to paste (guard.core.names.shell_line: every argument quoted)."""
    return shell_line(["ghost-guard", verb, *args])


def remediation_commands(replicas: Sequence[Mapping[str, Any]],
                         unattributed: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The commands :func:`remediation_steps` prints, as argv lists (what pasting one must run)."""
    if replicas:
        pods, _ = _pastable_pods(f"{g['namespace']}/{g['name']}" for r in replicas for g in r["ghosts"])
    elif unattributed:
        pods, _ = _pastable_pods(f"{g['namespace']}/{g['name']}" for g in unattributed)
    else:
        return []
    return [["ghost-guard", "heal", *pods]] + [["ghost-guard", "diagnose", p] for p in pods]


def render_report(records: Sequence[AuditRecord], output: str = "table") -> str:
    """``ghost-guard report`` output: per stale replica, its ghosts and since when; the newest cache probe of
    each replica (stale, consistent, not-ready, unreachable, error); then the remediation in order."""
    _check_output(output, ("table", "json"))
    report = build_report(records)
    if output == "json":
        return _dumps(_report_times(report)) + "\n"
    lines: list[str] = []
    if not report["stale_replicas"]:
        lines.append("No apiserver replica is known to serve a ghost.")
    for entry in report["stale_replicas"]:
        n = len(entry["ghosts"])
        lines.append(f"Replica {_cell(entry['replica'])} serves {n} ghost pod{'s' if n != 1 else ''} since {format_time(entry['since'])}")
        rows: list[Sequence[object]] = [
            (
                f"{g['namespace']}/{g['name']}",
                g["uid"],
                format_time(g["serving_since"]),
                format_time(g["last_checked"]),
                g["last_result"],
                g["cache_resource_version"],
            )
            for g in entry["ghosts"]
        ]
        lines += _table(("POD", "UID", "SERVING SINCE", "LAST CHECKED", "LAST PROBE", "CACHE RV"), rows, indent="  ")
        lines.append("")
    if report["healed_replicas"]:
        lines.append("Healed replicas (served a ghost, no longer do):")
        lines += _table(("REPLICA", "HEALED AT"), [(h["replica"], format_time(h["healed_at"])) for h in report["healed_replicas"]], indent="  ")
        lines.append("")
    if report["unattributed_ghosts"]:
        lines.append("Blocked ghosts no replica is known to serve now:")
        rows = [
            (f"{g['namespace']}/{g['name']}", g["uid"], g["verdict"], format_time(g["last_seen"]), ",".join(g["healed_replicas"]) or "-")
            for g in report["unattributed_ghosts"]
        ]
        lines += _table(("POD", "UID", "VERDICT", "LAST SEEN", "HEALED REPLICAS"), rows, indent="  ")
        lines.append("")
    heal_lines = _heal_lines(records)
    if heal_lines:
        lines += heal_lines[1:] + [""]
    if report["replica_probes"]:
        lines.append("Newest cache probe of each replica:")
        rows = [(p["replica"], p["last_probe"], format_time(p["last_checked"]), p["error"] or "-")
                for p in report["replica_probes"]]
        lines += _table(("REPLICA", "LAST PROBE", "AT", "ERROR"), rows, indent="  ")
        lines.append("")
    if report["remediation"]:
        lines.append("Remediation, in order:")
        lines += [f"  {i}. {step}" for i, step in enumerate(report["remediation"], 1)]
    elif report["stale_replicas"] == [] and not report["unattributed_ghosts"]:
        lines.append("Nothing to do.")
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def _report_times(report: dict[str, Any]) -> dict[str, Any]:
    out = dict(report)
    out["stale_replicas"] = [
        {
            "replica": r["replica"],
            "since": format_time(r["since"]),
            "ghosts": [{**g, "serving_since": format_time(g["serving_since"]), "last_checked": format_time(g["last_checked"])} for g in r["ghosts"]],
        }
        for r in report["stale_replicas"]
    ]
    out["healed_replicas"] = [{"replica": h["replica"], "healed_at": format_time(h["healed_at"])} for h in report["healed_replicas"]]
    out["unattributed_ghosts"] = [{**g, "last_seen": format_time(g["last_seen"])} for g in report["unattributed_ghosts"]]
    out["replica_probes"] = [{**p, "last_checked": format_time(p["last_checked"])} for p in report["replica_probes"]]
    return out


# -- ghost-guard diagnose ---------------------------------------------------------------


def diagnosis_verdict(observations: Iterable[ReplicaObservation]) -> str:
    """``consistent`` or ``stale replicas X, Y`` (newest observation per replica)."""
    stale = stale_replicas(observations)
    return f"stale replicas {', '.join(stale)}" if stale else "consistent"


def render_diagnosis(
    *,
    namespace: str,
    name: str,
    quorum_status: int | None,
    quorum_detail: str,
    observations: Sequence[ReplicaObservation],
    etcd_detail: str | None = None,
    output: str = "table",
) -> str:
    """``ghost-guard diagnose NS/NAME`` output: one row per source (source, served-by, result), then the verdict.

    ``quorum_status``/``quorum_detail``: the quorum GET's HTTP status (``None``
    if it got no answer) and a short text (``NotFound``, ``uid=… rv=…``, the
    error). ``observations``: one per replica, with ``serves_ghost`` set by the
    caller relative to the quorum answer (the cache returns the pod that etcd
    no longer has under that UID). ``etcd_detail``: the direct etcd read of
    ``/registry/pods/NS/NAME`` when it was done (``absent``, ``present rv=…``).

    The verdict line is ``verdict: consistent`` or ``verdict: stale replicas
    X, Y``; replicas whose probe failed are listed on an ``unchecked:`` line.
    """
    _check_output(output, ("table", "json"))
    rows: list[tuple[str, str, str]] = []
    quorum_result = f"{quorum_status} {quorum_detail}".strip() if quorum_status is not None else f"no answer: {quorum_detail}".strip()
    rows.append(("quorum GET", "etcd (no resourceVersion)", quorum_result))
    if etcd_detail is not None:
        rows.append(("etcd", f"/registry/pods/{namespace}/{name}", etcd_detail))
    newest = latest(observations)
    unchecked: list[tuple[str, str]] = []
    for replica in sorted(newest):
        obs = newest[replica]
        kind = classify(obs)
        rv = f" (list resourceVersion {obs.cache_resource_version})" if obs.cache_resource_version else ""
        if kind == STALE:
            result = f"serves the ghost{rv}"
        elif kind == CONSISTENT:
            result = f"does not serve it{rv}"
        else:
            label = {NOT_READY: "cache not ready", UNREACHABLE: "unreachable", ERROR: "error"}[kind]
            result = f"{label}: {obs.error}" if obs.error else label
            unchecked.append((replica, kind))
        rows.append(("watch cache", replica, result))
    verdict = diagnosis_verdict(observations)
    if output == "json":
        return _dumps(
            {
                "pod": f"{namespace}/{name}",
                "rows": [{"source": s, "served_by": b, "result": r} for s, b, r in rows],
                "verdict": verdict,
                "stale_replicas": stale_replicas(observations),
                "unchecked": [{"replica": r, "state": k} for r, k in unchecked],
                "next": heal_advice(namespace, name) if stale_replicas(observations) else None,
            }
        ) + "\n"
    lines = [f"Pod {_cell(namespace)}/{_cell(name)}"]
    lines += _table(("SOURCE", "SERVED-BY", "RESULT"), rows)
    lines.append(f"verdict: {verdict}")
    if unchecked:
        lines.append("unchecked: " + ", ".join(f"{_cell(r)} ({k})" for r, k in unchecked))
    if stale_replicas(observations):
        lines.append(f"next: {heal_advice(namespace, name)}")
    return "\n".join(lines) + "\n"


# --- report --live: replica caches checked now (guard.engine.cache_health.check_now) -----------------------


def render_replica_caches(caches: Sequence[Mapping[str, Any]], output: str = "table", *,
                          window: float = 5.0) -> str:
    """The ``report --live`` section: per replica, its cache revision against etcd's, frozen or not,
    and the pending pods it misses; then what to do. JSON: the list as given."""
    _check_output(output, ("table", "json"))
    if output == "json":
        return _dumps(list(caches)) + "\n"
    lines = [f"Replica caches, checked now (revisions read {window:g}s apart):"]
    rows = [(c["replica"], c["cache_revision"] if c["answered"] else "no answer", c["etcd_revision"],
             f"{c['seconds_behind']:g}s" if c["seconds_behind"] else "-", "yes" if c["frozen"] else "no",
             len(c["missing"]) if c["pending_listed"] else "no answer") for c in caches]
    lines += _table(("REPLICA", "CACHE RV", "ETCD RV", "BEHIND", "FROZEN", "PODS MISSING"), rows, indent="  ")
    missing = [(c["replica"], m) for c in caches for m in c["missing"]]
    if missing:
        lines += ["", "Pods pending in etcd that a replica's cache lacks (past their revision):"]
        lines += _table(("REPLICA", "POD", "UID", "POD RV", "CACHE RV"),
                        [(r, f"{m['namespace']}/{m['name']}", m["uid"], m["resource_version"], m["cache_resource_version"])
                         for r, m in missing], indent="  ")
    steps = []
    pods, odd = _pastable_pods(f"{m['namespace']}/{m['name']}" for _, m in missing)
    if pods or odd:
        steps.append(f"`{_command('heal', pods)}`{odd}: one write to each pod reaches every cache whose watch "
                     "flows")
    for c in caches:
        if c["frozen"]:
            steps.append(f"restart kube-apiserver {c['replica']}: its watch is frozen (writes cannot heal it), then "
                         "kube-scheduler if it read from that replica")
    lines.append("")
    if steps:
        lines.append("For the replica caches, in order:")
        lines += [f"  {i}. {step}" for i, step in enumerate(steps, 1)]
    elif all(c["answered"] and c["pending_listed"] for c in caches):
        lines.append("Every replica's cache keeps up with etcd and misses no pending pod.")
    else:
        lines.append("No replica cache problem found among the replicas that answered.")
    return "\n".join(lines) + "\n"
def heal_advice(namespace: str, name: str) -> str:
    """What ``diagnose`` recommends for a pod some replica serves stale."""
    pod = f"{namespace}/{name}"
    if not pastable(pod):
        return (f"no command: the name {visible(pod)} holds control or bidirectional characters no pod can have")
    return f"{_command('heal', [pod])} (no restart; restart a replica only if heal reports it frozen)"


def render_ghost_nodes(ghosts: Sequence[Mapping[str, Any]], errors: Sequence[str] = ()) -> str:
    """The ``report --live`` section on ghost Nodes: Nodes etcd lacks (quorum read) that a replica's cache
    serves, and what to do. Nothing at all when there is none and every check ran."""
    if not ghosts and not errors:
        return ""
    if not ghosts:
        lines = ["Ghost Nodes (deleted in etcd, served by a replica's cache): none found."]
    else:
        lines = ["Ghost Nodes (deleted in etcd by a quorum read, still served by a replica's cache; the guard "
                 "refuses them as candidates with --ghost-nodes):"]
        lines += _table(("NODE", "SERVED BY"), [(visible(str(g["node"])), ", ".join(map(str, g["replicas"])))
                                                for g in ghosts], indent="  ")
        lines += ["", "Remediation: restart the apiserver replica(s) named (their watch cache is rebuilt from "
                      "etcd); kube-scheduler drops the Node once the replica it reads no longer serves it."]
    for e in errors:
        lines.append(f"  (not checked: {visible(e)})")
    return "\n".join(lines) + "\n"
