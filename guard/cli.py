"""The ``ghost-guard`` command line. Each command parses its arguments and delegates.

Every option has an environment variable ``GHOST_GUARD_<OPTION>`` (shown in
``--help``); precedence is flag, then environment, then default.
"""

from __future__ import annotations

import click

from guard import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "GHOST_GUARD", "show_default": True})
@click.version_option(__version__, prog_name="ghost-guard")
def main() -> None:
    """kube-ghost-guard: keeps kube-scheduler from looping forever on ghost Pods."""


# --- serve (guard/server.py) -------------------------------------------------


# --- certs (guard/certs.py) --------------------------------------------------


# --- audit, report, diagnose (guard/audit.py, guard/attribution.py) ----------


# --- lab, demo (guard/lab/): imported lazily, never on the serving path ------
