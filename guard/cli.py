"""The ``ghost-guard`` command line. Each command parses its arguments and delegates.

Every option has an environment variable ``GHOST_GUARD_<OPTION>`` (shown in
``--help``); precedence is flag, then environment, then default. The defaults of
``serve`` (and of the options other commands share with it) are the ``Settings``
fields' (guard/core/settings.py), never written here.
"""

from __future__ import annotations

import dataclasses
import sys

import click

from guard import __version__
from guard.core.names import pod_identity_problem, pod_name_problem, visible
from guard.core.settings import DEFAULT_AUDIT_DB, Settings

# The default of every `serve` option, and of the options other commands share with it: the Settings
# field's (guard/core/settings.py is the one place a default is written).
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}



def _check_pod_arg(namespace: str, name: str, hint: str) -> None:
    """A pod named on the command line is one the apiserver could hold (guard.core.names), else a usage error."""
    problem = pod_identity_problem(namespace, name, "")
    if problem is not None:
        raise click.BadParameter(problem, param_hint=hint)

def option(flag: str, **kwargs):
    """A long kebab-case option with its ``GHOST_GUARD_<FLAG>`` environment variable, shown in --help."""
    envvar = "GHOST_GUARD_" + flag.lstrip("-").split("/")[0].upper().replace("-", "_")
    kwargs.setdefault("show_envvar", True)
    return click.option(flag, envvar=envvar, **kwargs)


def setting(flag: str, **kwargs):
    """``option`` for the Settings field named like the flag (``--get-timeout`` -> ``get_timeout``,
    ``--prepare/--no-prepare`` -> ``prepare``), with the field's default."""
    return option(flag, default=DEFAULTS[flag.lstrip("-").split("/")[0].replace("-", "_")], **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="ghost-guard")
def main() -> None:
    """kube-ghost-guard: keeps kube-scheduler from looping forever on ghost Pods."""


# --- serve (guard/serving/server.py) -------------------------------------------------


@main.command(short_help="Serve the scheduler extender, probes and metrics.")
@setting("--bind", metavar="HOST:PORT", help="Address to listen on.")
@setting("--kubeconfig", type=click.Path(dir_okay=False),
         help="Cluster credentials. Default: in-cluster service account, then $KUBECONFIG / ~/.kube/config.")
@setting("--tls-cert", type=click.Path(dir_okay=False), help="Serving certificate (PEM). HTTPS is the default.")
@setting("--tls-key", type=click.Path(dir_okay=False), help="Serving private key (PEM).")
@setting("--client-ca", type=click.Path(dir_okay=False),
         help="Require client certificates signed by this CA (mTLS), and authorize each endpoint by the "
              "certificate's role (--scheduler-identities, --apiserver-identities, --monitoring-identities).")
@setting("--insecure-http", is_flag=True,
         help="Serve plain HTTP. Only for a loopback sidecar next to kube-scheduler (bind 127.0.0.1). "
              "No client identities are checked.")
@setting("--workers", type=int,
         help="gunicorn worker processes. Each has its own verdict cache; one worker with threads is recommended.")
@setting("--threads", type=int, help="Threads per worker (gthread); also the apiserver connection pool size.")
@setting("--get-timeout", type=float,
         help="Seconds allowed for one quorum GET; must stay below kube-scheduler's httpTimeout (5s).")
@setting("--request-budget", type=float,
         help="Seconds within which every /filter, /preempt and /validate/binding answer is ready (all quorum GETs "
              "and waits included); past it the pod passes (fails open; closed with --fail-closed), counted. "
              "At most 60% of the callers' timeouts (kube-scheduler httpTimeout 5s, webhook timeoutSeconds 5s).")
@setting("--ghost-ttl", type=float, help="Seconds a ghost verdict is remembered (by pod UID).")
@setting("--ghost-cache-size", type=int, help="Most ghost verdicts remembered.")
@setting("--alive-ttl", type=float,
         help="Seconds a quorum read is reused (bursts); below the scheduler's 1s initial backoff.")
@setting("--read-cache-size", type=int, help="Most quorum reads remembered at once.")
@setting("--fail-closed", is_flag=True,
         help="Reject a pod when the guard cannot decide (apiserver trouble). Default: fail open (pass it, counted).")
@setting("--max-body-bytes", type=int,
         help="Largest request body accepted (413 above). Names mode for 15,000 nodes is about 1 MB.")
@setting("--access-log/--no-access-log", help="One JSON line per request on stderr.")
@setting("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Log level.")
@setting("--apiserver-replicas", metavar="https://IP:PORT,...",
         help="Static list of apiserver replicas to probe and watch; replaces discovery from the "
              "default/kubernetes EndpointSlice entirely.")
@setting("--apiserver-server-name", help="TLS server name verified when dialling a replica by IP.")
@setting("--discovery-interval", type=float, help="Seconds between replica discoveries.")
@setting("--probe-timeout", type=float, help="Seconds allowed for one replica cache probe or LIST.")
@setting("--reprobe-interval", type=float,
         help="Least seconds between probe rounds for one ghost seen again (to see a replica heal).")
@setting("--stale-confirm-delay", type=float,
         help="Seconds before re-probing a replica that served a ghost; still serving then = stale (not lag).")
@setting("--audit-store", metavar="kubernetes|sqlite[:PATH]", show_default="sqlite (--audit-db)",
         help="Where blocked pods are recorded: `kubernetes` (GhostPod objects in the pod's namespace: shared by every "
              "guard replica, kept across rollouts, readable with kubectl; needs manifests/crd) or `sqlite:PATH` "
              "(an embedded file; `sqlite` alone means --audit-db).")
@setting("--audit-db", type=click.Path(dir_okay=False),
         help="SQLite audit store of blocked pods (shared by workers and CLI), with --audit-store sqlite.")
@click.option("--audit-retention", "--audit-max-age", "audit_max_age", type=float, default=DEFAULTS["audit_max_age"],
              envvar=["GHOST_GUARD_AUDIT_RETENTION", "GHOST_GUARD_AUDIT_MAX_AGE"], show_envvar=True,
              help="Seconds an audit record is kept after last seen (30 days). With --audit-store kubernetes every "
                   "guard replica deletes expired GhostPods, each delete conditional on the version it saw.")
