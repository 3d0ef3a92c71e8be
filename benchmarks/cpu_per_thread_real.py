"""``cpu_per_pod_real`` with each case's CPU split by thread: which of the extender's threads the CPU per pod is.

Runs :mod:`benchmarks.cpu_per_pod_real` unchanged (the same arguments, the same table) and, over each case's
window (the two points where it reads the extender's process tree), reads every thread of the tree:

- CPU from ``/proc/PID/task/TID/schedstat`` (run time in ns). Not ``task/TID/stat``: its per-thread
  ``utime``/``stime`` are tick-sampled, scaled and given in whole ticks, and for many threads running short
  bursts their sum falls short of the process's (about one 10 ms tick per thread over a window: 0.35-0.42
  ms/pod of the guard's 34 threads over 500 pods once looked like CPU "in no live thread";
  docs/BENCHMARKS.md). ``schedstat`` adds up to the process tree's ``utime + stime``.
- context switches (voluntary and not) from ``task/TID/status``;
- names from ``py-spy dump`` at the window's start when py-spy is installed (Python 3.11 does not name its OS
  threads), numbers folded (``ghost-verify-N``); else ``tid<N>``. The dump pauses the process for a moment,
  before the case's first pod.

Threads seen only at the window's end count from zero; the tree is sampled every 50 ms, so a thread born and
ended within the window is counted if it lived 50 ms (the report says how many were born and ended).
Prints one table per case on stderr. Run as ``cpu_per_pod_real``:
``python -m benchmarks.cpu_per_thread_real --kube-bin DIR --nodes 100 --rounds 1 --phases live``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import benchmarks.cpu_per_pod_real as real
from benchmarks.cpu_per_pod import proc_stats, tree_of, tree_usage

SAMPLE_SECONDS = 0.05


def tree_pids(pid: int) -> set[int]:
    return tree_of(pid, proc_stats())


def thread_times(pid: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(process, thread) -> (run time ns, context switches) of every thread of ``pid``'s tree."""
    out = {}
    for p in tree_pids(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                ns = int(Path(f"/proc/{p}/task/{t}/schedstat").read_text().split()[0])
                status = Path(f"/proc/{p}/task/{t}/status").read_text()
            except (OSError, ValueError, IndexError):
                continue
            switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
            out[(p, int(t))] = (ns, switches)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """TID -> Python thread name of every Python process in ``pid``'s tree (py-spy dump), {} without py-spy."""
    if not shutil.which("py-spy"):
        return {}
    names = {}
    for p in tree_pids(pid):
        try:
            dump = subprocess.run(["py-spy", "dump", "--pid", str(p)], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for m in re.finditer(r'Thread (\d+) \((?:idle|active)[^)]*\): "([^"]*)"', dump):
            names[int(m.group(1))] = m.group(2)
    return names


class Window:
    """One case's window: the threads at its start, sampled until its end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = thread_times(pid)
        self.names = thread_names(pid)
        self.seen = dict(self.start)
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            self.seen.update(thread_times(self.pid))

    def report(self, pods: int) -> str:
        self.stop.set()
        self.sampler.join()
        end = thread_times(self.pid)
        self.seen.update(end)
        groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        per_process: dict[int, int] = defaultdict(int)
        for p, _ in self.seen:
            per_process[p] += 1
        worker = max(per_process, key=lambda p: per_process[p])  # the process with the most threads: unprefixed
        for key, (ns, switches) in self.seen.items():
            ns0, sw0 = self.start.get(key, (0, 0))
            p, tid = key
            name = re.sub(r"\d+$", "N", self.names.get(tid) or f"tid{tid}")
            g = groups[name if p == worker else f"process {p}: {name}"]
            g[0] += (ns - ns0) / 1e6 / pods
            g[1] += (switches - sw0) / pods
            g[2] += 1
        born = sum(1 for k in self.seen if k not in self.start)
        ended = sum(1 for k in self.seen if k not in end)
        total = sum(g[0] for g in groups.values())
        lines = [f"threads of {self.pid}'s tree: {total:.3f} ms/pod in all (schedstat); {born} born, {ended} ended "
                 "in the window", "| thread | ms/pod | switches/pod | threads |", "|---|---:|---:|---:|"]
        for name, (ms, sw, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
            if ms >= 0.0005 or sw >= 0.05:
                lines.append(f"| {name} | {ms:.3f} | {sw:.1f} | {int(n)} |")
        return "\n".join(lines)


def main() -> int:
    windows: dict[int, Window] = {}
    pods = 500
    if "--pods" in sys.argv:
        pods = int(sys.argv[sys.argv.index("--pods") + 1])

    def usage(pid: int) -> tuple[float, float, int]:
        used = tree_usage(pid)
        window = windows.pop(pid, None)
        if window is None:
            windows[pid] = Window(pid)
        else:
            print(window.report(pods), file=sys.stderr, flush=True)
        return used

    real.tree_usage = usage  # the case's two reads of its tree open and close a window
    return real.main()


if __name__ == "__main__":
    sys.exit(main())
