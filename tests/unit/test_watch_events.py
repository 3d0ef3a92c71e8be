"""guard.kube.watch.ReplicaClient._events: watch events from the stream's pieces, within a memory bound."""

from __future__ import annotations

import orjson
import pytest

from guard.kube.watch import MAX_WATCH_EVENT_BYTES, ReplicaClient, WatchExpired, WatchFailed


def event(name: str, typ: str = "ADDED") -> bytes:
    return orjson.dumps({"type": typ, "object": {"metadata": {"name": name}}}) + b"\n"


def names(pieces: list[bytes]) -> list[str]:
    return [e["object"]["metadata"]["name"] for e in ReplicaClient._events(iter(pieces), "7")]


def test_events_split_and_joined_across_pieces_arrive_whole_and_in_order():
    stream = event("a") + event("b") + b"\n" + event("c")
    assert names([stream]) == ["a", "b", "c"]
    assert names([stream[:5], stream[5:40], stream[40:]]) == ["a", "b", "c"]


def test_an_error_event_ends_the_watch():
    gone = orjson.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410}}) + b"\n"
    with pytest.raises(WatchExpired):
        names([event("a") + gone])
    bad = orjson.dumps({"type": "ERROR", "object": {"code": 500, "message": "etcd down"}}) + b"\n"
    with pytest.raises(WatchFailed, match="etcd down"):
        names([bad])


def test_a_line_longer_than_the_bound_ends_the_watch_before_it_is_all_read():
    piece = b"x" * (1 << 20)
    pieces = [event("a"), *[piece] * (MAX_WATCH_EVENT_BYTES // len(piece) + 1), b"never read"]
    seen = []
    with pytest.raises(WatchFailed, match="longer than"):
        for e in ReplicaClient._events(iter(pieces), "7"):
            seen.append(e["object"]["metadata"]["name"])
    assert seen == ["a"]


def test_a_line_of_exactly_the_bound_is_still_read():
    body = orjson.dumps({"type": "ADDED", "object": {"metadata": {"name": "big"}, "pad": ""}})
    line = body[:-3] + b"y" * (MAX_WATCH_EVENT_BYTES - len(body)) + body[-3:]  # inside "pad"
    assert len(line) == MAX_WATCH_EVENT_BYTES
    assert names([line[:1000], line[1000:], b"\n"]) == ["big"]
