"""A large call whose helper process is still starting (guard.serving.offload): it waits for the helper within
the call's deadline; a helper still starting then is kept and the call gets a 503 "overloaded; retry", never
the worker's own decoding (in a loaded full run a 6 MiB /preempt decoded by the worker while a replacement
helper started was answered 10.8 s after it came, past kube-scheduler's timeout).

The helper's start is held deterministically: its interpreter imports a ``sitecustomize`` (on PYTHONPATH)
that waits for a file the test creates.
"""

from __future__ import annotations

import time

import orjson
import pytest
from payloads import filter_body

from guard.serving.offload import OFFLOAD_BYTES, HelperArgs, Offload, Overloaded

HOLD = """import os, time
go = os.environ.get("GHOST_GUARD_TEST_HELPER_GO")
while go and not os.path.exists(go):
    time.sleep(0.01)
"""


@pytest.fixture
def held(tmp_path, monkeypatch):
    """The go file's path: helpers started from now on wait for it before their imports."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HOLD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}")
    go = tmp_path / "go"
    monkeypatch.setenv("GHOST_GUARD_TEST_HELPER_GO", str(go))
    return go


def large_body() -> bytes:
    body = orjson.dumps(filter_body("default", "web-0", "uid-1", [f"node-{i:06d}" for i in range(40_000)]))
    assert len(body) > OFFLOAD_BYTES
    return body


def test_a_helper_still_starting_at_the_deadline_gets_the_call_a_503_and_is_kept(held):
    body = large_body()
    offload = Offload(count=1)
    try:
        (starting,) = offload._free
        assert starting is not None
        t0 = time.monotonic()
        with pytest.raises(Overloaded, match="did not start within --request-budget"), \
                offload.codec(time.monotonic() + 0.3) as codec:
            codec.parse("/filter", body, None)
        assert time.monotonic() - t0 < 10  # within the deadline (0.3 s), give or take a loaded machine
        assert offload._free == [starting] and starting.proc.poll() is None  # kept, still starting
        held.touch()
        with offload.codec(time.monotonic() + 60) as codec:
            args = codec.parse("/filter", body, None)
            assert isinstance(args, HelperArgs)  # decoded in the helper, once it had started
            assert (args.pod.namespace, args.pod.name, args.pod.uid) == ("default", "web-0", "uid-1")
            reply, _ = codec.encode(args, None, {})
        assert orjson.loads(reply)["NodeNames"] == orjson.loads(body)["NodeNames"]
        assert offload._free == [starting]  # the same helper: it was waited for, not replaced
    finally:
        offload.close()
