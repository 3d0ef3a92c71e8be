"""Issue 11 on the lab, end to end: StatefulSet-style recreates never block a live pod and never
blame a healthy replica.

Real etcd, three real apiserver replicas with their own watch caches, the scheduler simulator
(reading replica 1) with a real ``ghost-guard serve`` registered as its extender (filter +
preempt, pre-verification on, replicas discovered), and the CLI as subprocesses. The test's own
writes and quorum GETs go through replica 2; the guard reads through replica 0, so replica 0's
request log counts the guard's quorum GETs.

Blocked live pods are counted from the guard's access log (one JSON line per answered call: pod,
UID, verdict, time): a pod is *live* from its creation until the test issues its DELETE, so a
blocking answer for a UID whose DELETE was not yet issued when the answer was written is a live
pod blocked (etcd held that UID pending then: only the test deletes pods, and a pod the
scheduler asks about is unbound). That is stronger than a quorum GET after the fact, which can
only see the present.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import clirun
import pytest
from clirun import ghost_guard
from fixtures_lab import _report, mend
from guardstate import probes_done, view_pods, views_hold
from kubernetes.client.exceptions import ApiException
from payloads import binding_review, filter_body

from guard.lab import Lab
from guard.lab.harness import GuardProcess, create, eventually, node_manifest, pod_manifest, quorum_pod
from guard.lab.scheduler import ExtenderConfig, PodStats, Scheduler, Timings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NS = "default"
# kube-scheduler's timings scaled down 20x, as in tests/e2e/test_incident.py.
FAST = Timings(pod_initial_backoff=0.05, pod_max_backoff=0.5, backoff_flush_period=0.05,
               pod_max_in_unschedulable=60.0, unschedulable_flush_period=5.0, request_timeout=5.0,
               retry_period=0.1, sync_timeout=10.0)
# The guard's own windows stay at their defaults (--alive-ttl 0.5, --prepared-grace 0.5): the
# issue's window is the 0.5 s read cache. Background work runs fast so that it is done in time.
# The confirmation delay (1 s) is well past the 0.3 s a replica is made to lag below.
# --prepare-idle-after 0: verify ahead before the first scheduler call (the tests wait for it).
GUARD_FLAGS = ["--sweep-interval", "0.5", "--stale-confirm-delay", "1.0", "--reprobe-interval", "0.5",
               "--discovery-interval", "5", "--prepare-idle-after", "0"]
BLOCKING = {"ghost-deleted", "ghost-replaced", "already-bound", "terminating"}
BIND_BOUND = 10.0  # seconds a recreated pod may take to be bound (measured: well under 1 s)


def stat(stats: dict[str, PodStats], key: str) -> PodStats:
    return stats.get(key, PodStats())


def audit_records(db: str) -> list[dict]:
    """Every audit record, retracted ones included."""
    return clirun.audit_records(db, "--retracted")


def report(db: str) -> dict:
    r = ghost_guard("report", "--db", db, "-o", "json")
    doc = json.loads(r.stdout)
    assert r.returncode == (1 if doc["stale_replicas"] else 0), r.stderr  # exit 1 when a replica serves a ghost
    return doc


def access_log(g) -> list[dict]:
    """The guard's access-log lines for /filter, /preempt and /validate/binding (the whole file)."""
    return [entry for entry in g.log_records()
            if entry.get("path") in ("/filter", "/preempt", "/validate/binding") and "uid" in entry]


def guard_events(lab, namespace: str = NS) -> list:
    return [e for e in lab.core_v1(2).list_namespaced_event(namespace, _request_timeout=5).items
            if e.reason in ("GhostPodBlocked", "StaleWatchCache")]


def delete_pod(api, name: str, uid: str) -> None:
    """DELETE exactly this pod (grace 0, a UID precondition, as a StatefulSet controller does). A 404
    is our own DELETE already applied: urllib3 re-sends an idempotent request whose answer it lost
    (a 404 was seen once on the loaded machine)."""
    from kubernetes.client.exceptions import ApiException

    try:
        api.delete_namespaced_pod(name, NS, grace_period_seconds=0, body={"preconditions": {"uid": uid}},
                                  _request_timeout=5)
    except ApiException as e:
        if e.status != 404:
            raise


def healthy_report(rep: dict) -> None:
    """``ghost-guard report`` names no replica: none stale, none ever blamed and healed since."""
    assert rep["stale_replicas"] == [], rep
    assert rep["healed_replicas"] == [], rep
    assert not any("Restart the apiserver" in step for step in rep["remediation"]), rep


def no_replica_blamed(g) -> None:
    assert g.metric("ghost_guard_stale_replica_detections_total") == 0
    assert g.metric("ghost_guard_stale_replica") == 0
    assert g.metric("ghost_guard_verdicts_retracted_total") == 0