@setting("--audit-max-records", type=int, help="Most audit records kept.")
@setting("--audit-write-qps", type=float,
         help="GhostPod writes per second at most, all records together (--audit-store kubernetes).")
@setting("--audit-write-interval", type=float,
         help="Seconds between two writes of one GhostPod by this guard (--audit-store kubernetes): a ghost the "
              "scheduler retries in a loop costs one write per interval, not one per attempt.")
@setting("--audit-queue-size", type=int,
         help="Records (pod identities) waiting to be written at most (--audit-store kubernetes), e.g. while the "
              "apiserver is unreachable; beyond, new ones are dropped and counted "
              "(ghost_guard_audit_records_dropped_total).")
@setting("--events/--no-events",
         help="Emit Events on the pods: GhostPodBlocked, StaleWatchCache and PodMissingFromReplica (Warning), "
              "GhostHealed (Normal) and GhostHealFailed (Warning) with --heal.")
@setting("--prepare/--no-prepare",
         help="Keep views of every replica's unscheduled pods, watch one while called, and verify new pods before "
              "kube-scheduler asks.")
@setting("--ghost-nodes/--no-ghost-nodes",
         help="Watch every replica's Node names (metadata only); a Node one replica serves and another does not is "
              "read once from etcd, and one etcd lacks (a ghost Node) is refused as a candidate in /filter "
              "(FailedAndUnresolvableNodes) and /preempt, never the whole pod.")
@setting("--prepared-max-age", type=float, help="Seconds a background-verified verdict stays usable.")
@setting("--prepared-grace", type=float,
         help="Seconds after a pod's first call during which its prepared verdict still answers.")
@setting("--verify-concurrency", type=int, help="Background quorum GETs in flight at most.")
@setting("--verify-qps", type=float,
         help="Background quorum GETs per second at most (one per new pod; bounds re-list storms).")
@setting("--sweep-interval", type=float,
         help="Seconds between sweeps comparing the replicas' views (finds ghosts no scheduler asked about; "
              "checked once a second, so at most one sweep a second). Each replica's cache is listed every "
              "min(3, this/2) seconds, less often for a large backlog (N pods: N/500 s).")
@setting("--prepare-idle-after", type=float,
         help="Verify new pods ahead only while scheduler calls (/filter, /preempt, /validate/binding) arrived within "
              "this many seconds: a guard replica nobody calls has no watch (it still lists every replica's cache) "
              "and makes no quorum GETs. The first call after that is answered inline, starts the watch and queues "
              "the pending pods the listings hold. 0: always verify ahead.")
@setting("--missing-after", type=float,
         help="Seconds a pending pod may be shown by other apiserver replicas but not by one before the guard checks "
              "whether that replica's cache misses it (quorum GET, then that cache read past the pod's revision).")
@setting("--frozen-after", type=float,
         help="Seconds a replica's cache revision may stand still behind etcd's before the replica is named frozen "
              "(revisions are read every third of this, at most every 20s).")
# --- serving: connection deadlines and limits, TLS, caller identities (guard/serving/connection.py, guard/core/identity.py)
@setting("--tls-handshake-timeout", type=float,
         help="Seconds a client has to complete the TLS handshake; then the connection is closed.")
@setting("--header-timeout", type=float,
         help="Seconds a client has to send the request line and headers (from the handshake, or the first byte "
              "of a kept-alive connection's next request).")
@setting("--body-timeout", type=float,
         help="Seconds a client has to send the request body (a larger body gets its length / --body-min-rate).")
@setting("--body-min-rate", type=int, metavar="BYTES_PER_SECOND",
         help="Slowest body upload accepted, in bytes per second (sets the body deadline of large bodies).")
@setting("--write-timeout", type=float,
         help="Seconds a client has to read the whole reply; a slower reader is cut off.")
@setting("--keepalive-timeout", type=float, help="Seconds an idle kept-alive connection stays open.")
@setting("--max-connections", type=int,
         help="Open connections per worker process; beyond it a 503 with the reason, then close.")
@setting("--max-connections-per-client", type=int,
         help="Open connections per client address (per worker process); beyond it a 503 with the reason.")
@setting("--max-buffered-bytes", type=int,
         help="Bytes of large requests (over 64 KiB) read, running or being answered at once, per worker; "
              "beyond it a 503 with the reason. At least --max-body-bytes.")
@setting("--tls-min-version", type=click.Choice(["1.2", "1.3"]),
         help="Oldest TLS version accepted. TLS 1.2 offers only ECDHE key exchange with AES-GCM or ChaCha20-Poly1305.")
@setting("--scheduler-identities", metavar="NAME,...",
         help="Client-certificate names (CN or DNS SAN) allowed to call /filter and /preempt. Checked only with "
              "--client-ca: without it (server-only TLS) and with --insecure-http there is no identity check.")
@setting("--apiserver-identities", metavar="NAME,...",
         help="Client-certificate names (CN or DNS SAN) allowed to call /validate/binding (with --client-ca only).")
@setting("--monitoring-identities", metavar="NAME,...",
         help="Client-certificate names (CN or DNS SAN) allowed to call /metrics, /healthz and /readyz "
              "(with --client-ca only).")
@setting("--max-nodes", type=int,
         help="Most nodes accepted in a /filter, in either mode (NodeNames, or Nodes.items: whole v1.Node "
              "objects); 413 with the reason above. A Kubernetes cluster has at most 5,000 nodes.")
@setting("--heal/--no-heal",
         help="Heal automatically: once a replica is confirmed to serve a ghost, write under its name as "
              "`ghost-guard heal` does (placeholder or one annotation), one heal at a time. Needs create, delete and "
              "patch on pods (the opt-in manifests/heal).")
@setting("--unsighted-ghost-rate", type=float,
         help="First sightings per second, per namespace, of ghosts no apiserver replica ever listed to this guard "
              "(a forged /filter for a pod that never existed, mostly) that get an audit record, a GhostPodBlocked "
              "Event and replica probes; all namespaces together get 10 times this. Beyond, they are still blocked "
              "but shed (ghost_guard_flood_shed_total) and asked again at their next call. Ghosts a replica listed or "
              "was seen serving are never budgeted.")
@setting("--unsighted-ghost-burst", type=int,
         help="Such first sightings at once, per namespace, before --unsighted-ghost-rate applies (10 times this "
              "for all namespaces together).")
