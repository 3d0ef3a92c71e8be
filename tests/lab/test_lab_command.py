"""``run_lab`` (behind ``ghost-guard lab``) as a real process: prints kubeconfigs, stops on SIGTERM, leaves nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from kubernetes import client, config

from guard.lab.commands import DropSpec, parse_drop_deletes
from guard.lab.harness import eventually

SCRIPT = "import sys; from guard.lab.commands import run_lab; sys.exit(run_lab({args}))"


@pytest.mark.parametrize(("spec", "replicas", "want"), [
    ("default/web-1", 3, DropSpec(1, "default", "web-1")),
    ("default", 3, DropSpec(1, "default", None)),
    ("2:kube-system/x", 3, DropSpec(2, "kube-system", "x")),
    ("0:default", 3, DropSpec(0, "default", None)),
    ("*", 1, DropSpec(0, None, None)),
], ids=["name-default-replica", "namespace", "explicit-replica", "replica-zero", "all-on-single-replica"])
def test_parse_drop_deletes(spec, replicas, want):
    assert parse_drop_deletes(spec, replicas) == want


@pytest.mark.parametrize(("spec", "replicas", "message"), [
    ("Bad!", 3, "--drop-deletes 'Bad!': expected [N:]NAMESPACE[/NAME] or [N:]*"),
    ("3:default", 3, "--drop-deletes '3:default': replica 3 does not exist (0..2)"),
    ("9:default", 3, "--drop-deletes '9:default': replica 9 does not exist (0..2)"),
], ids=["garbage", "replica-too-high", "replica-far-too-high"])
def test_parse_drop_deletes_rejects(spec, replicas, message):
    with pytest.raises(ValueError) as e:
        parse_drop_deletes(spec, replicas)
    assert str(e.value) == message


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_lab_serves_until_sigterm_and_cleans_up(tmp_path):
    out = tmp_path / "lab"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(args=f"2, 'default/web-1', None, {str(out)!r}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("faults"):
                break
        text = "".join(lines)
        kubeconfigs = re.findall(r"kubeconfig (\S+)", text)
        assert kubeconfigs == [str(out / "kubeconfig-0"), str(out / "kubeconfig-1")], text
        assert "(drops deletes: default/web-1)" in lines[3]
        etcd_pid = int(subprocess.check_output(["pgrep", "-f", "--", f"{out}/etcd/data"], text=True).split()[0])
        api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfigs[1]))
        assert api.list_namespaced_pod("default", _request_timeout=5).items == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        eventually(lambda: not _pid_alive(etcd_pid), 5, what="etcd gone")
        assert not (out / "etcd").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_run_lab_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(args="0, None, None, None")], capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stderr) == (2, "ghost-guard lab: --replicas must be between 1 and 200\n")


def test_etcd_dies_with_a_sigkilled_parent(tmp_path):
    """No atexit runs after SIGKILL: etcd must still go (PR_SET_PDEATHSIG)."""
    out = tmp_path / "lab"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(args=f"1, None, None, {str(out)!r}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not proc.stdout.readline().startswith("faults"):
            pass
        etcd_pid = int(subprocess.check_output(["pgrep", "-f", "--", f"{out}/etcd/data"], text=True).split()[0])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        eventually(lambda: not _pid_alive(etcd_pid), 5, what="etcd gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_run_lab_on_a_taken_port_fails_cleanly(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "lab"
        proc = subprocess.run([sys.executable, "-c", SCRIPT.format(args=f"2, None, {port}, {str(out)!r}")],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("ghost-guard lab: cannot start: [Errno 98] Address already in use"), proc.stderr
    assert not (out / "etcd").exists()