def rig(lab, start_guard, start_scheduler, db: str, nodes: list[str], store: list[str] = ()):
    """``nodes`` created, then a guard (audit db ``db``) and a scheduler on replica 1 with the guard as extender:
    (guard, audit db, scheduler)."""
    api = lab.core_v1(2)
    for name in nodes:
        create(api, node_manifest(name))
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, *GUARD_FLAGS, *store])
    eventually(lambda: "apiserver replicas" in g.logs(tail=None), 20, what="replica discovery", process=g)
    assert lab.wait_synced()
    ext = ExtenderConfig(url_prefix=g.base, filter_verb="filter", preempt_verb="preempt",
                         node_cache_capable=True, http_timeout=5.0)
    sched = start_scheduler(lab.kubeconfig(1), timings=FAST, extenders=[ext])
    return g, db, sched


@pytest.fixture
def guarded(lab, start_guard, lab_scheduler, tmp_path):
    """Factory: ``guarded(nodes)`` -> (guard, audit db, scheduler on replica 1 with the guard as extender)."""

    def start(nodes: list[str], store: list[str] = ()):
        return rig(lab, start_guard, lab_scheduler, str(tmp_path / "audit.db"), nodes, store)

    return start


# --- 1. 200 delete-and-recreate cycles under five names --------------------------------------------


@dataclass
class Life:
    name: str
    uid: str
    created: float  # time.time() when the create returned
    racing: bool = False  # deleted on purpose while it may still be pending
    deleted: float | None = None  # time.time() just before its DELETE was sent
    bound_after: float | None = None  # seconds from creation to bound (seen by the scheduler, checked in etcd)
    node: str = ""


CYCLES = 200
NAMES = [f"web-{i}" for i in range(5)]
RACING_NAMES = {"web-3", "web-4"}  # every other turn of these deletes a pod that may still be pending