@setting("--heal-rate", type=float, help="Automatic heals per second at most, on average (with --heal).")
@setting("--heal-burst", type=int, help="Automatic heals at once at most before --heal-rate applies.")
@setting("--heal-timeout", type=float, help="Seconds one automatic heal may take until every replica agrees with etcd.")
def serve(**kwargs) -> None:
    """Serve the extender (/filter, /preempt), probes and metrics under gunicorn."""
    from guard.serving.server import StartupError, preflight, serve as run
    from guard.core.settings import SettingsError

    try:
        settings = Settings(**kwargs).validate()
        preflight(settings)
    except (SettingsError, StartupError) as e:
        click.echo(f"ghost-guard serve: {e}", err=True)
        sys.exit(2)
    if settings.audit_db == DEFAULT_AUDIT_DB and settings.audit_store in (None, "sqlite"):
        from guard.audit.backend import writable_default

        path, note = writable_default(DEFAULT_AUDIT_DB)  # said once, here, before the workers start
        if note:
            click.echo(f"ghost-guard serve: audit store: {note}", err=True)
        settings = dataclasses.replace(settings, audit_db=path)
    sys.exit(run(settings))


# --- certs (guard/tools/certs.py) --------------------------------------------------


@main.command("certs", short_help="Write a CA, serving and client certificates.")
@click.option("--out", default="certs", type=click.Path(file_okay=False), envvar="GHOST_GUARD_OUT", show_envvar=True,
              help="Directory for ca.crt/ca.key, tls.crt/tls.key (serving) and one client certificate per role: "
                   "client.crt/client.key (kube-scheduler), apiserver.crt/apiserver.key (kube-apiserver, webhook), "
                   "monitoring.crt/monitoring.key (Prometheus, probes).")
@click.option("--namespace", default="ghost-guard", envvar="GHOST_GUARD_NAMESPACE", show_envvar=True,
              help="Namespace of the guard's Service (SANs <service>.<namespace>.svc[.cluster.local]).")
@click.option("--service", default="ghost-guard", envvar="GHOST_GUARD_SERVICE", show_envvar=True, help="Name of the guard's Service.")
@click.option("--dns", multiple=True, envvar="GHOST_GUARD_DNS", show_envvar=True,
              help="Extra DNS SAN, added to the Service names and localhost (repeatable).")
@click.option("--ip", "ips", multiple=True, envvar="GHOST_GUARD_IP", show_envvar=True,
              help="Extra IP SAN, added to 127.0.0.1 (repeatable).")
@click.option("--days", default=365, type=int, envvar="GHOST_GUARD_DAYS", show_envvar=True,
              help="Lifetime of the serving and client certificates.")
@click.option("--ca-days", default=3650, type=int, envvar="GHOST_GUARD_CA_DAYS", show_envvar=True, help="Lifetime of the CA.")
@click.option("--key-type", default="ecdsa-p256", type=click.Choice(["ecdsa-p256", "rsa-2048", "rsa-3072"]),
              envvar="GHOST_GUARD_KEY_TYPE", show_envvar=True, help="Key algorithm for all three keys.")
@click.option("--force", is_flag=True, envvar="GHOST_GUARD_FORCE", show_envvar=True,
              help="Replace existing files, CA included (every caBundle/caFile must then be updated).")
@click.option("--renew", is_flag=True, envvar="GHOST_GUARD_RENEW", show_envvar=True,
              help="Keep ca.crt/ca.key; reissue the serving and client certificates in place.")
def certs(out: str, namespace: str, service: str, dns: tuple[str, ...], ips: tuple[str, ...], days: int, ca_days: int,
          key_type: str, force: bool, renew: bool) -> None:
    """Write a CA, the guard's serving certificate and a client certificate per caller role.

    Prints the files written and, last, `caBundle: <base64 CA>` for the webhook configuration.
    """
    from guard.tools.certs import CertError, certs_command

    try:
        click.echo(certs_command(out, namespace=namespace, service=service, dns=dns, ips=ips, days=days,
                                 ca_days=ca_days, force=force, renew=renew, key_type=key_type))
    except CertError as e:
        raise click.ClickException(str(e)) from e


# --- audit, report, diagnose (guard/audit/sqlite.py, guard/core/attribution.py) ----------

# guard.core.verdict is pure and tiny (and on the serving path anyway): the --verdict
# choices come from it. The store itself (sqlite3) is imported inside the commands.
from guard.core.verdict import Verdict as _Verdict  # noqa: E402

def _audit_db_option(func):
    # Shared with `serve` through the environment: one GHOST_GUARD_AUDIT_DB / GHOST_GUARD_AUDIT_STORE for the
    # writer and the readers.
    func = click.option("--kubeconfig", default=None, envvar="GHOST_GUARD_KUBECONFIG", show_envvar=True,
                        type=click.Path(dir_okay=False),
                        help="Cluster credentials for --audit-store kubernetes. Default: in-cluster service "
                             "account, then $KUBECONFIG / ~/.kube/config.")(func)
    func = click.option("--audit-store", "store", default=None, envvar="GHOST_GUARD_AUDIT_STORE", show_envvar=True,
                        metavar="kubernetes|sqlite[:PATH]", show_default="sqlite (--db)",
                        help="The store to read: `kubernetes` (GhostPod objects, every namespace you may list; "
                             "from any machine with a kubeconfig) or `sqlite:PATH`.")(func)
    return click.option("--db", "--audit-db", "db", default=None, envvar="GHOST_GUARD_AUDIT_DB", show_envvar=True,
                        type=click.Path(), show_default=DEFAULT_AUDIT_DB, metavar="PATH",
                        help="The audit store (SQLite file) written by `ghost-guard serve`.")(func)


