"""Which of the guard's files one verb call crosses: a prepared /filter and a miss, traced.

The serving path (docs/ARCHITECTURE.md, "One verb call") as the worker drives it, in-process
against a lab (real etcd, real HTTPS replicas, the ``kubernetes`` client): the worker's own
pure steps (``plain_call`` frames the call, ``plain_reply`` writes the reply) around the app's
direct lane (``app.extensions[DIRECT_LANE]``, built by ``guard.http.app.create_app`` as a worker
builds it). ``sys.setprofile`` records every Python function entered on the calling thread; the
files under ``guard/`` among them are the files the call crosses.

- **prepared**: the event loop's call (``answer_now``) for a pod whose ``alive`` verdict was
  verified ahead (``Checker.verify``, as the pre-verifier does).
- **miss**: a pod the guard has never seen: the loop's ``answer_now`` decodes it and finds nothing
  to answer with (a Waiting, not joined), then a pool thread's call (``lane.answer_taken``) makes the
  quorum GET for that decoded call.

Run from the repository root: ``python -m benchmarks.serving_path`` (prints both paths, file by
file, with the functions entered in each). tests/component/test_serving_path.py asserts the bound.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import orjson

import guard

GUARD_ROOT = os.path.dirname(os.path.abspath(guard.__file__))


# The serving path's own layers: every file of theirs that a call enters is on its path.
PATH_LAYERS = ("guard/serving/", "guard/http/", "guard/engine/")


def _rel(filename: str) -> str | None:
    if not filename.startswith(GUARD_ROOT + os.sep):
        return None
    return "guard/" + os.path.relpath(filename, GUARD_ROOT)


@dataclass
class Path:
    """The guard's files one call entered, in first-entry order, with the functions entered in each
    (and how many times).

    ``hops``: the files the call is handed to: the files of the path's own layers (serving, http,
    engine) and each file they call into. What a called function of the pure core or the kube
    layer then calls within the guard (the codec's name checks, the verdict rule's helpers, the
    client's transport) is part of that step, listed in ``files`` but not a hop."""

    files: dict[str, dict[str, int]] = field(default_factory=dict)
    hops: list[str] = field(default_factory=list)
    calls: int = 0

    def enter(self, frame: FrameType) -> None:
        rel = _rel(frame.f_code.co_filename)
        if rel is None:
            return
        self.calls += 1
        names = self.files.setdefault(rel, {})
        name = frame.f_code.co_qualname
        names[name] = names.get(name, 0) + 1
        if rel not in self.hops:
            caller = frame.f_back
            while caller is not None and _rel(caller.f_code.co_filename) is None:  # through the stdlib and libraries
                caller = caller.f_back
            origin = _rel(caller.f_code.co_filename) if caller is not None else None
            if rel.startswith(PATH_LAYERS) or origin is None or origin.startswith(PATH_LAYERS):
                self.hops.append(rel)

    def render(self) -> str:
        lines = [f"{len(self.hops)} files handed the call ({' -> '.join(self.hops)}); "
                 f"{len(self.files)} guard files entered, {self.calls} guard function calls"]
        for rel, names in self.files.items():
            lines.append(f"  {rel}: " + ", ".join(n if k == 1 else f"{n} x{k}" for n, k in names.items()))
        return "\n".join(lines)


def traced(fn: Callable[[], Any]) -> tuple[Any, Path]:
    """fn()'s result and the guard files it entered on this thread."""
    path = Path()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            path.enter(frame)

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, path


def filter_request(namespace: str, name: str, uid: str, nodes: list[str]) -> bytes:
    body = orjson.dumps({"Pod": {"metadata": {"name": name, "namespace": namespace, "uid": uid}},
                         "NodeNames": nodes, "Nodes": None})
    return (b"POST /filter HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def serving_paths(kubeconfig: str, create: Callable[[str], str]) -> dict[str, tuple[bytes, Path]]:
    """{"prepared": (reply, path), "miss": (reply, path)}: one call of each, traced. ``create(name)``
    creates a pending pod in namespace default and returns its UID."""
    from guard.core.settings import Settings
    from guard.core.verdict import PodRef
    from guard.http.app import create_app
    from guard.http.lane import DIRECT_LANE
    from guard.serving.framing import plain_call, plain_reply

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(kubeconfig=kubeconfig, audit_db=f"{tmp}/audit.db", events=False, prepare=False,
                            ghost_nodes=False)
        app = create_app(settings)
        guard_ = app.extensions["ghost_guard"]
        lane = app.extensions[DIRECT_LANE]
        paths = frozenset(p.encode("ascii") for p in lane.paths)
        try:
            nodes = [f"node-{i}" for i in range(3)]
            checker = guard_.checker

            def prepare(name: str) -> str:
                uid = create(name)
                ref = PodRef("default", name, uid)
                assert checker.verify(ref, checker.cache.tick()) is not None  # as the pre-verifier does
                return uid

            def wake() -> None:
                raise AssertionError("no GET is in flight: nothing to wake")

            def loop_call(request: bytes) -> Any:
                """The event loop's turn (ConnectionLoop._answer_now): frame, ask the lane, write the reply."""
                call = plain_call(request, paths, lane.max_body)
                assert call is not None
                path, body, keep = call
                answered = lane.answer_now(path, body, "127.0.0.1", None, wake)
                if not isinstance(answered, tuple):
                    return answered, keep  # decoded, not answered: a pool thread takes it as it is
                status, payload = answered
                return plain_reply(status, "OK", payload, keep)

            def pool_call(waiting: Any, keep: bool) -> bytes:
                """A pool thread's turn (ConnectionLoop._serve): the lane's answer to the call the loop
                decoded, the reply."""
                status, payload = lane.answer_taken(waiting)
                return plain_reply(status, "OK", payload, keep)

            def miss(name: str, uid: str) -> bytes:
                request = filter_request("default", name, uid, nodes)
                waiting, keep = loop_call(request)  # nothing to answer with in the loop: a pool thread
                assert waiting is not None and not waiting.joined
                return pool_call(waiting, keep)

            # Warm: one call of each kind first (lazily bound metric children, the kept connection), so
            # the traced calls are a running guard's.
            loop_call(filter_request("default", "path-warm-prepared", prepare("path-warm-prepared"), nodes))
            miss("path-warm-miss", create("path-warm-miss"))
            uid = prepare("path-prepared")
            prepared_reply, prepared = traced(lambda: loop_call(filter_request("default", "path-prepared", uid,
                                                                               nodes)))
            uid = create("path-miss")
            miss_reply, missed = traced(lambda: miss("path-miss", uid))
            return {"prepared": (prepared_reply, prepared), "miss": (miss_reply, missed)}
        finally:
            guard_.close()


def main() -> int:
    from guard.lab.harness import pod_manifest
    from guard.lab.lab import Lab

    with Lab(replicas=3) as lab:
        def create(name: str) -> str:
            return lab.core_v1(0).create_namespaced_pod("default", pod_manifest(name), _request_timeout=10).metadata.uid

        for kind, (reply, path) in serving_paths(lab.kubeconfig(0), create).items():
            status = reply.split(b"\r\n", 1)[0].decode()
            print(f"{kind}: {status}\n{path.render()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