def test_200_recreates_under_the_same_names_block_no_live_pod_and_blame_no_replica(lab, guarded):
    g, db, sched = guarded(["node-a", "node-b", "node-c"])
    api = lab.core_v1(2)
    rng = random.Random(11)
    lives: list[Life] = []
    current: dict[str, Life] = {}

    def make(name: str, *, racing: bool = False) -> Life:
        uid = create(api, pod_manifest(name))["metadata"]["uid"]
        life = Life(name, uid, time.time(), racing=racing)
        lives.append(life)
        current[name] = life
        return life

    def delete(life: Life) -> None:
        life.deleted = time.time()
        delete_pod(api, life.name, life.uid)

    def bound(life: Life) -> None:
        """Wait until the scheduler bound this pod (its informer shows it), then check etcd."""
        key = f"{NS}/{life.name}"

        def seen() -> bool:
            pod = sched.informer_pods().get(key)
            return bool(pod and pod["metadata"]["uid"] == life.uid and pod["spec"].get("nodeName"))

        eventually(seen, BIND_BOUND, what=f"{key} uid {life.uid} bound", interval=0.005, process=g)
        life.bound_after = time.time() - life.created
        pod = quorum_pod(api, life.name)
        assert pod is not None and pod["metadata"]["uid"] == life.uid and pod["spec"]["nodeName"], pod
        life.node = pod["spec"]["nodeName"]

    late_calls: list[float] = []  # seconds from the late call's ghost answer to the recreate

    def late_call(name: str, binds_before: int) -> None:
        """The issue's case inside the churn. The scheduler's bind of the new pod is slow (0.3 s);
        meanwhile its replica's watch lags (frozen for 0.3 s) and the pod is deleted: the bind
        gets 404, the informer still holds the pod, and its late /filter arrives after the DELETE
        (a quorum GET 404, cached by name for 0.5 s). The pod is recreated at once, inside that
        window; then the replica catches up and the scheduler schedules the new pod."""
        key = f"{NS}/{name}"
        life = current[name]
        eventually(lambda: stat(sched.stats(), key).bind_attempts > binds_before, BIND_BOUND,
                   what=f"the scheduler binding {key}", interval=0.002, process=g)
        frozen_at = time.monotonic()
        lab.replicas[1].faults.freeze_watch()
        try:
            life.racing = True
            before = stat(sched.stats(), key).unschedulable
            delete(life)
            answered = eventually(lambda: stat(sched.stats(), key).unschedulable > before and time.time(), 30,
                                  what=f"the late /filter for {key} rejected", interval=0.002)
            make(name)
            late_calls.append(current[name].created - answered)
            time.sleep(max(0.0, 0.3 - (time.monotonic() - frozen_at)))  # the behaviour: replica 1 lags 0.3 s
        finally:
            lab.replicas[1].faults.unfreeze_watch()

    start = time.monotonic()
    for name in NAMES:
        make(name)
    cycles = 0
    turn: dict[str, int] = dict.fromkeys(NAMES, 0)
    while cycles < CYCLES:
        name = NAMES[cycles % len(NAMES)]
        turn[name] += 1
        racing = name in RACING_NAMES and cycles + 1 < CYCLES
        late = racing and turn[name] % 4 == 0
        quick = racing and turn[name] % 4 == 2
        bound(current[name])  # the StatefulSet pod is up; now it is deleted and recreated at once
        binds_before = stat(sched.stats(), f"{NS}/{name}").bind_attempts
        if late:
            lab.replicas[1].faults.add("latency", method="POST", seconds=0.3, count=1,
                                       path=f"/api/v1/namespaces/{NS}/pods/{name}/binding")
        delete(current[name])
        make(name)
        cycles += 1
        if quick:
            # The new pod is deleted again within 0-60 ms, while the scheduler may be filtering or
            # binding it, and recreated at once.
            time.sleep(rng.uniform(0.0, 0.06))  # the behaviour: a controller's delete at a random moment
            current[name].racing = True
            delete(current[name])
            make(name)
            cycles += 1
        elif late:
            late_call(name, binds_before)
            cycles += 1
    for name in NAMES:
        bound(current[name])
    elapsed = time.monotonic() - start

    # The follow-ups of every ghost answer (audit, etcd, probes, confirmation after 1 s) are done: every
    # ghost the guard counts as blocked has its record, and each record its probe rounds (guardstate.probes_done).
    def followed_up() -> tuple[list[dict]] | None:
        records = audit_records(db)
        done = len(records) >= g.metric("ghost_guard_ghosts_blocked_total") and probes_done(records)
        return (records,) if done else None

    eventually(followed_up, 30, what="every ghost's record and probe rounds", interval=0.2, process=g)
    assert lab.wait_synced()
    stats = sched.stats()
    calls = access_log(g)
    by_uid = {life.uid: life for life in lives}

    # 0 live pods blocked: every blocking answer names a UID whose DELETE had been issued before.
    blocked_live = [c for c in calls if c["verdict"] in BLOCKING
                    and (by_uid[c["uid"]].deleted is None or c["time"] < by_uid[c["uid"]].deleted - 0.001)]
    assert blocked_live == []
    undecided = [c for c in calls if c["verdict"] == "unknown"]
    # Every pod the test did not delete on purpose while pending was bound, within BIND_BOUND.
    kept = [life for life in lives if not life.racing]
    assert all(life.bound_after is not None for life in kept)
    # The final pods are the live ones now: etcd holds each pending-or-bound under its UID, bound.
    for name, life in current.items():
        pod = quorum_pod(api, name)
        assert (pod["metadata"]["uid"], pod["spec"]["nodeName"]) == (life.uid, life.node)

    # The simulator counts per name. The names without racing deletes only ever had live pods:
    # each was filtered once and bound at its first attempt, never unschedulable, no failed bind.
    for name in sorted(set(NAMES) - RACING_NAMES):
        s = stat(stats, f"{NS}/{name}")
        created = sum(1 for life in lives if life.name == name)
        assert (s.filter_calls, s.bind_attempts, s.unschedulable, s.scheduling_errors, s.bind_failures) == (
            created, created, 0, 0, {}), (name, s)
        assert s.preempt_calls == 0 and s.evictions == []
    # On the racing names the counters mix live and deleted pods (the access log above attributes
    # each answer to its UID): a failed bind can only be of a pod deleted meanwhile.
    racing = [life for life in lives if life.racing]
    for name in sorted(RACING_NAMES):
        s = stat(stats, f"{NS}/{name}")
        assert set(s.bind_failures) <= {404, 409}, (name, s)
        assert s.evictions == []

    # The audit store holds no record of a UID that was live when blocked (retracted ones included).
    records = audit_records(db)
    for r in records:
        life = by_uid.get(r["uid"])
        assert life is not None and life.racing and life.deleted is not None, r
        assert r["retracted_at"] is None, r
    # 0 healthy replicas reported: the metrics and the Events name none; the report calls none stale
    # and has no restart advice. Replica 1 (the scheduler's, made to lag 0.3 s for each late call) is
    # never named either: a replica seen serving once is only recorded when the confirmation still finds it.
    rep = report(db)
    assert rep["stale_replicas"] == [], rep
    assert not any("Restart the apiserver" in step for step in rep["remediation"]), rep
    assert rep["healed_replicas"] == [], rep
    no_replica_blamed(g)
    events = guard_events(lab)
    assert [e for e in events if e.reason == "StaleWatchCache"] == []
    assert all(by_uid[e.involved_object.uid].racing for e in events), [e.involved_object.uid for e in events]

    # Figures (printed with -s; docs/RELIABILITY.md).
    quorum_gets = [r for r in lab.replicas[0].requests(method="GET", quorum=True)
                   if r.path.startswith(f"/api/v1/namespaces/{NS}/pods/web-")]
    settled = sorted(set(NAMES) - RACING_NAMES)
    settled_gets = sum(1 for r in quorum_gets if r.path.rsplit("/", 1)[1] in settled)
    settled_pods = sum(1 for life in lives if life.name in settled)
    waits = sorted(life.bound_after for life in kept)
    metric = g.metric
    print(f"\nrecreate: {cycles} delete-and-recreate cycles, {len(lives)} pods ({len(racing)} deleted while "
          f"possibly pending), {elapsed:.1f} s; bound after create: median {statistics.median(waits) * 1000:.0f} ms, "
          f"max {waits[-1] * 1000:.0f} ms; guard calls {len(calls)} "
          f"(blocking {sum(c['verdict'] in BLOCKING for c in calls)}, unknown {len(undecided)}); "
          f"guard quorum GETs {len(quorum_gets)} = {len(quorum_gets) / len(lives):.2f} per pod "
          f"({settled_gets / settled_pods:.2f} per pod on {', '.join(settled)}); "
          f"prepared {metric('ghost_guard_verdicts_prepared_total'):.0f}, "
          f"inline {metric('ghost_guard_verdicts_inline_total'):.0f}, "
          f"shared {metric('ghost_guard_verdicts_shared_read_total'):.0f}, "
          f"prepared ahead {metric('ghost_guard_prepare_verified_total'):.0f}; audit records {len(records)}, "
          f"GhostPodBlocked Events {len(events)}; {len(late_calls)} late calls, recreated "
          f"{max(late_calls, default=0) * 1000:.0f} ms after at most; report's healed replicas "
          f"{[h['replica'] for h in rep['healed_replicas']]}; racing names: "
          + ", ".join(f"{n} unschedulable {stat(stats, f'{NS}/{n}').unschedulable} "
                      f"bind failures {stat(stats, f'{NS}/{n}').bind_failures}" for n in sorted(RACING_NAMES)))