def _open_audit_store(command: str, db: str | None, store: str | None = None, kubeconfig: str | None = None):
    """The store to read (``--audit-store``, else the SQLite file ``db`` or the default); exit 2 with one
    line if it is missing or unusable."""
    import os

    from guard.audit.sqlite import AuditPathError, AuditStore
    from guard.audit.backend import StoreSpecError, open_store, parse_store
    from guard.core.records import AuditError

    from guard.audit.backend import readable_default

    try:
        kind, path = parse_store(store, db or readable_default(DEFAULT_AUDIT_DB))
    except StoreSpecError as e:
        raise click.BadParameter(str(e), param_hint="--audit-store") from e
    if kind == "kubernetes":
        try:
            return open_store("kubernetes", DEFAULT_AUDIT_DB, kubeconfig=kubeconfig,
                              max_age_seconds=Settings.audit_max_age, max_records=Settings.audit_max_records,
                              writer=False)
        except (AuditError, ValueError) as e:
            click.echo(f"ghost-guard {command}: {e}", err=True)
            sys.exit(2)
    assert path is not None
    if not os.path.exists(path):  # a dangling symlink too: reading never creates a store
        click.echo(f"ghost-guard {command}: no audit store at {path} (set --db or GHOST_GUARD_AUDIT_DB; "
                   "`ghost-guard serve` creates it when it starts)", err=True)
        sys.exit(2)
    try:
        return AuditStore(path)
    except AuditPathError as e:
        click.echo(f"ghost-guard {command}: {e}", err=True)
        sys.exit(2)


def _audit_records(command: str, store, *, namespace, verdict, replica, since, limit, retracted=False):
    import time

    from guard.core.records import AuditError
    from guard.core.rendering import parse_since

    try:
        since_at = parse_since(since, now=time.time()) if since is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from e
    try:
        return store.records(namespace=namespace, verdict=verdict, replica=replica, since=since_at, limit=limit,
                             retracted=retracted)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    except AuditError as e:
        click.echo(f"ghost-guard {command}: {e}", err=True)
        sys.exit(1)


def _node_records(command: str, store, *, since: str | None, limit: int | None, quiet: bool = True) -> list:
    """The ghost Node records (guard.core.records.NodeRecord). ``quiet``: a store that cannot list them (a cluster
    without the GhostNode CRD) has none; else that is exit 1, as for pods."""
    import time

    from guard.core.records import AuditError
    from guard.core.rendering import parse_since

    try:
        since_at = parse_since(since, now=time.time()) if since is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from e
    try:
        return store.node_records(since=since_at, limit=limit)
    except AuditError as e:
        if quiet:
            return []
        click.echo(f"ghost-guard {command}: {e}", err=True)
        sys.exit(1)


# Filters deliberately have no environment variable: a GHOST_GUARD_NAMESPACE set
# for the guard's own deployment must never silently filter an operator's query.
@main.group("audit", invoke_without_command=True, short_help="List the blocked ghost pods the audit store recorded.")
@_audit_db_option
@click.option("--namespace", default=None, help="Only ghosts in this namespace.")
@click.option("--verdict", default=None, type=click.Choice([v.value for v in _Verdict]), help="Only this verdict.")
@click.option("--replica", default=None, metavar="REPLICA",
              help="Only ghosts this apiserver replica was ever seen serving, named as `report` lists it "
                   "(10.0.0.2:6443), or a host alone for every port (10.0.0.2).")
