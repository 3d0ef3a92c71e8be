"""The running guard on the lab names a replica that misses a pod (its watch lost the creation and
flowed on) and a replica whose watch froze, and never a replica that merely lags.

Real etcd, three real HTTPS apiserver replicas with their own watch caches, a real `ghost-guard serve`.
"""

from __future__ import annotations

import time

import pytest

from guard.lab.harness import cached_names, eventually, pod_manifest

pytestmark = pytest.mark.timeout(240)

REVISION_PROBE = "/api/v1/namespaces/default/pods"


def replica(lab, i: int) -> str:
    return f"{lab.replicas[i].ip}:{lab.replicas[i].port}"


def start(lab, start_guard, tmp_path, *extra: str):
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "audit.db"),
                     "--discovery-interval", "5", *extra])
    return synced(g)


def synced(g):
    eventually(lambda: all(v["watch"] and v["watch"]["state"] == "synced"
                           for v in g.get("/readyz", timeout=5).json()["details"]["replicas"].values())
               and len(g.get("/readyz", timeout=5).json()["details"]["replicas"]) == 3,
               20, what="synced watches on the three replicas", process=g)
    return g


def missing_events(lab, uid: str) -> list:
    return [e for e in lab.core_v1(0).list_namespaced_event("default", _request_timeout=5).items
            if e.involved_object.uid == uid and e.reason == "PodMissingFromReplica"]


def caches(g, shows) -> dict:
    """/readyz's replica_caches detail once ``shows(detail)`` holds (/readyz reuses its answer for 2 s)."""
    def detail():
        d = g.get("/readyz", timeout=5).json()["details"]["replica_caches"]
        return d if shows(d) else None

    return eventually(detail, 10, what="the replica_caches detail in /readyz", process=g)


def revision_rounds(lab, since: float) -> int:
    """The guard's revision rounds since ``since``, as replica 0 saw them (one consistent read each)."""
    return len([x for x in lab.replicas[0].requests(method="GET", path=REVISION_PROBE, since=since)
                if x.query.get("fieldSelector") == "metadata.name=ghost-guard-revision-probe"
                and "resourceVersion" not in x.query])


def test_with_no_prepare_a_pod_whose_creation_a_replica_lost_is_still_reported_missing(lab, start_guard, tmp_path):
    """--no-prepare turns off verifying ahead, not the per-replica views (guard/engine/replica_views.py): every
    replica's cache is listed all the same and the missing-pod check compares them."""
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "audit.db"),
                     "--discovery-interval", "5", "--no-prepare", "--missing-after", "2", "--frozen-after", "3"])
    # The views know the three replicas once discovery answered (seconds on a loaded machine).
    eventually(lambda: len(g.get("/readyz", timeout=5).json()["details"]["replica_caches"]) == 3, 60,
               what="the three replicas in the replica_caches detail", process=g)
    details = g.get("/readyz", timeout=5).json()["details"]
    assert details["prepare"] == {"enabled": False, "fallback": None}  # /readyz as before: no pre-verification
    assert all(v["watch"] is None for v in details["replicas"].values())
    lost = replica(lab, 1)
    lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
    uid = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5).metadata.uid

    eventually(lambda: g.metric("ghost_guard_replica_pods_missing", replica=lost) == 1, 60,
               what="the missing-pod gauge with --no-prepare", process=g)
    assert g.metric("ghost_guard_replica_pods_missing_detections_total", replica=lost) == 1
    for other in (0, 2):
        assert g.metric("ghost_guard_replica_pods_missing_detections_total", replica=replica(lab, other)) == 0
    (event,) = eventually(lambda: missing_events(lab, uid), 30, what="the PodMissingFromReplica Event")
    assert lost in event.message
    assert g.metric("ghost_guard_prepare_active") == 0  # nothing verified ahead, no watch
    assert g.metric("ghost_guard_watch_fallback") == 0