# --- 2. the late call of the issue, sent over HTTP --------------------------------------------------


def filter_passes(g, name: str, uid: str) -> bool:
    out = g.post("/filter", filter_body(NS, name, uid, ["node-a"])).json()
    return out["NodeNames"] == ["node-a"] and out["FailedAndUnresolvableNodes"] == {}


def wait_bound(lab, sched, name: str, uid: str) -> dict:
    key = f"{NS}/{name}"
    eventually(lambda: (lambda p: p and p["metadata"]["uid"] == uid and p["spec"].get("nodeName"))(
        sched.informer_pods().get(key)), 20, what=f"{key} uid {uid} bound", interval=0.01)
    pod = quorum_pod(lab.core_v1(2), name)
    assert pod["metadata"]["uid"] == uid and pod["spec"]["nodeName"], pod
    return pod


class Frozen:
    """Every replica's watch cache stops applying events (the guard's watches and the scheduler's
    informer see nothing new) while the writes still reach etcd: the guard's name-keyed read cache
    cannot be invalidated by a watch event meanwhile."""

    def __init__(self, lab) -> None:
        self.replicas = lab.replicas

    def __enter__(self) -> Frozen:
        for r in self.replicas:
            r.faults.freeze_watch()
        return self

    def __exit__(self, *exc: object) -> None:
        for r in self.replicas:
            r.faults.unfreeze_watch()


WINDOW = 0.5  # --alive-ttl: how long the guard reuses a quorum read of a name
ATTEMPTS = 3


def recreate_in_the_window(lab, g, api, name: str, cached: str, first: str, pending: int) -> tuple[str, str, float]:
    """One delete-and-recreate of ``name`` (A, then B) against a read of the name cached just before
    (``pending``: how many other pods are unscheduled, the earlier attempts' B).
    Returns (uid A, uid B, seconds from the cached read to B's check)."""
    alive = g.metric("ghost_guard_prepare_verified_total", verdict="alive")
    uid_a = create(api, pod_manifest(name))["metadata"]["uid"]
    eventually(lambda: g.metric("ghost_guard_prepare_verified_total", verdict="alive") > alive, 10,
               what="A verified in the background", process=g)
    first_call = time.monotonic()
    assert filter_passes(g, name, uid_a)  # A's first attempt, from its prepared verdict
    # the behaviour: past --prepared-grace (0.5 s, a TTL running out), a later attempt of A is read again, inline
    time.sleep(max(0.0, 0.6 - (time.monotonic() - first_call)))
    inline = g.metric("ghost_guard_verdicts_inline_total")
    if cached == "404":
        delete_pod(api, name, uid_a)
        assert lab.wait_synced()
        # every cache, and each of the guard's views, have the DELETE: nothing drops the 404 read
        eventually(lambda: views_hold(g, pending), 20, what="the DELETE applied by every view of the guard",
                   process=g)
        assert not filter_passes(g, name, uid_a)  # the late call: A is gone, rightly rejected
    else:
        assert filter_passes(g, name, uid_a)  # a read of A's generation, cached by name
    assert g.metric("ghost_guard_verdicts_inline_total") == inline + 1  # a GET of its own, cached
    read_at = time.monotonic()
    with Frozen(lab) if first == "call" else contextlib.nullcontext():
        if cached == "old-generation":
            delete_pod(api, name, uid_a)
        verified_ahead = g.metric("ghost_guard_prepare_verified_total")
        uid_b = create(api, pod_manifest(name))["metadata"]["uid"]
        if first == "background":
            eventually(lambda: g.metric("ghost_guard_prepare_verified_total") > verified_ahead, 5,
                       what="B verified in the background", interval=0.005, process=g)
        window = time.monotonic() - read_at
        assert filter_passes(g, name, uid_b)  # B passes, whether or not the cached read was still there
    if first == "background":
        assert g.metric("ghost_guard_prepare_verified_total", verdict="alive") == alive + 2  # A, then B
    return uid_a, uid_b, window


