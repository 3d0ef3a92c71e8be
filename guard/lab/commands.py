"""``ghost-guard lab``: etcd and N apiserver replicas (the Python lab's, or real kube-apiservers with
``--kube-bin``) in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import re
import signal
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guard.lab.real.binaries import KubeBinaries


@dataclass(frozen=True)
class DropSpec:
    replica: int  # 0-based index
    namespace: str | None
    name: str | None


def parse_drop_deletes(spec: str, replicas: int) -> DropSpec:
    """``[N:]NAMESPACE[/NAME]`` or ``[N:]*``; N is the replica number 0..replicas-1 (127.0.0.N+1,
    ``kubeconfig-N``), default 1 (the second; the only one with a single replica).

    Raises ValueError with a one-line reason.
    """
    m = re.fullmatch(r"(?:(\d+):)?(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?(?:/[a-z0-9]([-a-z0-9.]*[a-z0-9])?)?)", spec.strip())
    if not m:
        raise ValueError(f"--drop-deletes {spec!r}: expected [N:]NAMESPACE[/NAME] or [N:]*")
    number = int(m.group(1)) if m.group(1) else min(1, replicas - 1)
    if not 0 <= number < replicas:
        raise ValueError(f"--drop-deletes {spec!r}: replica {number} does not exist (0..{replicas - 1})")
    target = m.group(2)
    if target == "*":
        return DropSpec(number, None, None)
    ns, _, name = target.partition("/")
    return DropSpec(number, ns, name or None)


def run_lab(replicas: int, drop_deletes: str | None, port: int | None, out_dir: str | None, *,
            kube_bin: KubeBinaries | None = None, scheduler: bool = False, controller_manager: bool = False) -> int:
    """Start etcd and ``replicas`` replicas, print where they are, block until Ctrl-C/SIGTERM, clean up.

    ``kube_bin``: run the real backend (real kube-apiserver replicas, each behind its etcd fault proxy;
    ``scheduler``/``controller_manager`` start kube-scheduler and kube-controller-manager on replica 0);
    None: the Python lab. Returns the process exit code: 0 after a clean stop, 2 for bad arguments, 1 if
    the lab can't start.
    """
    if not 1 <= replicas <= 200:
        print("ghost-guard lab: --replicas must be between 1 and 200", file=sys.stderr)
        return 2
    if port is not None and not 1 <= port <= 65535:
        print("ghost-guard lab: --port must be between 1 and 65535", file=sys.stderr)
        return 2
    drop = None
    if drop_deletes:
        try:
            drop = parse_drop_deletes(drop_deletes, replicas)
        except ValueError as e:
            print(f"ghost-guard lab: {e}", file=sys.stderr)
            return 2

    if (scheduler or controller_manager) and kube_bin is None:
        print("ghost-guard lab: --scheduler and --controller-manager need the real backend (--kube-bin)", file=sys.stderr)
        return 2

    from guard.lab import EtcdError, Lab

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lab: Any
    errors: tuple[type[BaseException], ...] = (OSError, EtcdError)
    if kube_bin is not None:
        from guard.lab.real.controlplane import RealLab, RealLabError

        lab = RealLab(replicas=replicas, kube_bin=kube_bin, port=port, out_dir=out_dir, scheduler=scheduler,
                      controller_manager=controller_manager)
        errors += (RealLabError,)
    else:
        lab = Lab(replicas=replicas, port=port, out_dir=out_dir)
    try:
        try:
            if kube_bin is not None:
                print(f"starting the real backend: {replicas} kube-apiserver replica(s) from {kube_bin.dir} ...",
                      file=sys.stderr, flush=True)
            lab.start()
        except errors as e:
            print(f"ghost-guard lab: cannot start: {e}", file=sys.stderr)
            return 1
        if drop is not None:
            lab.replicas[drop.replica].faults.drop_deletes(namespace=drop.namespace, name=drop.name)
        print(f"etcd        {lab.etcd.url}")
        print(f"CA          {lab.ca_path}")
        for i, r in enumerate(lab.replicas):
            note = ""
            if drop is not None and drop.replica == i:
                what = "/".join(x for x in (drop.namespace, drop.name) if x) or "all pods"
                note = f"   (drops deletes: {what})"
            print(f"replica {i}   {r.url}   kubeconfig {lab.kubeconfig(i)}{note}")
        if kube_bin is None:
            print(f"faults      POST {lab.replicas[0].url}/lab/faults (same bearer token); Ctrl-C to stop", flush=True)
        else:
            for proc in (lab.scheduler, lab.controller_manager):
                if proc is not None:
                    print(f"{proc.name}   log {proc.log_path}")
            print(f"backend     real kube-apiserver ({kube_bin.dir}); each replica reaches etcd through its own "
                  f"fault proxy; logs in {lab.out_dir}; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        lab.close()
        for s, h in old.items():
            signal.signal(s, h)
