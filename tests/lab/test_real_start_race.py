"""``RealLab``'s start of replicas launched together: a replica that lost kube-apiserver's ClusterIP repair
race (kubernetes#130377: its last line is the ``start-service-ip-repair-controllers`` post-start hook's
failure, exit 255) is relaunched, at most twice; any other exit is raised at once, with its log.

Seen in a loaded full run (2 real replicas started together on a fresh etcd: replica 1 exited 255 and the
module's 13 tests errored). The race itself cannot be forced, so a stand-in ``kube-apiserver`` (a shell
script, a real process) plays the exits; the real one is started by every real-tier test."""

from __future__ import annotations

from guard.lab.etcd import free_port
from guard.lab.real.controlplane import START_RACE_LINE, RealLab, RealLabError, RealReplica

RACE = f'F1203 10:35:55.911087    1652 hooks.go:203] {START_RACE_LINE}: unable to perform initial IP and Port allocation check'

# Each launch counts itself in $FAKE_COUNT; launch N prints $FAKE_N's line and exits with $FAKE_N_RC.
SCRIPT = """#!/bin/sh
n=$(( $(cat "$FAKE_COUNT" 2>/dev/null || echo 0) + 1 ))
echo $n > "$FAKE_COUNT"
eval line=\\"\\$FAKE_$n\\"
eval rc=\\$FAKE_${n}_RC
echo "$line"
exit $rc
"""


def start_one(tmp_path, monkeypatch, launches: list[tuple[str, int]]) -> tuple[RealReplica, int, str]:
    """A one-replica RealLab whose kube-apiserver plays ``launches`` (line, exit code) in turn: the replica
    after _wait_started, how many times it was launched, and the error raised ("" if none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("kube-apiserver", "kube-scheduler"):
        (bin_dir / name).write_text(SCRIPT)
        (bin_dir / name).chmod(0o755)
    count = tmp_path / "count"
    monkeypatch.setenv("FAKE_COUNT", str(count))
    for i, (line, rc) in enumerate(launches, 1):
        monkeypatch.setenv(f"FAKE_{i}", line)
        monkeypatch.setenv(f"FAKE_{i}_RC", str(rc))
    lab = RealLab(replicas=1, kube_bin=bin_dir, proxies=False, out_dir=str(tmp_path / "lab"), startup_timeout=30)
    lab.port = free_port()
    replica = RealReplica(lab, 0, None)
    replica.launch()
    error = ""
    try:
        lab._wait_started(replica)
    except RealLabError as e:
        error = str(e)
    return replica, int(count.read_text()), error


def test_a_replica_that_lost_the_repair_race_is_relaunched_and_its_next_exit_is_reported(tmp_path, monkeypatch):
    _, launches, error = start_one(tmp_path, monkeypatch, [(RACE, 255), ("F1203 something else broke", 1)])
    assert launches == 2
    assert "exited with 1" in error and "something else broke" in error, error


def test_any_other_exit_is_raised_at_once(tmp_path, monkeypatch):
    _, launches, error = start_one(tmp_path, monkeypatch, [("F1203 bad flag", 255), (RACE, 255)])
    assert launches == 1
    assert "exited with 255" in error and "bad flag" in error, error


def test_the_race_lost_every_time_gives_up_after_three_launches(tmp_path, monkeypatch):
    replica, launches, error = start_one(tmp_path, monkeypatch, [(RACE, 255)] * 4)
    assert launches == 3
    assert START_RACE_LINE in error and not replica.running
