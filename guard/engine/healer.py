"""``ghost-guard heal``: correct stale watch caches by writing to the ghost's name, without restarting anything.

The plan (what to write, when it worked) is :mod:`guard.core.heal_plan`; this module reads and writes
through :mod:`guard.kube.reads` and :mod:`guard.kube.writes`:

1. every replica's cache for the name (LIST ``resourceVersion=0``), then the quorum GET (it
   begins after the replicas were read: a UID is condemned only by a read that began after it
   was seen);
2. the write: a placeholder create (then, whatever happens, its delete with a UID precondition
   in a ``finally``: errors, timeouts and Ctrl-C included; a create interrupted before its answer, or
   never answered, is found under the name by its created-at and deleted), or one annotation patch with a
   resourceVersion precondition;
3. polling each replica's cache until it agrees with etcd or ``timeout`` runs out; a replica
   whose cache revision stayed below the heal's own write is *frozen*.

AlreadyExists or Conflict (the name changed under us) re-reads and re-plans, at most
``heal_plan.MAX_ATTEMPTS`` times. A pod etcd has pending that every replica serves is never touched.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence

from guard.core import heal_plan
from guard.core.heal_plan import Action, CacheView, HealResult, Outcome, Plan, ReplicaResult
from guard.engine.background import Background
from guard.kube.reads import Kube
from guard.kube.watch import ReplicaClient
from guard.kube.writes import KubeWriteError
from guard.core.names import pod_identity_problem
from guard.core.verdict import QuorumRead, ReadStatus, pending_in_etcd

log = logging.getLogger("guard.heal")

REFUSED_STATUSES = (400, 403, 422)  # admission (webhooks, Pod Security, quota), policy, validation
UNREADABLE_READS = 3  # failed reads in a row before a heal's wait gives up on a replica (its own read timeout each)


class _Replan(Exception):
    """The name changed between the quorum read and the write: read again and plan again."""


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _etcd_text(read: QuorumRead) -> str:
    if read.status is ReadStatus.NOT_FOUND:
        return "no pod under this name (404)"
    if read.status is ReadStatus.ERROR:
        return f"unreadable: {read.error}"
    state = f"bound to {read.node_name}" if read.node_name else "pending"
    if read.deletion_timestamp:
        state += ", terminating"
    return f"uid {read.uid} {state} (rv {read.resource_version})"


class Healer:
    """Heals one pod name at a time. ``replicas``: the replica clients, or a function returning them
    (the guard's pool). ``timeout``: seconds per name, from the first read to the last check."""

    def __init__(self, kube: Kube, replicas: Sequence[ReplicaClient] | Callable[[], Sequence[ReplicaClient]], *,
                 timeout: float = 10.0, poll: float = 0.02, progress: Callable[[str], None] | None = None) -> None:
        self.kube = kube
        # One line per phase of a heal (the CLI prints them on stderr while it waits; quiet with -o json).
        self.progress = progress or (lambda line: None)
        self._replicas = replicas if callable(replicas) else (lambda: list(replicas))
        self.timeout = timeout
        self.poll = poll
        self._bg = Background()
        self._pool = self._bg.pool("heal-read", 8)

    def close(self) -> None:
        self._bg.close()

    # --- reads ------------------------------------------------------------------------------------

    def _observe(self, clients: Sequence[ReplicaClient], namespace: str, name: str) -> list[CacheView]:
        def one(c: ReplicaClient) -> CacheView:
            items, rv, error = c.read_cache(namespace, name)
            return CacheView.of(c.replica.address, items, rv, error)

        return list(self._pool.map(one, clients))

    def _wait(self, clients: Sequence[ReplicaClient], namespace: str, name: str, done: Callable[[CacheView], bool],
              deadline: float, since: float, first_ok: dict[str, float]) -> list[CacheView]:
        """Poll every replica until each is ``done`` or ``deadline``; note when each first was.

        A replica whose read fails is read again: it is given up on (left unreadable in the answer) only after
        ``UNREADABLE_READS`` failed reads in a row, so one read timing out under load does not fail a heal that
        every replica followed."""
        failed: dict[str, int] = {}
        while True:
            views = self._observe(clients, namespace, name)
            now = time.monotonic()
            for v in views:
                if done(v):
                    first_ok.setdefault(v.replica, now - since)
                failed[v.replica] = 0 if v.reachable else failed.get(v.replica, 0) + 1
            if all(done(v) if v.reachable else failed[v.replica] >= UNREADABLE_READS for v in views) or now >= deadline:
                return views
            time.sleep(min(self.poll, max(0.0, deadline - now)))

    # --- one name ---------------------------------------------------------------------------------

    def heal(self, namespace: str, name: str, *, dry_run: bool = False) -> HealResult:
        start = time.monotonic()
        deadline = start + self.timeout
        problem = pod_identity_problem(namespace, name, "")
        if problem is not None:  # no read, no selector, no placeholder from a name the apiserver would refuse
            return HealResult(namespace, name, Action.NONE, Outcome.FAILED, f"invalid pod identity: {problem}; "
                              "nothing read or written", time.monotonic() - start, etcd="not read")
        clients = list(self._replicas())
        if not clients:
            return HealResult(namespace, name, Action.NONE, Outcome.FAILED,
                              "no apiserver replica known (discovery found none): nothing checked, nothing written",
                              time.monotonic() - start, etcd="not read")
        self.progress(f"{namespace}/{name}: reading {len(clients)} replica cache(s) and etcd (quorum GET)")
        before = self._observe(clients, namespace, name)
        views = before
        read = QuorumRead.failed("not read")
        for attempt in range(heal_plan.MAX_ATTEMPTS):
            if attempt:
                views = self._observe(clients, namespace, name)
            read = self.kube.quorum_get(namespace, name, timeout=max(0.1, deadline - time.monotonic()))
            p = heal_plan.plan(read, views)
            if p.outcome is not None or dry_run:
                detail = p.reason if not dry_run or p.action is Action.NONE else f"dry run: would {p.action}: {p.reason}"
                unreadable = [v.replica for v in views if not v.reachable]
                outcome = p.outcome or Outcome.FAILED
                if unreadable and outcome in (Outcome.HEALED, Outcome.ALIVE):
                    outcome = Outcome.FAILED
                    detail += f"; but {', '.join(unreadable)} could not be read"
                return self._result(namespace, name, p.action, outcome, detail, start, 0, p, read,
                                    before, views, {}, (), dry_run=dry_run)
            try:
                if p.action is Action.PLACEHOLDER:
                    return self._placeholder(clients, namespace, name, read, p, before, start, deadline)
                return self._annotate(clients, namespace, name, read, p, before, start, deadline)
            except _Replan as e:
                log.info("heal %s/%s: %s; reading again", namespace, name, e)
                continue
        return self._result(namespace, name, Action.NONE, Outcome.FAILED,
                            f"the name changed under every one of {heal_plan.MAX_ATTEMPTS} attempts; nothing left behind",
                            start, 0, None, read, before, views, {}, ())

    def _placeholder(self, clients, namespace: str, name: str, read: QuorumRead, p: Plan, before, start: float,
                     deadline: float) -> HealResult:
        at = _now_iso()
        body = heal_plan.placeholder_pod(name, p.ghosts, at=at)
        writes = 0
        uid, write_rv = "", 0
        delete_error = None
        unanswered = True  # the create may have happened and we do not know its UID: find it by its created-at
        try:  # from the create on, whatever happens (Ctrl-C included, its answer still on the way), no placeholder stays
            try:
                created = self.kube.create_pod(namespace, body, timeout=max(0.1, min(self.kube.timeout * 5, deadline - time.monotonic())))
            except KubeWriteError as e:
                unanswered = e.status == 0  # an answer: nothing was created
                if e.status == 409 and e.reason == "AlreadyExists":
                    raise _Replan(f"a pod was created under the name meanwhile ({e.message})") from e
                outcome = Outcome.REFUSED if e.status in REFUSED_STATUSES else Outcome.FAILED
                return self._result(namespace, name, Action.PLACEHOLDER, outcome,
                                    f"the apiserver {'refused' if outcome is Outcome.REFUSED else 'did not take'} the "
                                    f"placeholder: {e}; nothing left behind", start, 0, p, read, before,
                                    before, {}, ())
            writes += 1
            meta = created.get("metadata") or {}
            uid, write_rv = str(meta.get("uid") or ""), int(meta.get("resourceVersion") or 0)
            unanswered = not uid
            written = time.monotonic()
            self.progress(f"{namespace}/{name}: placeholder uid {uid} created (rv {write_rv}); waiting up to "
                          f"{max(0.0, deadline - written) / 2:.0f}s for every replica's cache to show it")
            # every reachable replica shows the placeholder (or its cache is already past it); a frozen one never
            # will, so this wait takes at most half of what is left: the delete and its wait get the rest
            self._wait(clients, namespace, name,
                       lambda v: heal_plan.shows(v, uid) or (v.reachable and v.revision is not None and v.revision >= write_rv),
                       min(deadline, written + max(0.0, deadline - written) / 2), written, {})
        finally:
            if uid:
                delete_error = self._delete_placeholder(namespace, name, uid)
                writes += 1
            elif unanswered:
                self._remove_unanswered(namespace, name, at)
        first_ok: dict[str, float] = {}
        bad = set(p.ghosts) | {uid}
        self.progress(f"{namespace}/{name}: placeholder deleted; waiting up to {max(0.0, deadline - time.monotonic()):.0f}s "
                      "for every replica's cache to drop the ghost (a frozen one never does)")
        views = self._wait(clients, namespace, name, lambda v: v.reachable and not any(c.uid in bad for c in v.copies),
                           deadline, written, first_ok)
        frozen = tuple(v.replica for v in views if heal_plan.behind(v, write_rv) and any(c.uid in bad for c in v.copies))
        if delete_error:
            return self._result(namespace, name, Action.PLACEHOLDER, Outcome.FAILED,
                                f"placeholder uid {uid} could NOT be deleted ({delete_error}): delete it with "
                                f"`kubectl delete pod -n {namespace} {name}` once it is the only pod under the name",
                                start, writes, p, read, before, views, first_ok, frozen)
        return self._finish(namespace, name, Action.PLACEHOLDER, start, writes, p, read, before, views, first_ok, frozen,
                            lambda v: v.reachable and not any(c.uid in bad for c in v.copies),
                            f"placeholder uid {uid} created (rv {write_rv}) and deleted")

    def _delete_placeholder(self, namespace: str, name: str, uid: str) -> str | None:
        """Delete our placeholder by UID; a few tries on errors without an answer. None when it is gone."""
        last = ""
        for attempt in range(3):
            try:
                self.kube.delete_pod(namespace, name, uid, timeout=self.kube.timeout * 5)
                return None
            except KubeWriteError as e:
                if e.status == 404 or (e.status == 409 and "UID" in e.message):
                    return None  # gone already, or the name holds another pod now: ours is gone
                last = str(e)
                if e.status and e.status < 500 and e.status != 429:
                    break
            time.sleep(0.1 * (attempt + 1))
        log.error("heal %s/%s: placeholder uid %s could not be deleted: %s", namespace, name, uid, last)
        return last

    def _remove_unanswered(self, namespace: str, name: str, at: str) -> None:
        """After a create got no answer: delete the pod under the name if it is this placeholder."""
        for _ in range(3):
            try:
                pod = self.kube.read_pod(namespace, name, timeout=self.kube.timeout * 5)
            except KubeWriteError as e:
                if e.status == 404:
                    return
                time.sleep(0.2)
                continue
            meta = pod.get("metadata") or {}
            if (meta.get("annotations") or {}).get(f"{heal_plan.DOMAIN}/created-at") == at and \
                    (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == heal_plan.MANAGED_BY:
                self._delete_placeholder(namespace, name, str(meta.get("uid") or ""))
            return

    def _annotate(self, clients, namespace: str, name: str, read: QuorumRead, p: Plan, before, start: float,
                  deadline: float) -> HealResult:
        patch = heal_plan.annotation_patch(read.resource_version, p.ghosts, at=_now_iso())
        try:
            patched = self.kube.merge_patch_pod(namespace, name, patch,
                                                timeout=max(0.1, min(self.kube.timeout * 5, deadline - time.monotonic())))
        except KubeWriteError as e:
            if e.status in (404, 409):
                raise _Replan(f"the pod changed meanwhile ({e})") from e
            outcome = Outcome.REFUSED if e.status in REFUSED_STATUSES else Outcome.FAILED
            return self._result(namespace, name, Action.ANNOTATE, outcome, f"the annotation patch failed: {e}",
                                start, 0, p, read, before, before, {}, ())
        meta, spec = patched.get("metadata") or {}, patched.get("spec") or {}
        write_rv = int(meta.get("resourceVersion") or 0)
        fresh = QuorumRead.found(str(meta.get("uid") or ""), node_name=str(spec.get("nodeName") or ""),
                                 deletion_timestamp=str(meta.get("deletionTimestamp") or ""), resource_version=str(write_rv))
        written = time.monotonic()
        first_ok: dict[str, float] = {}
        self.progress(f"{namespace}/{name}: annotated uid {fresh.uid} (rv {write_rv}); waiting up to "
                      f"{max(0.0, deadline - written):.0f}s for every replica's cache to show it (a frozen one never does)")

        def done(v: CacheView) -> bool:
            return heal_plan.shows_live(v, fresh, write_rv)

        views = self._wait(clients, namespace, name, done, deadline, written, first_ok)
        frozen = tuple(v.replica for v in views if heal_plan.behind(v, write_rv))
        return self._finish(namespace, name, Action.ANNOTATE, start, 1, p, fresh, before, views, first_ok, frozen, done,
                            f"annotated uid {fresh.uid} (rv {read.resource_version} -> {write_rv})", etcd_read=read)

    def _finish(self, namespace, name, action, start, writes, p, read, before, views, first_ok, frozen, done, what,
                etcd_read: QuorumRead | None = None) -> HealResult:
        unreadable = [v for v in views if not v.reachable]
        lagging = [v.replica for v in views if v.reachable and not done(v) and v.replica not in frozen]
        if frozen:
            outcome = Outcome.FROZEN
            detail = (f"{what}; replica(s) {', '.join(frozen)} did not follow: cache revision stayed below the "
                      "heal's write while etcd moved past it (watch frozen)")
        elif lagging:
            outcome = Outcome.TIMEOUT if time.monotonic() - start >= self.timeout else Outcome.FAILED
            detail = (f"{what}; replica(s) {', '.join(lagging)} still disagree with etcd after {self.timeout:g}s "
                      "although their caches moved past the write")
        elif unreadable:
            outcome = Outcome.FAILED
            detail = f"{what}; every readable replica agrees, but {', '.join(v.replica for v in unreadable)} could not be read"
        else:
            outcome = Outcome.HEALED
            detail = f"{what}; every replica agrees with etcd"
        return self._result(namespace, name, action, outcome, detail, start, writes, p, etcd_read or read, before, views,
                            first_ok, frozen, done=done)

    def _result(self, namespace, name, action, outcome, detail, start, writes, p: Plan | None, read, before, after,
                first_ok, frozen, *, done=None, dry_run: bool = False) -> HealResult:
        after_by = {v.replica: v for v in after}
        rows = []
        for b in before:
            a = after_by.get(b.replica, b)
            if done is not None:
                agrees = None if not a.reachable else bool(done(a))
            else:
                agrees = None if not a.reachable or read.status is ReadStatus.ERROR else heal_plan.disagreement(a, read) is None
            rows.append(ReplicaResult(b.replica, b.describe(), a.describe(), agrees, first_ok.get(b.replica),
                                      b.replica in frozen))
        advice = heal_plan.frozen_advice(frozen, namespace, name) if frozen else ""
        return HealResult(namespace, name, action, outcome, detail, time.monotonic() - start, writes,
                          p.ghosts if p else (), _etcd_text(read), tuple(rows), advice, dry_run)

    # --- every ghost ------------------------------------------------------------------------------

    def ghosts(self) -> tuple[list[tuple[str, str]], list[str]]:
        """Names some replica serves as pending under a UID etcd does not have pending: (names, errors).

        The replicas are listed first, etcd asked after (a UID is condemned only by a quorum read
        that began after it was seen)."""
        served: dict[tuple[str, str], set[str]] = {}
        errors = []
        for c in self._replicas():
            try:
                _, items = c.pending_pods()
            except Exception as e:  # noqa: BLE001 - one replica's trouble is reported, the others still count
                errors.append(f"{c.replica.address}: {type(e).__name__}: {str(e)[:200]}")
                continue
            for item in items:
                meta = item.get("metadata") or {}
                if (item.get("spec") or {}).get("nodeName") or meta.get("deletionTimestamp"):
                    continue
                served.setdefault((str(meta.get("namespace")), str(meta.get("name"))), set()).add(str(meta.get("uid")))
        out = []
        for (ns, name), uids in sorted(served.items()):
            read = self.kube.quorum_get(ns, name)
            if read.status is ReadStatus.ERROR:
                errors.append(f"{ns}/{name}: quorum read failed: {read.error}")
                continue
            if any(not pending_in_etcd(read, uid) for uid in uids):
                out.append((ns, name))
        return out, errors