def test_a_replica_that_lags_past_missing_after_is_not_blamed(lab, start_guard, tmp_path):
    # --frozen-after 15: far above the lag made here (a few seconds), and a revision round every 5 s
    g = start(lab, start_guard, tmp_path, "--missing-after", "1", "--frozen-after", "15")
    lagging = lab.replicas[1]
    lagging.faults.freeze_watch()  # it will catch up: a lag longer than --missing-after
    since = time.time()
    lab.core_v1(0).create_namespaced_pod("default", pod_manifest("slow"), _request_timeout=5)
    # Past --missing-after the guard suspects the pod there and either reads that cache (behind the pod's
    # revision: not missing) or already knows the cache is behind etcd (a revision read came first: it checks
    # no pod there while that lasts). Either way it looked, and held back.
    lag = replica(lab, 1)

    def looked() -> bool:
        confirmation = [r for r in lagging.requests(method="GET", path="/api/v1/namespaces/default/pods", since=since)
                        if r.query.get("fieldSelector") == "metadata.name=slow" and r.query.get("resourceVersion") == "0"]
        return bool(confirmation) or g.metric("ghost_guard_replica_seconds_behind", replica=lag) > 0

    eventually(looked, 20, what="the guard's look at the lagging replica", process=g)
    time.sleep(1.5)  # the behaviour: the replica keeps lagging, past --missing-after once more
    lagging.faults.unfreeze_watch()
    eventually(lambda: "slow" in cached_names(lab, 1, "default"), 10, what="the replica to catch up")
    # The guard's own state, not a pause: every one of its replica views holds the pod, and its revision
    # reads no longer find the lagging cache behind. A detection would have had to come before that.
    def caught_up() -> bool:
        details = g.get("/readyz", timeout=5).json()["details"]
        return (all(((v.get("watch") or {}).get("pods") or 0) >= 1 for v in details["replicas"].values())
                and details["replica_caches"][lag]["seconds_behind"] == 0)

    eventually(caught_up, 20, what="the pod in every view of the guard, the lag over", process=g)
    assert g.metric("ghost_guard_replica_pods_missing_detections_total") == 0
    assert g.metric("ghost_guard_replica_pods_missing") == 0
    assert g.metric("ghost_guard_replica_frozen") == 0
    assert [e for e in lab.core_v1(0).list_namespaced_event("default", _request_timeout=5).items
            if e.reason == "PodMissingFromReplica"] == []


def test_the_checks_cost_two_small_lists_per_replica_per_revision_interval(lab, start_guard, tmp_path):
    """Counted in the lab's request log, in an idle lab: --frozen-after 6 reads every replica's revision every
    2 s (a consistent read and a resourceVersion=0 read of one name); the default 30 s, every 10 s."""
    g = start(lab, start_guard, tmp_path, "--frozen-after", "6")
    r = lab.replicas[0]
    since = time.time()

    def probes() -> list:
        return [x for x in r.requests(method="GET", path=REVISION_PROBE, since=since)
                if x.query.get("fieldSelector") == "metadata.name=ghost-guard-revision-probe"]

    # Five rounds as they come (not a wall-clock window): each round is one consistent read and one
    # resourceVersion=0 read; the rounds are spaced by the interval.
    eventually(lambda: len([x for x in probes() if "resourceVersion" not in x.query]) >= 6, 30,
               what="six revision rounds on one replica", process=g)
    reads = probes()
    consistent = [x for x in reads if "resourceVersion" not in x.query]
    rounds = [x.time for x in consistent][:6]
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    print(f"\nrevision reads on one replica: {len(reads)} ({len(consistent)} consistent), round gaps "
          + ", ".join(f"{gap:.2f}" for gap in gaps) + " s at a 2 s interval")
    assert all(gap >= 1.5 for gap in gaps), gaps  # never more often than the interval (a 1 s tick, rounded)
    assert 1.8 <= sum(gaps) / len(gaps) <= 3.0, gaps  # about once per interval
    pairs = [x for x in reads if x.time <= rounds[-1]]
    assert len(pairs) in (2 * len(rounds) - 1, 2 * len(rounds))  # two reads per round, nothing else
    assert all(x.source == "cache" and x.status == 200 for x in reads)  # served by the cache, not etcd
    assert g.proc.poll() is None