@dataclass
class Rig:
    lab: Lab
    guard: GuardProcess
    db: str
    sched: Scheduler
    blocked: list[str]  # every A blocked by the tests before (their audit records stay)


@pytest.fixture(scope="module")
def window_rig(module_guard, tmp_path_factory) -> Iterator[Rig]:
    """One lab, guard and scheduler (no node) for the four orders of the late-filter test (``rigged``)."""
    schedulers: list[Scheduler] = []

    def start_scheduler(kubeconfig: str, **options) -> Scheduler:
        s = Scheduler(kubeconfig, **options)
        schedulers.append(s)
        s.start()
        return s

    with Lab(replicas=3) as lab:
        try:
            g, db, sched = rig(lab, module_guard, start_scheduler, str(tmp_path_factory.mktemp("window") / "audit.db"), [])
            yield Rig(lab, g, db, sched, [])
        finally:
            for s in schedulers:
                s.stop()


@pytest.fixture
def rigged(window_rig: Rig, request) -> Iterator[Rig]:
    """``window_rig`` as each late-filter test needs it: every fault cleared and no node, in etcd nor in the
    scheduler's informer (so it holds the test's pods pending and never asks by itself). Each test uses pod
    names of its own, and its pods end bound (so no view of the guard holds them as unscheduled); node-a,
    which it creates to bind them, is deleted after it."""
    lab, sched = window_rig.lab, window_rig.sched
    eventually(lambda: sched.informer_nodes() == {}, 10, what="no node in the scheduler's informer")
    yield window_rig
    _report(lab, request)
    mend(lab)
    with contextlib.suppress(ApiException):
        lab.core_v1(2).delete_node("node-a", _request_timeout=5)


@pytest.mark.parametrize("first", ["call", "background"])
@pytest.mark.parametrize("cached", ["404", "old-generation"])
def test_late_filter_for_a_deleted_pod_does_not_block_its_recreated_namesake(rigged, cached, first):
    """web-0 (uid A) is deleted; the scheduler's late /filter for A arrives right after (its quorum
    GET 404 is cached by name for 0.5 s), or a read of A's generation was cached just before the
    delete; the controller recreates web-0 (uid B) inside that window. Either a /filter for B
    (``call``: every watch held back meanwhile, so only the guard's read rules stand between the
    cached read and B) or the background verification of B (``background``) comes first. B
    passes, is never condemned, the scheduler binds it, and nothing names a replica or B. (No node
    exists until then, so the scheduler holds both pods pending and never asks by itself.)

    "Inside the window" is wall-clock time on the test's side, which a busy machine can stretch
    past 0.5 s: such an attempt still checks that B passes, and the recreate is tried again under
    the next name (web-...-1, web-...-2) until one lands inside the window; the test fails if none does.
    The four orders share one lab, guard and scheduler (``rigged``), each with pod names of its own.
    The same interleavings on a fake clock, where the window never runs out, are
    tests/state/test_verdict_state.py::test_a_recreate_inside_the_burst_window_never_condemns_the_new_pod
    and ::test_background_verification_of_the_recreated_pod_rereads_past_the_cached_404."""
    lab, g, db, sched = rigged.lab, rigged.guard, rigged.db, rigged.sched
    api = lab.core_v1(2)
    pods: list[tuple[str, str, str]] = []  # (name, uid A, uid B), one per attempt
    windows: list[float] = []
    for attempt in range(ATTEMPTS):
        name = f"web-{cached}-{first}-{attempt}"  # names of its own: the guard and lab are the module's
        uid_a, uid_b, window = recreate_in_the_window(lab, g, api, name, cached, first, pending=len(pods))
        pods.append((name, uid_a, uid_b))
        windows.append(window)
        if window < WINDOW:
            break
        print(f"\n{name}: B came {window:.3f}s after the cached read, outside the {WINDOW} s window: again")
    assert windows[-1] < WINDOW, f"B came {windows} s after the cached read: never inside the {WINDOW} s window"

    # A later attempt for each B (past the grace, every background verification done) still passes:
    # no ghost verdict was cached for B.
    time.sleep(0.7)  # the behaviour: past --prepared-grace and --alive-ttl (0.5 s each, TTLs running out)
    for name, _, uid_b in pods:
        assert filter_passes(g, name, uid_b)
    create(api, node_manifest("node-a"))  # the scheduler can place B now
    for name, _, uid_b in pods:
        pod = wait_bound(lab, sched, name, uid_b)
        # etcd has the binding before the scheduler's cycle records it: wait for its stats to say so
        stats = eventually(lambda: (s := stat(sched.stats(), f"{NS}/{name}")).bound_node and s, 20,
                           what=f"the scheduler's stats of {name} bound")
        assert stats.bind_failures == {} and stats.bound_node == pod["spec"]["nodeName"]

    # Every follow-up (audit, etcd, probes, confirmation after 1 s) is done: each A blocked has its record, its
    # probe rounds (guardstate.probes_done) and its Event.
    blocked_a = sorted(a for _, a, _ in pods) if cached == "404" else []
    rigged.blocked += blocked_a
    recorded = sorted(rigged.blocked)  # the A's blocked by this test and by those before it: records of no other pod

    def followed_up() -> bool:
        records = audit_records(db)
        return (sorted(r["uid"] for r in records) == recorded and probes_done(records)
                and {e.involved_object.uid for e in guard_events(lab) if e.reason == "GhostPodBlocked"} >= set(blocked_a))

    eventually(followed_up, 20, what="the follow-ups of each A blocked", interval=0.2, process=g)
    calls = access_log(g)
    for _, uid_a, uid_b in pods:
        assert [c["verdict"] for c in calls if c["uid"] == uid_b] and all(
            c["verdict"] == "alive" for c in calls if c["uid"] == uid_b), calls
        ghosts_a = [c for c in calls if c["uid"] == uid_a and c["verdict"] in BLOCKING]
        assert len(ghosts_a) == (1 if cached == "404" else 0)
        assert all(e.involved_object.uid != uid_b for e in guard_events(lab))
    assert g.metric("ghost_guard_prepare_verified_total", verdict="ghost-deleted") == 0
    assert g.metric("ghost_guard_prepare_verified_total", verdict="ghost-replaced") == 0
    assert [e for e in guard_events(lab) if e.reason == "StaleWatchCache"] == []
    assert sorted(r["uid"] for r in audit_records(db)) == recorded
    healthy_report(report(db))
    no_replica_blamed(g)


