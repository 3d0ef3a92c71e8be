"""In-process tests of the verdict state: every test runs with threading.Event tracked, so that
``scripted.settle`` knows which threads wait (see tests/state/scripted.py)."""

from __future__ import annotations

import pytest
from scripted import tracked_events


@pytest.fixture(autouse=True)
def _tracked_events():
    with tracked_events():
        yield