@click.option("--since", default=None, metavar="WHEN",
              help="Only ghosts seen since then: a duration back from now (30m, 1h, 2d, 1w) or an ISO-8601 time (UTC if no offset).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="At most this many records (most recently seen first).")
@click.option("--retracted", is_flag=True, default=False,
              help="Also list records whose verdict the guard withdrew (etcd showed the pod pending after all).")
@click.option("--output", "-o", default="table", type=click.Choice(["table", "json", "jsonl"]), help="Output format.")
@click.option("--nodes", is_flag=True, default=False,
              help="List the ghost Nodes recorded instead (Nodes etcd lacks that a replica served; --since and "
                   "--limit apply).")
@click.pass_context
def audit(ctx: click.Context, db: str | None, store: str | None, kubeconfig: str | None, namespace: str | None,
          verdict: str | None, replica: str | None, since: str | None, limit: int | None, retracted: bool,
          output: str, nodes: bool) -> None:
    """List blocked ghost pods from the audit store, most recently seen first.

    `ghost-guard audit --nodes` lists the ghost Nodes recorded; `ghost-guard audit export` copies one store
    into another."""
    if ctx.invoked_subcommand is not None:
        return
    from guard.core.rendering import render_node_records, render_records

    if nodes:
        if namespace or verdict or replica or retracted:
            raise click.UsageError("--nodes takes --since and --limit only (Nodes have no namespace or verdict)")
        opened = _open_audit_store("audit", db, store, kubeconfig)
        try:
            node_records = _node_records("audit", opened, since=since, limit=limit, quiet=False)
        finally:
            opened.close()
        click.echo(render_node_records(node_records, output), nl=False)
        return

    host = _host_only(replica)
    if host is not None:
        from guard.core.records import MAX_REPLICA, check_text

        try:
            check_text("replica", replica, MAX_REPLICA)
        except ValueError as e:
            raise click.UsageError(str(e)) from e
    opened = _open_audit_store("audit", db, store, kubeconfig)
    try:
        records = _audit_records("audit", opened, namespace=namespace, verdict=verdict,
                                 replica=None if host else replica, since=since, limit=None if host else limit,
                                 retracted=retracted)
        n_nodes = len(_node_records("audit", opened, since=since, limit=None)) if output == "table" else 0
    finally:
        opened.close()
    if host:  # --replica HOST without the port: every port of that host
        records = [r for r in records if any(_host_of(s.replica) == host and s.first_seen_serving is not None
                                             for s in r.replicas)][:limit]
    if replica and not records:
        click.echo(f"ghost-guard audit: no ghost was ever seen served by replica {replica}; `ghost-guard report` "
                   "lists the replicas as the store names them (HOST:PORT, or HOST alone for every port)", err=True)
    click.echo(render_records(records, output), nl=False)
    if output == "table" and n_nodes:
        click.echo(f"\n{n_nodes} ghost Node record{'s' if n_nodes != 1 else ''}: ghost-guard audit --nodes")


def _host_of(replica: str) -> str:
    """The host of ``HOST:PORT`` / ``[V6]:PORT`` / ``https://HOST:PORT`` (the replica as the store names it)."""
    replica = replica.split("://", 1)[-1]
    if replica.startswith("["):
        return replica[1:].split("]", 1)[0]
    return replica.rsplit(":", 1)[0] if replica.count(":") == 1 else replica


def _host_only(replica: str | None) -> str | None:
    """The host when ``--replica`` names one without a port (``10.0.0.2``, ``[fd00::2]``, ``fd00::2``), else None."""
    if not replica:
        return None
    replica = replica.split("://", 1)[-1]
    if replica.startswith("["):
        return None if "]:" in replica else replica.strip("[]")
    return replica if replica.count(":") != 1 else None


@audit.command("export")
@click.option("--from", "source", required=True, metavar="sqlite:PATH", help="The store to copy from.")
@click.option("--to", "target", required=True, metavar="kubernetes", help="The store to copy into.")
@click.option("--kubeconfig", default=None, envvar="GHOST_GUARD_KUBECONFIG", show_envvar=True,
              type=click.Path(dir_okay=False), help="Cluster credentials for the kubernetes store.")
def audit_export(source: str, target: str, kubeconfig: str | None) -> None:
    """Copy every record (retracted ones too) from a SQLite store into GhostPod objects, and every ghost Node
    record into GhostNode objects.

    Safe to run again: an existing object is only widened (larger count, wider time span, newer probes),
    never counted twice. Prints how many objects were created and updated (a second line for ghost Nodes,
    when there are any); exit 1 if any record failed."""
    from guard.audit.backend import StoreSpecError, parse_store
    from guard.core.records import AuditError

    try:
        src_kind, _ = parse_store(source, DEFAULT_AUDIT_DB)
        dst_kind, _ = parse_store(target, DEFAULT_AUDIT_DB)
    except StoreSpecError as e:
        raise click.BadParameter(str(e)) from e
    if src_kind != "sqlite" or source.strip() == "sqlite" or dst_kind != "kubernetes":
        raise click.UsageError("export copies --from sqlite:PATH --to kubernetes")
    reader = _open_audit_store("audit export", None, source)
    writer = _open_audit_store("audit export", None, "kubernetes", kubeconfig)
    counts = {"pods": [0, 0, 0], "nodes": [0, 0, 0]}  # created, existing, failed

    def copy(kind: str, put, record) -> None:
        try:
            counts[kind][0 if put(record) else 1] += 1
        except AuditError as e:
            counts[kind][2] += 1
            click.echo(f"ghost-guard audit export: {e}", err=True)

    try:
        records = _audit_records("audit export", reader, namespace=None, verdict=None, replica=None, since=None,
                                 limit=None, retracted=True)
        node_records = _node_records("audit export", reader, since=None, limit=None, quiet=False)
        for record in records:
            copy("pods", writer.put, record)
        for node_record in node_records:
            copy("nodes", writer.put_node, node_record)
    finally:
        reader.close()
        writer.close()
    created, updated, failed = counts["pods"]
    click.echo(f"{len(records)} records read, {created} GhostPods created, {updated} existing, {failed} failed")
    if node_records:
        created, updated, failed = counts["nodes"]
        click.echo(f"{len(node_records)} ghost Node records read, {created} GhostNodes created, {updated} existing, "
                   f"{failed} failed")
    sys.exit(1 if counts["pods"][2] or counts["nodes"][2] else 0)


@main.command("report", short_help="Which replica serves which ghost, and what to do.")
@_audit_db_option
@click.option("--namespace", default=None, help="Only ghosts in this namespace.")
@click.option("--since", default=None, metavar="WHEN",
              help="Only ghosts seen since then: a duration back from now (30m, 1h, 2d, 1w) or an ISO-8601 time (UTC if no offset).")
@click.option("--output", "-o", default="table", type=click.Choice(["table", "json"]), help="Output format.")
@option("--live", is_flag=True, default=False,
        help="Also check every apiserver replica's cache now (about 10s): its revision against etcd's (frozen?), "
             "the pending pods it misses, and the ghost Nodes it serves (Nodes etcd lacks). Needs cluster "
             "credentials; works without an audit store.")
@option("--apiserver-replicas", default=None, metavar="https://IP:PORT,...",
        help="With --live: replicas to check; default: discovered from the default/kubernetes EndpointSlice.")
@setting("--apiserver-server-name", help="With --live: TLS server name verified when dialling a replica by IP.")
def report(db: str | None, store: str | None, kubeconfig: str | None, namespace: str | None, since: str | None,
           output: str, live: bool, apiserver_replicas: str | None, apiserver_server_name: str) -> None:
    """Per apiserver replica, the ghosts its watch cache serves and since when, then the remediation in order.

    The ghosts come from the audit store (what `serve` recorded; either store, as `audit`). With --live, a second section checks every
    replica's cache now: frozen watches, pods missing from a cache and ghost Nodes.

    Exit status (as diagnose and heal): 0 no replica serves a ghost (with --live: none frozen, none missing a pod,
    no ghost Node), 1 some replica does, 2 the report could not run (no store, bad arguments, no cluster access).
    """
    import os

    from guard.audit.backend import readable_default
    from guard.core.rendering import build_report, render_report

    db = db or readable_default(DEFAULT_AUDIT_DB)
    text, records, node_records = "", None, []
    if not (live and store is None and not os.path.exists(db)):
        opened = _open_audit_store("report", db, store, kubeconfig)
        try:
            records = _audit_records("report", opened, namespace=namespace, verdict=None, replica=None, since=since,
                                     limit=None)
            node_records = [] if namespace else _node_records("report", opened, since=since, limit=None)
        finally:
            opened.close()
        text = render_report(records, output)
        if node_records:  # ghost Nodes the guard recorded: a section (a key in JSON) only when there is one
            from guard.core.rendering import node_record_to_dict, render_node_report

            if output == "json":
                import json

                text = json.dumps({**json.loads(text), "ghost_node_records": [
                    node_record_to_dict(r) for r in node_records]}, indent=2) + "\n"
            else:
                text += "\n" + render_node_report(node_records)
    serving = records is not None and bool(build_report(records)["stale_replicas"])  # exit 1, as diagnose does
    serving = serving or any(r.stale_replicas for r in node_records)
    if not live:
        click.echo(text, nl=False)
        sys.exit(1 if serving else 0)
    progress = _progress("report", output)
    if output != "json":  # what is ready first: the audit store's part, then the replicas' caches
        from guard.engine.cache_health import LIVE_WINDOW_SECONDS

        if not text:
            text = f"No audit store at {db}: ghosts not reported.\n"
        click.echo(text + "\n", nl=False)
        sys.stdout.flush()
        progress(f"checking every apiserver replica's cache now (about {2 * LIVE_WINDOW_SECONDS:g}s)")
    caches, (ghost_nodes, node_errors) = _live_caches(kubeconfig, apiserver_replicas, apiserver_server_name, progress)
    if output == "json":
        import json

        doc = json.loads(text) if text else {"audit_store": None}
        doc["replica_caches"] = caches
        doc["ghost_nodes"] = ghost_nodes
        doc["ghost_node_errors"] = node_errors
        click.echo(json.dumps(doc, indent=2))
    else:
        from guard.core.rendering import render_ghost_nodes, render_replica_caches

        nodes_text = render_ghost_nodes(ghost_nodes, node_errors)
        click.echo(render_replica_caches(caches, window=LIVE_WINDOW_SECONDS) + ("\n" + nodes_text if nodes_text else ""),
                   nl=False)
    sys.exit(1 if serving or any(c["frozen"] or c["missing"] for c in caches) or ghost_nodes else 0)


def _progress(command: str, output: str):
    """What a long command is waiting for, one line per phase on stderr (quiet with -o json)."""
    if output == "json":
        return lambda line: None
    return lambda line: click.echo(f"ghost-guard {command}: {line}", err=True)


def _cluster(command: str, kubeconfig: str | None, apiserver_replicas: str | None, server_name: str,
             timeout: float, pool_size: int):
    """(Kube, ReplicaPool) for a command that reads every apiserver replica; exit 2 with one line when the
    credentials, the flags or replica discovery fail."""
    from guard.kube.config import KubeConfigError, load_cli_configuration
    from guard.kube.reads import Kube
    from guard.engine.replicas import ReplicaPool
    from guard.core.settings import SettingsError

    try:
        settings = Settings(apiserver_replicas=apiserver_replicas, apiserver_server_name=server_name,
                            probe_timeout=timeout, get_timeout=timeout)
        kube = Kube(load_cli_configuration(kubeconfig), timeout=timeout, pool_size=pool_size)
        pool = ReplicaPool(settings, kube)
    except (KubeConfigError, SettingsError) as e:
        click.echo(f"ghost-guard {command}: {e}", err=True)
        sys.exit(2)
    if not pool.clients():
        pool.close()
        kube.close()
        click.echo(f"ghost-guard {command}: no apiserver replica found (default/kubernetes EndpointSlice and "
                   "Endpoints unreadable); pass --apiserver-replicas", err=True)
        sys.exit(2)
    return kube, pool


def _live_caches(kubeconfig: str | None, apiserver_replicas: str | None, server_name: str,
                 progress=lambda line: None) -> tuple[list[dict], tuple[list[dict[str, object]], list[str]]]:
    """guard.engine.cache_health.check_now and guard.engine.ghost_nodes.check_nodes_now over every replica; exit 2 with
    one line when they cannot run."""
    progress("reading the cluster credentials and finding the apiserver replicas")
    from guard.engine.cache_health import check_now
    from guard.engine.ghost_nodes import check_nodes_now

    kube, pool = _cluster("report", kubeconfig, apiserver_replicas, server_name, 2.0, 8)
    try:
        clients = pool.clients()
        caches = check_now(kube, clients, progress=progress)
        progress("checking every replica's Nodes against etcd")
        return caches, check_nodes_now(kube, clients)
    finally:
        pool.close()
        kube.close()



@main.command("diagnose", short_help="Compare etcd with every apiserver replica's cache.")
@click.argument("pod", metavar="NAMESPACE/NAME")
@option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
        help="Cluster credentials. Default: in-cluster service account, then $KUBECONFIG / ~/.kube/config.")
