"""Waiting for a condition in tests and benchmarks: ``from polling import eventually``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 20.0, *, what: str = "the condition",
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = (), process=None) -> T:
    """Call ``check()`` until it returns something truthy, and return that.

    After ``timeout`` seconds, raise AssertionError naming ``what`` and the last exception
    ignored. ``ignore``: exception types that mean "not yet". ``process``: a process
    (``.proc`` and ``.logs()``, as GuardProcess) that must stay up: its exit fails at once.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(f"exited with {process.proc.returncode} before {what}:\n{process.logs()}")
        try:
            value = check()
            if value:
                return value
        except ignore as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s (last error: {last!r})")
        time.sleep(interval)