# --- 3. dry runs record nothing; a UID under a forged name blocks nobody ---------------------------


def review(g, name: str, uid: str, *, dry_run: bool) -> dict:
    r = g.post("/validate/binding", binding_review(NS, name, uid, node="node-a", dry_run=dry_run))
    assert r.status_code == 200, r.text
    return r.json()["response"]


def test_dry_run_review_records_nothing_and_a_forged_name_blocks_no_live_pod(lab, guarded):
    g, db, sched = guarded([])
    api = lab.core_v1(2)
    uid_g = create(api, pod_manifest("gone-1"))["metadata"]["uid"]
    delete_pod(api, "gone-1", uid_g)
    assert lab.wait_synced()
    # The guard's own views, not only the lab's caches: a verdict prepared while gone-1 was alive answers
    # until the guard applies the DELETE (once answered `alive` 52 ms after /readyz).
    eventually(lambda: views_hold(g, 0), 20, what="the DELETE applied by every view of the guard", process=g)

    # A dry-run review of the ghost's binding: denied (the verdict applies), nothing recorded.
    for _ in range(2):  # decided by a quorum read, then from the ghost cache
        answer = review(g, "gone-1", uid_g, dry_run=True)
        assert answer["allowed"] is False
        # "not found", or "terminating" when a read caught the delete's first step (deletionTimestamp)
        assert answer["status"]["message"].startswith(f"ghost pod: {NS}/gone-1 uid {uid_g} "), answer
    # No pause needed: a block that records counts ghost_guard_ghosts_blocked_total on the request path, before
    # its answer (Checker._first_sighting), and its record, Event and stdout line start from there. The count
    # is 0, and the real review below ends with times_blocked 1, one Event and one line.
    assert g.metric("ghost_guard_ghosts_blocked_total") == 0
    assert audit_records(db) == []
    assert [e for e in guard_events(lab) if e.involved_object.uid == uid_g] == []
    assert g.metric("ghost_guard_ghosts_blocked_total") == 0
    assert not [line for line in g.stdout().splitlines() if uid_g in line]

    # The next real review records it, once.
    assert review(g, "gone-1", uid_g, dry_run=False)["allowed"] is False
    record = eventually(lambda: [r for r in audit_records(db) if r["uid"] == uid_g], 10, what="the audit record",
                        interval=0.2)
    assert [(r["name"], r["times_blocked"], r["retracted_at"]) for r in record] == [("gone-1", 1, None)]
    events = eventually(lambda: [e for e in guard_events(lab) if e.involved_object.uid == uid_g], 10,
                        what="the GhostPodBlocked Event", interval=0.2)
    assert [(e.reason, e.count) for e in events] == [("GhostPodBlocked", 1)]
    assert g.metric("ghost_guard_ghosts_blocked_total") == 1
    assert [line for line in g.stdout().splitlines() if uid_g in line] != []

    # A caller names a pod that does not exist with a live pod's UID (a /filter and a dry-run
    # review): those calls are rejected, and the live pod is not: it passes and is bound.
    uid_live = create(api, pod_manifest("live-1"))["metadata"]["uid"]
    forged = g.post("/filter", filter_body(NS, "does-not-exist", uid_live, ["node-a"])).json()
    assert forged["NodeNames"] == [] and set(forged["FailedAndUnresolvableNodes"]) == {"node-a"}
    assert review(g, "does-not-exist", uid_live, dry_run=True)["allowed"] is False
    assert filter_passes(g, "live-1", uid_live)
    create(api, node_manifest("node-a"))
    wait_bound(lab, sched, "live-1", uid_live)
    live = stat(sched.stats(), f"{NS}/live-1")
    assert (live.filter_calls, live.bind_attempts, live.bind_failures) == (1, 1, {})
    assert all(c["verdict"] == "alive" for c in access_log(g) if c["uid"] == uid_live and c["pod"] == f"{NS}/live-1")
    # The forged call's follow-ups (record, probes) are done: what they wrote is there to be looked at.
    eventually(lambda: (lambda rs: len(rs) >= g.metric("ghost_guard_ghosts_blocked_total") and probes_done(rs))(
        audit_records(db)), 20, what="the forged call's record and probes", interval=0.2, process=g)
    assert not [r for r in audit_records(db) if (r["namespace"], r["name"]) == (NS, "live-1")]
    assert not [e for e in guard_events(lab) if e.involved_object.name == "live-1"]
    healthy_report(report(db))
    no_replica_blamed(g)


