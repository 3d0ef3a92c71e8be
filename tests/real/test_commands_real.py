"""``ghost-guard lab --kube-bin`` and ``ghost-guard demo --kube-bin`` on the real binaries.

The lab command runs as a real process (its signals and its children are the subject); the demo runs
in-process (``run_real_demo``, what the command calls).
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

from guard.lab.harness import child_pids, eventually


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_lab_command_prints_one_kubeconfig_per_replica_and_leaves_nothing(kube_binaries, tmp_path):
    out = tmp_path / "lab"
    cmd = [sys.executable, "-m", "guard", "lab", "--kube-bin", str(kube_binaries.dir), "--replicas", "2",
           "--drop-deletes", "default/web-1", "--out-dir", str(out), "--controller-manager"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("backend"):
                break
        text = "".join(lines)
        assert proc.poll() is None, text + proc.stderr.read()
        kubeconfigs = re.findall(r"kubeconfig (\S+)", text)
        assert kubeconfigs == [str(out / "kubeconfig-0"), str(out / "kubeconfig-1")], text
        assert re.search(r"^replica 0   https://127\.0\.0\.1:\d+ ", text, re.M), text
        assert "replica 1   https://127.0.0.2:" in text and "(drops deletes: default/web-1)" in text, text
        children = child_pids(proc.pid)
        names = sorted(open(f"/proc/{p}/comm").read().strip() for p in children)
        assert names == ["etcd", "kube-apiserver", "kube-apiserver", "kube-controller"], names  # comm: 15 characters
        # kubectl through replica 1; the controller-manager is at work: it gives a new namespace its ServiceAccount
        kubectl = ["kubectl", "--kubeconfig", kubeconfigs[1]]
        r = subprocess.run([*kubectl, "create", "namespace", "cli-smoke"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        eventually(lambda: subprocess.run([*kubectl, "-n", "cli-smoke", "get", "serviceaccount", "default"],
                                          capture_output=True, timeout=60).returncode == 0,
                   120, what="the default ServiceAccount made by kube-controller-manager")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in children:
            eventually(lambda: not _alive(pid), 10, what=f"child {pid} gone")
        assert not (out / "etcd").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_lab_command_names_unusable_binaries(tmp_path):
    r = subprocess.run([sys.executable, "-m", "guard", "lab", "--kube-bin", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"ghost-guard lab: --kube-bin={tmp_path}: no kube-apiserver in {tmp_path}\n")


def test_demo_on_real_kubernetes(kube_binaries, real_lab):
    """The demo end to end, on the shared control plane (``ghost-guard demo`` starts its own the same way), each
    phase just long enough to show its point; the ghost loop's finer assertions are in test_scenarios_real."""
    from guard.lab.real.demo import run_real_demo

    out = io.StringIO()
    assert run_real_demo(kube_binaries, out, seconds=0.0, lab=real_lab) == 0, out.getvalue()
    text = out.getvalue()
    assert "after heal: replica 1 serves default/web-1: no; replica 1 restarted: no" in text, text