def test_report_live_names_the_missing_pod_and_the_frozen_replica(lab, tmp_path):
    """``report --live`` looks for 5 s each run: the table run is the real ``python -m guard`` process, run
    while the JSON run goes in-process (tests/clirun.py) on the same lab state; the last run in-process."""
    import json

    from clirun import ghost_guard, ghost_guard_beside_process

    lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
    api = lab.core_v1(0)
    uid = api.create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5).metadata.uid
    assert lab.wait_synced()
    lab.replicas[2].faults.freeze_watch()
    api.create_namespaced_pod("default", pod_manifest("later"), _request_timeout=5)  # etcd moves on
    args = ["report", "--live", "--kubeconfig", lab.kubeconfig(0), "--db", str(tmp_path / "none.db")]

    def first(table) -> None:
        # what is ready first is printed first: the audit store's part while the replicas are still being read
        assert table.stdout.readline() == f"No audit store at {tmp_path / 'none.db'}: ghosts not reported.\n"
        assert table.poll() is None

    table, r = ghost_guard_beside_process(args, ["-o", "json"], first)
    out, err = table.stdout, table.stderr
    assert r.returncode == 1, r.stdout + r.stderr
    caches = {c["replica"]: c for c in json.loads(r.stdout)["replica_caches"]}
    ok, lost, frozen = (replica(lab, i) for i in range(3))
    assert [(m["namespace"], m["name"], m["uid"]) for m in caches[lost]["missing"]] == [("default", "lost", uid)]
    assert (caches[lost]["frozen"], caches[ok]["frozen"], caches[ok]["missing"]) == (False, False, [])
    # the frozen replica lacks "later" too, but it is behind etcd: frozen, not missing
    assert (caches[frozen]["frozen"], caches[frozen]["missing"]) == (True, [])
    assert caches[frozen]["cache_revision"] < caches[frozen]["etcd_revision"]

    assert table.returncode == 1, out + err
    assert "ghost-guard report: waiting 5s to read them again" in err, err  # a line per phase (issue 26, finding 3)
    assert "waiting" not in r.stderr  # quiet with -o json
    assert "  1. `ghost-guard heal default/lost`" in out
    assert f"  2. restart kube-apiserver {frozen}: its watch is frozen" in out

    lab.replicas[2].faults.unfreeze_watch()
    api.patch_namespaced_pod("lost", "default", {"metadata": {"annotations": {"touched": "1"}}}, _request_timeout=5)
    assert lab.wait_synced()
    r = ghost_guard(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "Every replica's cache keeps up with etcd and misses no pending pod."


# The last two tests share one lab and one guard (started after the tests above, so it never runs beside
# theirs): distinct pod names, counters compared with their value at the test's start, faults cleared after.
@pytest.fixture(scope="module")
def health_guard(module_lab, module_guard, tmp_path_factory):
    audit = tmp_path_factory.mktemp("cache-health") / "audit.db"
    return synced(module_guard(["--kubeconfig", module_lab.kubeconfig(0), "--audit-db", str(audit),
                                "--discovery-interval", "5", "--missing-after", "2", "--frozen-after", "3"]))


@pytest.fixture
def shared(mended_module_lab, health_guard):
    return mended_module_lab, health_guard


def test_a_pod_whose_creation_a_replica_lost_is_reported_missing_there_until_it_is_written_again(shared):
    # --frozen-after 3: a revision round every tick (1 s), which the test counts as ticks below
    lab, g = shared
    lost = replica(lab, 1)
    detections = {i: g.metric("ghost_guard_replica_pods_missing_detections_total", replica=replica(lab, i))
                  for i in range(3)}

    def detected(i: int) -> float:  # since the test began (the guard is the module's)
        return g.metric("ghost_guard_replica_pods_missing_detections_total", replica=replica(lab, i)) - detections[i]

    lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
    api = lab.core_v1(0)
    created = time.monotonic()
    uid = api.create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5).metadata.uid

    eventually(lambda: g.metric("ghost_guard_replica_pods_missing", replica=lost) == 1, 30,
               what="the missing-pod gauge", process=g)
    took = time.monotonic() - created
    print(f"\nmissing pod reported {took:.2f}s after its creation (--missing-after 2)")
    assert took >= 2.0  # never before --missing-after
    assert detected(1) == 1
    for other in (0, 2):
        assert g.metric("ghost_guard_replica_pods_missing", replica=replica(lab, other)) == 0
        assert detected(other) == 0
    assert "lost" not in cached_names(lab, 1, "default") and "lost" in cached_names(lab, 0, "default")

    (event,) = eventually(lambda: missing_events(lab, uid), 10, what="the PodMissingFromReplica Event")
    assert event.type == "Warning" and lost in event.message and "ghost-guard heal default/lost" in event.message
    detail = caches(g, lambda d: d[lost]["pods_missing"])
    assert (detail[lost]["pods_missing"], detail[lost]["missing"], detail[lost]["frozen"]) == (
        1, [f"default/lost ({uid})"], False)
    assert all(detail[replica(lab, i)]["pods_missing"] == 0 for i in (0, 2))
    # three more ticks (counted by their revision reads): still one detection, one Event (deduplicated), count 1
    since = time.time()
    eventually(lambda: revision_rounds(lab, since) >= 3, 20, what="three more ticks", process=g)
    assert detected(1) == 1
    (event,) = missing_events(lab, uid)
    assert event.count == 1

    # One write to the pod reaches every cache whose watch flows (what `ghost-guard heal` does):
    # replica 2 stores it, its watchers see it ADDED, the guard sees it there.
    api.patch_namespaced_pod("lost", "default", {"metadata": {"annotations": {"touched": "1"}}}, _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_replica_pods_missing", replica=lost) == 0, 20,
               what="the gauge to clear", process=g)
    assert "lost" in cached_names(lab, 1, "default")
    assert g.metric("ghost_guard_replica_frozen") == 0