# --- the report names a stale replica whatever a caller sent before ------------------------------------


def replica_address(lab, i: int) -> str:
    return f"{lab.replicas[i].ip}:{lab.replicas[i].port}"


def test_a_replica_that_only_lagged_is_never_named(lab, guarded):
    from guard.audit.sqlite import AuditStore
    from guard.core.rendering import build_report

    g, db, sched = guarded(["node-a"])
    api = lab.core_v1(2)
    key = f"{NS}/web-0"
    # The scheduler's bind of A is slow; meanwhile its replica lags and A is deleted: the bind
    # gets 404 and the scheduler, still holding A, sends its late /filter (rightly rejected).
    lab.replicas[1].faults.add("latency", method="POST", seconds=0.3, count=1,
                               path=f"/api/v1/namespaces/{NS}/pods/web-0/binding")
    uid_a = create(api, pod_manifest("web-0"))["metadata"]["uid"]
    eventually(lambda: stat(sched.stats(), key).bind_attempts >= 1, 10, what="A's bind in flight", interval=0.002)
    named: set[str] = set()

    def look(store: AuditStore) -> list:
        """What `ghost-guard report` would say now; returns the records."""
        records = store.records()
        rep = build_report(records)
        named.update({r["replica"] for r in rep["stale_replicas"]} | {h["replica"] for h in rep["healed_replicas"]})
        return records

    with AuditStore(db) as store:
        lab.replicas[1].faults.freeze_watch()
        try:
            delete_pod(api, "web-0", uid_a)
            eventually(lambda: stat(sched.stats(), key).unschedulable >= 1, 5, what="the late /filter",
                       interval=0.002)
            late = time.time()
            uid_b = create(api, pod_manifest("web-0"))["metadata"]["uid"]

            def probed() -> bool:  # the guard's probe of this replica's cache (LIST rv=0 of the name), answered
                return any(r.query.get("resourceVersion") == "0" and "web-0" in r.query.get("fieldSelector", "")
                           for r in lab.replicas[1].requests(method="GET", path=f"/api/v1/namespaces/{NS}/pods",
                                                             since=late - 1.0))

            eventually(probed, 3, what="the guard's first probe of the lagging replica", interval=0.01)
        finally:
            lab.replicas[1].faults.unfreeze_watch()
        # Looked at again and again until A's record shows its confirmation round (1 s after the first probe:
        # every replica written down, guardstate.probes_done): whatever `report` would have named meanwhile.
        def confirmed() -> bool:
            mine = [r for r in look(store) if r.uid == uid_a]
            return bool(mine) and all(len(r.replicas) >= len(lab.replicas) for r in mine)

        eventually(confirmed, 10, what="A's confirmation round", interval=0.02, process=g)
    wait_bound(lab, sched, "web-0", uid_b)
    no_replica_blamed(g)  # the metrics are right: confirmed stale only after the delay
    assert named == set(), f"report named {named} (the scheduler's replica, lagging: {replica_address(lab, 1)})"