@option("--apiserver-replicas", default=None, metavar="https://IP:PORT,...",
        help="Replicas to check; default: discovered from the default/kubernetes EndpointSlice.")
@setting("--apiserver-server-name", help="TLS server name verified when dialling a replica by IP.")
@option("--probe-timeout", type=float, default=2.0, help="Seconds allowed for each read.")
@click.option("--etcd-endpoint", default=None, metavar="https://IP:2379",
              help="Also read /registry/pods/NS/NAME from etcd directly (its JSON gateway).")
@click.option("--etcd-ca", type=click.Path(dir_okay=False, exists=True), default=None, help="etcd CA (PEM).")
@click.option("--etcd-cert", type=click.Path(dir_okay=False, exists=True), default=None, help="etcd client cert.")
@click.option("--etcd-key", type=click.Path(dir_okay=False, exists=True), default=None, help="etcd client key.")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", help="Output format.")
def diagnose(pod: str, kubeconfig: str | None, apiserver_replicas: str | None, apiserver_server_name: str,
             probe_timeout: float, etcd_endpoint: str | None, etcd_ca: str | None, etcd_cert: str | None,
             etcd_key: str | None, output: str) -> None:
    """Compare etcd's answer for a pod with every apiserver replica's watch cache.

    Runs the quorum GET, the cache read (resourceVersion=0) on every replica and, with
    --etcd-endpoint, a direct etcd read. Exit status: 0 consistent, 1 stale replicas
    found (named in the verdict line), 2 the checks could not run.
    """
    from guard.tools.diagnose import EtcdAccess, diagnose as run

    namespace, sep, name = pod.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise click.BadParameter("expected NAMESPACE/NAME", param_hint="POD")
    _check_pod_arg(namespace, name, "POD")
    kube, pool = _cluster("diagnose", kubeconfig, apiserver_replicas, apiserver_server_name, probe_timeout, 4)
    clients = pool.clients()
    etcd = EtcdAccess(etcd_endpoint, etcd_ca, etcd_cert, etcd_key) if etcd_endpoint else None
    try:
        text, stale = run(kube, clients, namespace, name, etcd=etcd, output=output)
    finally:
        pool.close()
        kube.close()
    click.echo(text, nl=False)
    sys.exit(1 if stale else 0)


@main.command("heal", short_help="Make every replica's cache agree with etcd (no restart).")
@click.argument("pods", nargs=-1, metavar="NAMESPACE/NAME|node/NAME...")
# --all has no environment variable on purpose: a variable set for something else must never widen a write.
@click.option("--all", "all_", is_flag=True, default=False,
              help="Heal every ghost the replicas serve: pods a replica's cache serves as pending under a UID etcd "
                   "does not have pending.")
