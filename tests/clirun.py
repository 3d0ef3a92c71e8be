"""``ghost-guard`` commands run in the test process: ``from clirun import ghost_guard``.

click's CliRunner invokes the same command object the console script does (arguments,
environment variables, output streams, exit status), without starting an interpreter that
imports ``kubernetes`` again for every run (seconds each on a busy machine). Keep one real
process per command where the process itself is the subject (a signal, the console script).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from click.testing import CliRunner

from guard.cli import main


def ghost_guard(*args: str, env: dict[str, str] | None = None, clean_env: bool = False) -> subprocess.CompletedProcess:
    """``ghost-guard *args`` in-process, answered as ``subprocess.run(..., text=True)`` would answer
    (``returncode``, ``stdout``, ``stderr``), so a test reads it as it read the process.

    ``clean_env`` hides the caller's ``GHOST_GUARD_*`` variables (``env`` is applied after). An exception
    other than the command's own exit is raised here: CliRunner would report it as exit status 1, which
    some tests expect for other reasons."""
    overrides: dict[str, str | None] = {}
    if clean_env:
        overrides.update({k: None for k in os.environ if k.startswith("GHOST_GUARD_")})
    overrides.update(env or {})
    r = CliRunner(env=overrides).invoke(main, list(args), prog_name="ghost-guard")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(["ghost-guard", *args], r.exit_code, r.stdout, r.stderr)


def ghost_guard_process(*args: str) -> subprocess.Popen:
    """``python -m guard *args`` as a real process that Ctrl-C reaches as it does from a terminal: SIGINT with its
    default disposition in the child. A suite started in the background (`cmd &` from a script) has SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler in its children: the command would rightly
    ignore the signal (seen in a full run started so)."""
    return subprocess.Popen([sys.executable, "-m", "guard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def interrupt(proc: subprocess.Popen, timeout: float = 20) -> str:
    """Ctrl-C to a ``ghost_guard_process``: it must end within ``timeout`` with 130, saying "interrupted", no
    traceback. Its stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    return err


def ghost_guard_beside_process(args: list[str], extra: list[str],
                               first: Callable[[subprocess.Popen], None] | None = None
                               ) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """``python -m guard *args`` as a real process, while ``ghost_guard(*args, *extra)`` runs in-process (two
    runs of a command that waits, in the time of one): (the process's result, the in-process one).
    ``first(proc)`` runs once the process started, before the in-process run (to read its first output)."""
    proc = subprocess.Popen([sys.executable, "-m", "guard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        if first is not None:
            first(proc)
        r = ghost_guard(*args, *extra)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), r


def ghost_guard_json(*args: str, status: int | tuple[int, ...] = 0, env: dict[str, str] | None = None) -> Any:
    """``ghost-guard *args`` in-process, its exit status checked (one of ``status``), its stdout parsed as JSON."""
    r = ghost_guard(*args, env=env)
    assert r.returncode in ((status,) if isinstance(status, int) else status), (r.returncode, r.stderr)
    return json.loads(r.stdout)


def audit_records(db: str, *args: str) -> list[dict]:
    """``ghost-guard audit --db DB ARGS -o json``: the store's records as the operator reads them."""
    return ghost_guard_json("audit", "--db", db, *args, "-o", "json")