def test_a_forged_name_cannot_hide_a_later_real_ghost_from_the_report(lab, guarded):
    """F9, fixed: the SQLite store keys records by identity (namespace, name, UID) as the GhostPod store does, so
    a /filter naming does-not-exist with a live pod's UID gets a record of its own, and the pod's own record,
    when it really becomes a ghost, names the stale replica."""
    g, db, sched = guarded([])
    api = lab.core_v1(2)
    uid = create(api, pod_manifest("live-1"))["metadata"]["uid"]
    assert lab.wait_synced()
    assert not filter_passes(g, "does-not-exist", uid)  # the forged call: rightly rejected
    # The pod is then deleted, and replica 1's watch cache loses the delete: a real ghost.
    lab.replicas[1].faults.drop_deletes(namespace=NS, name="live-1")
    delete_pod(api, "live-1", uid)
    assert lab.wait_synced()
    # The guard's own views of replicas 0 and 2 (replica 1 lost the delete), not only the lab's caches: a verdict
    # prepared while live-1 was alive answers until the guard applies the DELETE (seen failing at a load of 7).
    eventually(lambda: all(view_pods(g).get(replica_address(lab, i)) == 0 for i in (0, 2)), 20,
               what="the DELETE applied by the guard's views of replicas 0 and 2", process=g)
    # the scheduler may have asked about live-1 while it was pending: that alive verdict answers for --alive-ttl
    eventually(lambda: not filter_passes(g, "live-1", uid), 5, what="live-1 rejected as a ghost", process=g)
    stale = replica_address(lab, 1)
    # Confirmed stale after the record was written (new_ghost records, then probes, then confirms): no pause.
    eventually(lambda: g.metric("ghost_guard_stale_replica_detections_total", replica=stale) == 1, 10,
               what="replica 1 confirmed stale", process=g)
    assert eventually(lambda: [r["replica"] for r in report(db)["stale_replicas"]] or None, 10,
                      what="report naming the stale replica", interval=0.2) == [stale]
    records = {(r["namespace"], r["name"]): r for r in audit_records(db)}
    assert records[(NS, "live-1")]["uid"] == uid and records[(NS, "live-1")]["stale_replicas"] == [stale]
    assert records[(NS, "does-not-exist")]["uid"] == uid and records[(NS, "does-not-exist")]["stale_replicas"] == []


def test_a_forged_name_cannot_hide_a_later_real_ghost_from_the_report_with_ghostpods(lab, guarded):
    """The same story with --audit-store kubernetes: GhostPods are named by the pod's identity
    (namespace, name, UID), so the forged call's record and the real ghost's are two objects."""
    g, _, sched = guarded([], ["--audit-store", "kubernetes", "--audit-write-interval", "0.2"])
    store = ["--audit-store", "kubernetes", "--kubeconfig", lab.kubeconfig(2)]
    api = lab.core_v1(2)
    uid = create(api, pod_manifest("live-1"))["metadata"]["uid"]
    assert lab.wait_synced()
    assert not filter_passes(g, "does-not-exist", uid)  # the forged call: rightly rejected
    lab.replicas[1].faults.drop_deletes(namespace=NS, name="live-1")
    delete_pod(api, "live-1", uid)
    assert lab.wait_synced()
    # The guard's own views of replicas 0 and 2 (replica 1 lost the delete), not only the lab's caches: a verdict
    # prepared while live-1 was alive answers until the guard applies the DELETE (seen failing at a load of 7).
    eventually(lambda: all(view_pods(g).get(replica_address(lab, i)) == 0 for i in (0, 2)), 20,
               what="the DELETE applied by the guard's views of replicas 0 and 2", process=g)
    # the scheduler may have asked about live-1 while it was pending: that alive verdict answers for --alive-ttl
    eventually(lambda: not filter_passes(g, "live-1", uid), 5, what="live-1 rejected as a ghost", process=g)
    stale = replica_address(lab, 1)
    eventually(lambda: g.metric("ghost_guard_stale_replica_detections_total", replica=stale) == 1, 10,
               what="replica 1 confirmed stale", process=g)

    def named() -> list[str] | None:
        r = ghost_guard("report", *store, "-o", "json")
        replicas = [x["replica"] for x in json.loads(r.stdout)["stale_replicas"]]
        assert r.returncode == (1 if replicas else 0), r.stderr
        return replicas or None

    assert eventually(named, 10, what="report naming the stale replica", interval=0.2) == [stale]
    r = ghost_guard("audit", *store, "--retracted", "-o", "json")
    records = {(x["namespace"], x["name"]): x for x in json.loads(r.stdout)}
    assert records[(NS, "live-1")]["uid"] == uid and records[(NS, "live-1")]["stale_replicas"] == [stale]
    assert records[(NS, "does-not-exist")]["uid"] == uid and records[(NS, "does-not-exist")]["stale_replicas"] == []