def test_a_frozen_replica_is_named_and_a_thawed_one_cleared(shared):
    # The module's shared guard: --frozen-after 3 reads revisions every tick (1 s); its --missing-after 2 is the
    # missing-pod test's (test_a_replica_that_lags_past_missing_after_is_not_blamed proves a cache behind etcd is
    # not called missing)
    lab, g = shared
    frozen = replica(lab, 2)
    detections = g.metric("ghost_guard_replica_pods_missing_detections_total")
    logged = len(g.logs(tail=None))
    lab.replicas[2].faults.freeze_watch()
    froze = time.monotonic()
    api = lab.core_v1(0)
    for i in range(3):  # etcd moves on
        api.create_namespaced_pod("default", pod_manifest(f"after-{i}"), _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_replica_frozen", replica=frozen) == 1, 30,
               what="the frozen gauge", process=g)
    took = time.monotonic() - froze
    print(f"\nfrozen replica named {took:.2f}s after its watch froze (--frozen-after 3)")
    assert took >= 3.0
    for other in (0, 1):
        assert g.metric("ghost_guard_replica_frozen", replica=replica(lab, other)) == 0
        assert g.metric("ghost_guard_replica_seconds_behind", replica=replica(lab, other)) == 0
    assert g.metric("ghost_guard_replica_seconds_behind", replica=frozen) >= 3
    # Its pods are behind, not missing: a frozen cache has not reached their revision.
    assert g.metric("ghost_guard_replica_pods_missing_detections_total") == detections
    detail = caches(g, lambda d: d[frozen]["frozen"])
    assert detail[frozen]["frozen"] is True and detail[frozen]["cache_revision"] < lab.revision()
    # written just after the state /readyz shows (the lock released first): waited for, in the whole log (its
    # default 8,000-character tail, cut at the length before, showed nothing once the log had grown)
    eventually(lambda: "watch is frozen" in g.logs(tail=None)[logged:], 10, what="the frozen replica logged", process=g)

    lab.replicas[2].faults.unfreeze_watch()
    eventually(lambda: g.metric("ghost_guard_replica_frozen", replica=frozen) == 0, 20,
               what="the frozen gauge to clear", process=g)
    eventually(lambda: g.metric("ghost_guard_replica_seconds_behind", replica=frozen) == 0, 10,
               what="seconds behind to clear", process=g)
    assert g.metric("ghost_guard_replica_pods_missing_detections_total") == detections