@option("--dry-run", is_flag=True, default=False, help="Read and plan only; write nothing (exit 1 if a heal is needed).")
@option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
        help="Cluster credentials (they need create, delete and patch on pods). Default: in-cluster service "
             "account, then $KUBECONFIG / ~/.kube/config.")
@option("--apiserver-replicas", default=None, metavar="https://IP:PORT,...",
        help="Replicas to check; default: discovered from the default/kubernetes EndpointSlice.")
@setting("--apiserver-server-name", help="TLS server name verified when dialling a replica by IP.")
@option("--timeout", type=float, default=10.0,
        help="Seconds per pod, from the first read to the last check of every replica.")
@option("--probe-timeout", type=float, default=5.0,
        help="Seconds allowed for each read (a slower read counts that replica unreadable: not healed).")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", help="Output format.")
# No environment variable on purpose, as --all: recording is a write, asked for on the command line.
@click.option("--audit-store", "audit_store", default=None, metavar="kubernetes|sqlite:PATH",
              help="Record each node/NAME heal attempt on that ghost Node's records in this audit store (the one "
                   "`serve` writes); nothing is recorded without it.")
def heal(pods: tuple[str, ...], all_: bool, dry_run: bool, kubeconfig: str | None, apiserver_replicas: str | None,
         apiserver_server_name: str, timeout: float, probe_timeout: float, output: str,
         audit_store: str | None) -> None:
    """Make every apiserver replica's watch cache agree with etcd for these pods, restarting nothing.

    For each pod, re-verifies by a quorum GET, then: a deleted ghost gets a placeholder pod under its name
    (scheduling-gated, never run) created and deleted at once (UID precondition); a replaced, bound or
    terminating ghost gets one annotation on the live pod (resourceVersion precondition). Either write
    replaces the stale copy in every cache whose watch still flows. A pod etcd has pending that every
    replica serves is never touched. A frozen replica (its cache revision does not move) cannot be healed
    by writes: restart that replica only.

    node/NAME heals a ghost Node (deleted in etcd, served by a stale replica): a placeholder Node
    (unschedulable, tainted) is created and deleted at once under its name; a Node etcd has is never
    touched. pod/NAMESPACE/NAME names a pod explicitly (for a namespace called "node").

    Exit status: 0 every replica agrees with etcd, 1 some pod or Node is not healed (frozen replica, refused
    write, timeout), 2 bad arguments or no cluster access, 130 interrupted (nothing left behind).
    """
    from guard.core.heal_plan import render

    if all_ == bool(pods):
        raise click.UsageError("give NAMESPACE/NAME arguments or --all (not both)")
    targets = []
    nodes = []
    for pod in pods:
        if pod.startswith("node/"):  # a ghost Node (guard/engine/node_healer.py)
            if not pod[5:] or "/" in pod[5:] or pod_name_problem(pod[5:]):
                raise click.BadParameter(f"expected node/NAME with a valid Node name, got {visible(pod)!r}",
                                         param_hint="NAMESPACE/NAME")
            nodes.append(pod[5:])
            continue
        if pod.startswith("pod/") and pod.count("/") == 2:  # pod/NS/NAME: a pod, also in a namespace called "node"
            pod = pod[4:]
        namespace, sep, name = pod.partition("/")
        if not sep or not namespace or not name or "/" in name:
            raise click.BadParameter(f"expected NAMESPACE/NAME, got {visible(pod)!r}", param_hint="NAMESPACE/NAME")
        _check_pod_arg(namespace, name, "NAMESPACE/NAME")
        targets.append((namespace, name))
    if not timeout > 0:
        raise click.BadParameter("must be positive", param_hint="--timeout")
    if not probe_timeout > 0:
        raise click.BadParameter("must be positive", param_hint="--probe-timeout")
    progress = _progress("heal", output)
    progress("reading the cluster credentials and finding the apiserver replicas")
    from guard.engine.healer import Healer
    from guard.engine.node_healer import heal_node
    from guard.engine.node_healer import render as render_nodes

    kube, pool = _cluster("heal", kubeconfig, apiserver_replicas, apiserver_server_name, probe_timeout, 8)
    healer = Healer(kube, pool.clients, timeout=timeout, progress=progress)
    try:
        if all_:
            targets, errors = healer.ghosts()
            for error in errors:
                click.echo(f"ghost-guard heal: {error}", err=True)
        results = []
        for namespace, name in targets:
            results.append(healer.heal(namespace, name, dry_run=dry_run))
            if output == "table":  # what is ready first: each pod's result as soon as it is known
                click.echo(render(results[-1:], output), nl=False)
        node_results = [heal_node(kube, pool.clients, n, timeout=timeout, dry_run=dry_run) for n in nodes]
        if audit_store and node_results:
            _record_node_heals(audit_store, kubeconfig, node_results)
        if output == "json" and node_results:
            import json

            click.echo(json.dumps({"pods": json.loads(render(results, output)) if results else [],
                                   "nodes": [r.as_dict() for r in node_results]}, indent=2))
        else:
            if output != "table" or not (results or node_results):
                click.echo(render(results, output), nl=False)
            if node_results:
                click.echo(render_nodes(node_results, output), nl=False)
    except KeyboardInterrupt:
        click.echo("ghost-guard heal: interrupted (no placeholder left behind)", err=True)
        _exit_now(130)
    finally:
        healer.close()
        pool.close()
        kube.close()
    sys.exit(0 if all(r.ok for r in results) and all(r.ok for r in node_results) else 1)


