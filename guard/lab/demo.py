"""``ghost-guard demo``: the seed incident end to end, then the same with the guard.

Everything runs on this machine and is cleaned up on exit:

1. a lab (real etcd + 3 apiserver replicas with watch caches); nodes ``node-a``
   and ``node-b``;
2. Pod ``default/web-1`` is created Pending, replica 1 (``lab.replicas[1]``) is
   told to drop its deletion, and the pod is deleted: the quorum GET answers
   404 while replica 1's watch cache still serves it Pending (a ghost);
3. **without the guard**: a scheduler simulator whose informer reads replica 1
   loops on the ghost (every Binding POST answers 404), while a live pod still
   schedules;
4. **with the guard**: ``ghost-guard serve`` starts as a child process over
   HTTPS with mTLS (certificates from :mod:`guard.tools.certs`), and a new scheduler
   on replica 1 registers it as extender (``filter`` + ``preempt`` verbs,
   ``nodeCacheCapable``): the ghost is rejected on every node, the loop stops;
5. **heal**: ``ghost-guard heal default/web-1`` (the product command, as a process)
   replaces the stale copy in replica 1's cache, which no longer serves the ghost,
   and replica 1 is not restarted.

:func:`run_demo` prints a before/after table (each row explained) and returns 0
only if the guard broke the loop (at most one failed bind with the guard, several
without, and the live pods bound in both phases) and heal emptied the stale cache
in place.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from guard.lab.harness import GuardProcess, create, make_ghost, node_manifest, pod_manifest, tls_files
from guard.lab.scheduler import PodStats, Scheduler, Timings

__all__ = ["DEMO_TIMINGS", "heal_phase", "run_demo", "say_table", "start_guard_process"]

# Fast but shaped like the real ones (1 s -> 10 s backoff, 1 s flush), scaled down 10x.
DEMO_TIMINGS = Timings(
    pod_initial_backoff=0.1,
    pod_max_backoff=1.0,
    backoff_flush_period=0.1,
    pod_max_in_unschedulable=30.0,
    unschedulable_flush_period=3.0,
    request_timeout=5.0,
    retry_period=0.2,
)

PHASE_SECONDS = 6.0


def start_guard_process(kubeconfig: str, workdir: Path, extra_args: list[str] | None = None, *,
                        scaled: bool = True, timeout: float = 30.0) -> GuardProcess:
    """Write certificates into ``workdir`` (guard.tools.certs) and start ``ghost-guard serve`` over HTTPS with
    mTLS, none of the caller's ``GHOST_GUARD_*``, its logs and audit DB in ``workdir``; waits for /readyz.
    ``scaled``: the guard's windows scaled to the simulator's 10x faster backoff (False: the real
    kube-scheduler's, i.e. the guard's defaults)."""
    from guard.tools import certs as guard_certs

    bundle = guard_certs.generate(workdir / "certs", ips=["127.0.0.1"])
    # The demo's scheduler backs off 10x faster than kube-scheduler (0.1 s, not 1 s):
    # scale the guard's windows that are sized below that backoff the same way.
    scale = ["--prepared-grace", "0.05", "--alive-ttl", "0.05"] if scaled else []
    guard = GuardProcess([
        "--kubeconfig", kubeconfig,
        "--no-access-log",
        "--audit-db", str(workdir / "audit.db"),
        "--stale-confirm-delay", "0.5",
        *scale,
        *(extra_args or []),
    ], tls=tls_files(bundle), clean_env=True, logdir=workdir)
    try:
        guard.wait("/readyz", timeout=timeout)
    except BaseException:
        guard.stop()
        raise
    return guard


def _phase(lab: Any, scheduler: Scheduler, live: str, out: IO[str], seconds: float) -> PodStats:
    create(lab.core_v1(0), pod_manifest(live))
    scheduler.wait_for(lambda s: bool(s.get(f"default/{live}", PodStats()).bound_node), timeout=seconds)
    deadline = time.monotonic() + seconds
    tty = out.isatty()
    shown = -1
    ghost = PodStats()
    while time.monotonic() < deadline:
        ghost = scheduler.stats().get("default/web-1", PodStats())
        if tty and ghost.bind_failures_total != shown:
            shown = ghost.bind_failures_total
            out.write(f"\r      ghost default/web-1: {ghost.attempts} scheduling attempts, {shown} failed binds   ")
            out.flush()
        time.sleep(0.1)
    if not tty:
        out.write(f"      ghost default/web-1: {ghost.attempts} scheduling attempts, {ghost.bind_failures_total} failed binds")
    out.write("\n")
    return scheduler.stats().get(f"default/{live}", PodStats())


def run_demo(out: IO[str] = sys.stdout, *, seconds: float = PHASE_SECONDS) -> int:
    """Run the incident without then with the guard; print a before/after table.

    Returns 0 only if the guard broke the loop, 1 if it did not, 2 if the demo
    could not run. Leaves no process behind.
    """
    from guard.lab import Lab

    started = time.monotonic()
    guards: list[GuardProcess] = []

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def failed(e: Exception) -> int:
        say(f"\ndemo failed: {type(e).__name__}: {e}")
        return 2

    try:
        with tempfile.TemporaryDirectory(prefix="ghost-guard-demo-") as tmp, Lab(replicas=3) as lab:
            try:
                broke = _scenario(lab, Path(tmp), say, out, seconds, guards)
            except Exception as e:  # noqa: BLE001 - the demo reports, never tracebacks at the user
                code = failed(e)
                if guards:  # read while the work directory (and the log in it) still exists
                    say("guard log (tail):\n" + guards[0].logs()[-2000:])
                return code
            finally:
                for guard in guards:
                    guard.stop()
            if not broke and guards:
                say("guard log (tail):\n" + guards[0].logs()[-2000:])
    except Exception as e:  # noqa: BLE001 - the lab could not start or stop
        return failed(e)
    elapsed = time.monotonic() - started
    if broke:
        say("\nThe guard broke the loop: the ghost is rejected on every node, live pods still schedule; heal cleared "
            f"replica 1's stale cache without a restart ({elapsed:.0f} s).")
        return 0
    say(f"\nThe loop was NOT broken or the cache NOT healed ({elapsed:.0f} s).")
    return 1


def _scenario(lab: Any, workdir: Path, say: Callable[[str], None], out: IO[str], seconds: float,
              guards: list[GuardProcess]) -> bool:
    say("ghost-guard demo: a Pod deleted in etcd, still served by one apiserver replica's watch cache")
    say(f"  lab: etcd + 3 apiserver replicas: {', '.join(r.url for r in lab.replicas)}")
    api = lab.core_v1(0)
    for name in ("node-a", "node-b"):
        create(api, node_manifest(name))
    uid = make_ghost(lab, "default", "web-1", stale=1)
    say(f"  default/web-1 (uid {uid}) deleted; replica 1 ({lab.replicas[1].url}) dropped the deletion:")
    say("    quorum GET -> 404 NotFound;  replica 1's cache (resourceVersion=0) -> still Pending")

    say(f"\n[1/3] kube-scheduler (simulated) reading replica 1, no extender, {seconds:.0f} s:")
    with Scheduler(lab.kubeconfig(1), timings=DEMO_TIMINGS) as scheduler:
        live_before = _phase(lab, scheduler, "web-2", out, seconds)
        before = scheduler.stats().get("default/web-1", PodStats())

    say("\n[2/3] ghost-guard serve (HTTPS, mTLS) registered as extender: filter + preempt verbs")
    guard = start_guard_process(lab.kubeconfig(0), workdir)
    guards.append(guard)
    say(f"      guard ready at {guard.base}; scheduler restarted on replica 1 (the ghost is listed again)")
    with Scheduler(lab.kubeconfig(1), extenders=[guard.extender()], timings=DEMO_TIMINGS) as scheduler:
        live_after = _phase(lab, scheduler, "web-3", out, seconds)
        after = scheduler.stats().get("default/web-1", PodStats())

    incident = [r.get("msg", "") for r in guard.log_records("guard.incident")]
    if incident:
        say("      guard: " + incident[0])

    say("\n[3/3] ghost-guard heal default/web-1 (no restart):")
    lab.replicas[1].faults.clear()  # one lost delete; the watch flows on
    healed, same_process = heal_phase(lab, lab.kubeconfig(0), [r.url for r in lab.replicas], "default", "web-1", 1,
                                      say, lambda: lab.replicas[1].cache)
    say_table(say, [
        ("ghost scheduling attempts", before.attempts, after.attempts),
        ("ghost failed binds (404)", before.bind_failures.get(404, 0), after.bind_failures.get(404, 0)),
        ("ghost status patches (404)", before.status_patch_failures.get(404, 0), after.status_patch_failures.get(404, 0)),
        ("extender filter calls", "-", after.filter_calls),
        ("live pod bound", f"web-2 -> {live_before.bound_node or 'NO'}", f"web-3 -> {live_after.bound_node or 'NO'}"),
    ])
    say("  attempts: times the scheduler took the ghost from its queue; failed binds: its Binding POSTs, answered 404\n"
        "  (etcd has no such pod); status patches: its \"cannot schedule\" condition writes, refused the same way;\n"
        "  filter calls: the guard's /filter answers (the ghost rejected on every node); live pod: a new pod, placed.")
    say(f"  after heal: replica 1 serves default/web-1: {'no' if healed else 'YES'}; "
        f"replica 1 restarted: {'no' if same_process else 'YES'}")
    return (before.bind_failures_total >= 2 and after.bind_failures_total <= 1
            and bool(live_before.bound_node) and bool(live_after.bound_node) and healed and same_process)


def heal_phase(lab: Any, kubeconfig: str, urls: list[str], namespace: str, name: str, stale: int,
               say: Callable[[str], None], instance: Callable[[], object]) -> tuple[bool, bool]:
    """Run ``ghost-guard heal NAMESPACE/NAME`` (a process, as an operator would) on every replica and show its
    output. Returns (replica ``stale``'s cache no longer serves the pod after heal's exit 0, ``instance()``
    -- the replica's process or cache -- is the one from before: no restart)."""
    before = instance()
    heal = subprocess.run([sys.executable, "-m", "guard", "heal", f"{namespace}/{name}", "--kubeconfig", kubeconfig,
                           "--apiserver-replicas", ",".join(urls)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    for line in heal.stdout.strip().splitlines():  # its progress and its result, in the order written
        say("      " + line)
    healed = heal.returncode == 0 and lab.cached_pod(stale, namespace, name) is None
    return healed, instance() == before


def say_table(say: Callable[[str], None], rows: list[tuple[str, Any, Any]]) -> None:
    """The demo's before/after table: one row per (label, without the guard, with it)."""
    width = max(len(label) for label, _, _ in rows) + 2
    say("")
    say(f"  {'':{width}}{'without guard':>18}{'with guard':>18}")
    for label, left, right in rows:
        say(f"  {label:{width}}{left!s:>18}{right!s:>18}")
