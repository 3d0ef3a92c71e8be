"""guard.kube.watch.ReplicaClient._events: watch events from the stream's pieces, within a memory bound;
guard.kube.watch.unchunk and body_pieces: those pieces from a chunked reply, read raw."""

from __future__ import annotations

import http.server
import threading

import orjson
import pytest
import urllib3

from guard.kube.watch import MAX_WATCH_EVENT_BYTES, ReplicaClient, WatchExpired, WatchFailed, body_pieces, unchunk


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


# --- the chunked body under the events (guard.kube.watch.unchunk, body_pieces) ---------------------


def chunked(*chunks: bytes, ext: bytes = b"") -> bytes:
    return b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks) + b"0\r\n\r\n"


def test_unchunk_gives_the_chunks_data_however_the_reads_cut_them():
    data = [event("a"), event("b"), event("c")[:7], event("c")[7:]]
    raw = chunked(*data)
    whole = b"".join(data)
    for cut in range(1, len(raw)):  # every split of the bytes into two reads
        assert b"".join(unchunk(iter([raw[:cut], raw[cut:]]))) == whole
    assert b"".join(unchunk(iter(raw[i:i + 1] for i in range(len(raw))))) == whole  # a byte a read
    assert names(list(unchunk(iter([raw])))) == ["a", "b", "c"]


def test_unchunk_gives_one_piece_per_read_and_reads_nothing_after_the_last_chunk():
    raw = chunked(event("a"), event("b"), b"x" * 70000, ext=b";name=value")
    pieces = list(unchunk(iter([raw, b"never read: not HTTP"])))
    assert pieces == [event("a") + event("b") + b"x" * 70000]


@pytest.mark.parametrize("reads", [
    [chunked(event("a"))[:-5]],                      # the connection ends before the last chunk
    [chunked(event("a"))[:-5], b""],                 # an empty read: the end of the connection
    [b"zz\r\n" + event("a")],                        # not a chunk size
    [b"5\r\nabcdefgh\r\n0\r\n\r\n"],                 # a chunk longer than its size
])
def test_unchunk_refuses_a_body_that_is_cut_or_not_chunked(reads):
    with pytest.raises(urllib3.exceptions.ProtocolError):
        list(unchunk(iter(reads)))


class _Chunked(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body: list[bytes] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        if self.path == "/plain":
            data = b"".join(self.body)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in self.body:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("path", ["/watch", "/plain"])
def test_body_pieces_read_a_real_reply_chunked_or_not(path):
    _Chunked.body = [event(str(i)) for i in range(50)]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pool = urllib3.PoolManager()
        resp = pool.request("GET", f"http://127.0.0.1:{server.server_port}{path}", preload_content=False,
                            timeout=5.0)
        assert resp.chunked == (path == "/watch")
        streamed = []
        stream = resp.stream
        resp.stream = lambda *a, **kw: streamed.append(1) or stream(*a, **kw)  # urllib3's own chunk reading
        got = names(list(body_pieces(resp)))
        assert streamed == ([] if path == "/watch" else [1])
        assert got == [str(i) for i in range(50)]
        if path == "/watch":  # read raw, then closed (no half-read connection goes back to the pool)
            assert resp.closed
    finally:
        server.shutdown()
        server.server_close()