def _exit_now(code: int) -> None:
    """End the process at once, after an interrupt whose clean-up is done: never wait for replica reads still in
    flight on pool threads. The interpreter's exit joins those threads, and one may never end: a read can take up
    to --probe-timeout, and a KeyboardInterrupt raised inside a ``with lock:`` of the main thread (a future's
    condition, a connection pool's) can leave that lock held for good (Ctrl-C printed "interrupted" and the
    process then hung, once in a full CI run)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_node_heals(spec: str, kubeconfig: str | None, results: list) -> None:
    """``heal --audit-store``: each node/NAME attempt that wrote (or found etcd has the Node) as a heal on the
    records of that ghost Node (every UID recorded under the name). A store that cannot take it is one line on
    stderr: the heal itself is done and its exit status stands."""
    import os
    import time

    from guard.audit.backend import StoreSpecError, open_store, parse_store
    from guard.core.records import AuditError, node_heal_attempt

    attempts = [(r, node_heal_attempt(r.outcome)) for r in results]
    if not any(a for _, a in attempts):
        return
    try:
        kind, path = parse_store(spec, DEFAULT_AUDIT_DB)
        if kind == "sqlite" and not os.path.exists(str(path)):
            click.echo(f"ghost-guard heal: no audit store at {path}: heal attempts not recorded", err=True)
            return
        store = open_store(spec, DEFAULT_AUDIT_DB, kubeconfig=kubeconfig, max_age_seconds=Settings.audit_max_age,
                           max_records=Settings.audit_max_records, write_interval=0.0)
    except (AuditError, StoreSpecError, OSError) as e:
        click.echo(f"ghost-guard heal: heal attempts not recorded: {e}", err=True)
        return
    try:
        records = store.node_records()
        for result, attempt in attempts:
            uids = [r.uid for r in records if r.name == result.node]
            if attempt is None:
                continue
            if not uids:
                click.echo(f"ghost-guard heal: the audit store has no record of ghost Node {visible(result.node)}: "
                           "its heal is not recorded", err=True)
            for uid in uids:
                store.record_node_heal(name=result.node, uid=uid, action=attempt[0], outcome=attempt[1],
                                       detail=result.detail, at=time.time())
    except (AuditError, ValueError) as e:
        click.echo(f"ghost-guard heal: heal attempts not recorded: {e}", err=True)
    finally:
        store.close()


def kubectl_plugin() -> None:
    """``kubectl ghost-guard ...``: the executable ``kubectl-ghost_guard`` (installed with the package) is the
    same command line, named as kubectl users type it."""
    main(prog_name="kubectl ghost-guard")


# --- lab, demo (guard/lab/): imported lazily, never on the serving path ------


KUBE_BIN_HELP = ("Real control-plane binaries: a directory holding kube-apiserver (kube-scheduler, "
                 "kube-controller-manager) or a Kubernetes release tarball (unpacked once to a cache). Default: "
                 "$GHOST_GUARD_KUBE_BIN, then $KUBEBUILDER_ASSETS; none: the Python lab.")


def _kube_binaries(command: str, kube_bin: str | None):
    """The binaries named by --kube-bin or the environment (None: the Python lab); exit 2 when unusable."""
    from guard.lab.real.binaries import BinariesError, find

    try:
        return find(kube_bin)
    except BinariesError as e:
        click.echo(f"ghost-guard {command}: {e}", err=True)
        sys.exit(2)


@main.command("lab", short_help="Run a local lab: etcd and apiserver replicas.")
@option("--replicas", type=int, default=3,
        help="apiserver replicas 0, 1, 2, ... (127.0.0.1, 127.0.0.2, ... on one port; replica N's kubeconfig is "
             "kubeconfig-N).")
@option("--drop-deletes", default=None, metavar="[N:]NAMESPACE[/NAME]",
        help="Make replica N (default 1, the second) lose the deletes of matching pods: the incident. '*' matches all.")
@option("--port", type=int, default=None, help="Port shared by the replicas (default: a free one).")
@option("--out-dir", type=click.Path(file_okay=False), default=None,
        help="Where to write the kubeconfigs and CA (default: a temporary directory).")
@click.option("--kube-bin", default=None, metavar="DIR|TARBALL", help=KUBE_BIN_HELP)
@click.option("--scheduler", is_flag=True, default=False,
              help="Real backend only: also run kube-scheduler (on replica 1, no extender).")
@click.option("--controller-manager", is_flag=True, default=False,
              help="Real backend only: also run kube-controller-manager (on replica 1, --controllers=*,-nodelifecycle).")
def lab(replicas: int, drop_deletes: str | None, port: int | None, out_dir: str | None, kube_bin: str | None,
        scheduler: bool, controller_manager: bool) -> None:
    """Run a local lab: real etcd and apiserver replicas with their own watch caches, until Ctrl-C.

    Prints one kubeconfig per replica. Needs the `lab` extra (pip install 'kube-ghost-guard[lab]').
    With --kube-bin (or $GHOST_GUARD_KUBE_BIN, $KUBEBUILDER_ASSETS) the replicas are real kube-apiservers,
    each reaching etcd through its own fault proxy (see docs/LAB.md).
    """
    from guard.lab.commands import run_lab

    binaries = _kube_binaries("lab", kube_bin)
    sys.exit(run_lab(replicas, drop_deletes, port, out_dir, kube_bin=binaries, scheduler=scheduler,
                     controller_manager=controller_manager))


@main.command("demo", short_help="Reproduce the ghost-pod incident; the guard breaks the loop.")
@option("--seconds", type=float, default=6.0,
        help="How long each phase (without, then with the guard) runs (with --kube-bin: at least until it shows its point).")
@click.option("--kube-bin", default=None, metavar="DIR|TARBALL", help=KUBE_BIN_HELP)
def demo(seconds: float, kube_bin: str | None) -> None:
    """Reproduce the ghost-pod incident on a local lab, then break the loop with the guard.

    Starts real etcd, 3 apiserver replicas 0, 1, 2 (replica 1 loses a pod's delete) and a scheduler
    loop on replica 1; runs it without the guard, then with the guard registered as an
    extender over HTTPS. Prints a before/after table; exits 0 only if the guard broke the loop.

    With --kube-bin (or $GHOST_GUARD_KUBE_BIN, $KUBEBUILDER_ASSETS): 2 real kube-apiserver replicas and
    the real kube-scheduler (the product's KubeSchedulerConfiguration), binding 404s counted from the
    apiserver's metrics, then `ghost-guard heal` clearing replica 1's stale cache without a restart.
    """
    binaries = _kube_binaries("demo", kube_bin)
    if binaries is not None:
        from guard.lab.real.demo import run_real_demo

        sys.exit(run_real_demo(binaries, seconds=seconds))
    from guard.lab.demo import run_demo

    sys.exit(run_demo(seconds=seconds))
