"""``ghost-guard demo --kube-bin DIR``: the seed incident on real Kubernetes, then the guard, then ``heal``.

1. real etcd and 2 real kube-apiserver replicas (each behind its etcd fault proxy); Nodes ``node-a``
   and ``node-b``; Pod ``default/web-1`` created, replica 1's proxy drops its deletion, deleted: a
   quorum GET answers 404 while replica 1's watch cache still serves it Pending (a ghost);
2. **without the guard**: the real kube-scheduler, reading replica 1, loops on the ghost: its binding
   404s are counted from replica 1's ``apiserver_request_total{resource="pods",subresource="binding",code="404"}``,
   while a live pod still schedules;
3. **with the guard**: ``ghost-guard serve`` (HTTPS, mTLS, ``ghost-guard certs`` files) and kube-scheduler
   restarted with the product's KubeSchedulerConfiguration pointing at it: the ghost is rejected on
   every node (each new Node makes the scheduler try it again), no binding 404;
4. **heal**: ``ghost-guard heal default/web-1`` (the product command, as a process) replaces the stale
   copy in replica 1's cache: the ghost is gone from it, and replica 1 was not restarted.

Each phase lasts ``seconds`` and at least until it shows its point: the first until two binding 404s
(or two minutes), the second until one new Node made the scheduler try the ghost again
(``seconds=0``: just that; the test suite runs it so).

Returns 0 only when all of that holds (at least two binding 404s without the guard, at most one
with it, both live pods bound, replica 1 healed in place), 1 otherwise, 2 if the demo could not run.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from guard.lab.harness import GuardProcess, NotReached, create, eventually, make_ghost, node_manifest, pod_manifest
from guard.lab.real.binaries import KubeBinaries
from guard.lab.real.controlplane import RealLab

__all__ = ["run_real_demo"]

STALE = 1  # replica 1 (127.0.0.2, kubeconfig-1)
GHOST = ("default", "web-1")


def _bound(lab: RealLab, name: str) -> str:
    return lab.core_v1(0).read_namespaced_pod(name, "default", _request_timeout=10).spec.node_name or ""


def run_real_demo(binaries: KubeBinaries, out: IO[str] = sys.stdout, *, seconds: float = 10.0,
                  lab: RealLab | None = None) -> int:
    """Run the incident on real Kubernetes without, then with the guard, then heal; print a table.

    ``lab``: a started 2-replica RealLab (each replica behind its fault proxy, no scheduler) to run on
    instead of starting one, left running (the test suite shares one; the demo uses ``default/web-*``
    and Nodes ``node-a``, ``node-b``, ``node-extra-*``)."""
    started = time.monotonic()
    guards: list[GuardProcess] = []

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    try:
        with tempfile.TemporaryDirectory(prefix="ghost-guard-demo-") as tmp:
            if lab is None:
                say(f"ghost-guard demo (real Kubernetes from {binaries.dir}): starting etcd and 2 kube-apiserver replicas ...")
            with contextlib.nullcontext(lab) if lab is not None else RealLab(replicas=2, kube_bin=binaries) as real:
                try:
                    ok = _scenario(real, Path(tmp), say, seconds, guards)
                except Exception as e:  # noqa: BLE001 (NotReached is an AssertionError) - the demo reports, never tracebacks at the user
                    say(f"\ndemo failed: {type(e).__name__}: {e}")
                    if guards:
                        say("guard log (tail):\n" + guards[0].logs()[-2000:])
                    say(real.logs(10))
                    return 2
                finally:
                    for g in guards:
                        g.stop()
    except Exception as e:  # noqa: BLE001 - the control plane could not start or stop
        say(f"\ndemo failed: {type(e).__name__}: {e}")
        return 2
    elapsed = time.monotonic() - started
    if ok:
        say(f"\nThe guard broke the real kube-scheduler's loop and heal cleared the stale cache in place ({elapsed:.0f} s).")
        return 0
    say(f"\nThe loop was NOT broken or the cache NOT healed ({elapsed:.0f} s).")
    return 1


def _scenario(lab: RealLab, workdir: Path, say: Callable[[str], None], seconds: float,
              guards: list[GuardProcess]) -> bool:
    from guard.lab.demo import heal_phase, say_table, start_guard_process

    ns, name = GHOST
    say(f"  replicas: {', '.join(lab.urls)} (kube-apiserver, each through its own etcd fault proxy)")
    for node in ("node-a", "node-b"):
        create(lab.core_v1(0), node_manifest(node))
    uid = make_ghost(lab, ns, name, stale=STALE, timeout=60)
    lab.replicas[STALE].faults.clear()  # one lost delete; the watch flows on
    say(f"  {ns}/{name} (uid {uid}) deleted; replica 1 ({lab.urls[STALE]}) lost the deletion:")
    say("    quorum GET -> 404 NotFound;  replica 1's cache (resourceVersion=0) -> still Pending")

    say(f"\n[1/3] the real kube-scheduler reading replica 1, no extender, {seconds:.0f} s:")
    base = lab.binding_404s(STALE)
    lab.start_scheduler(None, replica=STALE)
    try:
        create(lab.core_v1(0), pod_manifest("web-2"))
        eventually(lambda: _bound(lab, "web-2"), 120, what="web-2 bound")
        # for ``seconds``, and at least until the loop shows (two binding 404s; bounded)
        end = time.monotonic() + seconds
        try:
            eventually(lambda: time.monotonic() >= end and lab.binding_404s(STALE) - base >= 2, seconds + 120,
                       what="two binding 404s for the ghost", interval=0.5)
        except NotReached:
            pass  # no loop: the table shows it and the demo fails (1)
        before = lab.binding_404s(STALE) - base
    finally:
        lab.stop_scheduler()
    live_before = _bound(lab, "web-2")
    say(f"      binding 404s for the ghost: {before:.0f} (replica 1's apiserver_request_total)")

    say("\n[2/3] ghost-guard serve (HTTPS, mTLS) registered through the product's KubeSchedulerConfiguration")
    guard = start_guard_process(lab.kubeconfig(0), workdir, ["--apiserver-replicas", ",".join(lab.urls)],
                                scaled=False, timeout=120.0)
    guards.append(guard)
    base = lab.binding_404s(STALE)
    lab.start_scheduler(guard.extender(), replica=STALE)

    def verdicts() -> float:
        return guard.metric("ghost_guard_verdicts_total", verdict="ghost-deleted")

    try:
        create(lab.core_v1(0), pod_manifest("web-3"))
        eventually(lambda: _bound(lab, "web-3"), 120, what="web-3 bound", process=guard)
        eventually(lambda: verdicts() >= 1, 120, what="the ghost blocked by the guard", process=guard)
        end = time.monotonic() + seconds
        k = 0
        while k == 0 or time.monotonic() < end:  # new Nodes (at least one): each makes kube-scheduler try the ghost again
            seen = verdicts()
            create(lab.core_v1(0), node_manifest(f"node-extra-{k}"))
            k += 1
            eventually(lambda: verdicts() > seen, 60, what="the ghost tried again", process=guard)
        after = lab.binding_404s(STALE) - base
        blocked = verdicts()
    finally:
        lab.stop_scheduler()
    live_after = _bound(lab, "web-3")
    incident = [r.get("msg", "") for r in guard.log_records("guard.incident")]
    if incident:
        say("      guard: " + incident[0])

    say(f"\n[3/3] ghost-guard heal {ns}/{name} (no restart):")
    healed, same_process = heal_phase(lab, lab.kubeconfig(0), lab.urls, ns, name, STALE, say,
                                      lambda: (lab.replicas[STALE].pid, lab.replicas[STALE].running))
    say_table(say, [
        ("ghost binding 404s", f"{before:.0f}", f"{after:.0f}"),
        ("guard ghost verdicts", "-", f"{blocked:.0f}"),
        ("live pod bound", f"web-2 -> {live_before or 'NO'}", f"web-3 -> {live_after or 'NO'}"),
    ])
    say("  binding 404s: kube-scheduler's Binding POSTs for the ghost, answered 404 (etcd has no such pod);\n"
        "  verdicts: the guard's ghost-deleted answers (the ghost rejected on every node); live pod: a new pod, placed.")
    say(f"  after heal: replica 1 serves {ns}/{name}: {'no' if healed else 'YES'}; "
        f"replica 1 restarted: {'no' if same_process else 'YES'}")
    return before >= 2 and after <= 1 and bool(live_before) and bool(live_after) and healed and same_process
