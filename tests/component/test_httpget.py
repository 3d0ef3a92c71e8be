"""guard/kube/transport.py, the quorum GET's transport, against scripted servers on real sockets.

Each server answers in one way that the apiserver, a proxy or a broken peer may answer:
Content-Length or chunked, keep-alive or close, an idle close, a drip, garbage, too much.
Over TLS and against the lab's apiserver it is tested through ``Kube.quorum_get``
(tests/component/test_quorum_get.py).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from guard.kube import transport as httpget
from guard.kube.transport import Connections, GetError
from guard.lab.harness import eventually
from guard.lab.pki import CA

POD = b'{"kind":"Pod","metadata":{"name":"p","uid":"u-1"}}'


def length_reply(body: bytes = POD, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def chunked_reply(body: bytes = POD, pieces: int = 3) -> bytes:
    size = -(-len(body) // pieces)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i:i + size] for i in range(0, len(body), size)))
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


class Server:
    """Accepts connections; ``script(conn, index)`` answers each (``index``: the connection's number).
    Counts connections and the GET request lines it read."""

    def __init__(self, script: Callable[[socket.socket, int], None]) -> None:
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.closed = 0  # connections this server has closed (its FIN sent)
        self.requests: list[bytes] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._run, args=(conn, self.connections), daemon=True).start()

    def _run(self, conn: socket.socket, index: int) -> None:
        with conn:
            try:
                self.script(conn, index)
            except OSError:
                pass
        self.closed += 1

    def read_request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        self.requests.append(data)
        return data

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[Server, socket.socket, int], None]], Server]]:
    servers: list[Server] = []

    def start(script: Callable[[Server, socket.socket, int], None]) -> Server:
        holder: list[Server] = []
        server = Server(lambda conn, i: script(holder[0], conn, i))
        holder.append(server)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def failure(server: Server, path: str, headers: dict[str, str], timeout: float) -> GetError:
    """The GetError of one GET on a fresh set of connections to ``server``."""
    wire = Connections(server.url, {}, keep=1)
    try:
        with pytest.raises(GetError) as err:
            wire.get(path, headers, timeout)
    finally:
        wire.close()
    return err.value


def answering(*replies: bytes, close_after: bool = False):
    """A script that answers each request on a connection with the next reply (the last one repeats)."""

    def script(server: Server, conn: socket.socket, index: int) -> None:
        n = 0
        while server.read_request(conn):
            conn.sendall(replies[min(n, len(replies) - 1)])
            n += 1
            if close_after:
                return

    return script


def test_kept_alive_connection_serves_every_get_with_content_length_or_chunked(serve):
    server = serve(answering(length_reply(), chunked_reply(), chunked_reply(pieces=1), length_reply()))
    wire = Connections(server.url, {}, keep=2)
    try:
        bodies = [wire.get("/api/v1/namespaces/ns/pods/p", {"Accept": "application/json"}, 2.0).body for _ in range(4)]
    finally:
        wire.close()
    assert bodies == [POD] * 4
    assert server.connections == 1
    first = server.requests[0].split(b"\r\n")
    assert first[0] == b"GET /api/v1/namespaces/ns/pods/p HTTP/1.1"
    assert f"Host: {server.url[len('http://'):]}".encode() in first and b"Accept: application/json" in first


def test_status_and_reason_of_an_error_reply(serve):
    server = serve(answering(length_reply(b"404 page not found\n", status=b"404 Not Found")))
    wire = Connections(server.url, {}, keep=1)
    try:
        reply = wire.get("/x", {}, 2.0)
    finally:
        wire.close()
    assert (reply.status, reply.reason, reply.body) == (404, "Not Found", b"404 page not found\n")


def test_an_endless_status_line_is_cut_at_the_deadline_and_kept_short(serve):
    def endless(server: Server, conn: socket.socket, index: int) -> None:
        server.read_request(conn)
        conn.sendall(b"HTTP/1.1 200 ")
        while True:
            conn.sendall(b"x" * 65536)

    server = serve(endless)
    wire = Connections(server.url, {}, keep=1)
    reading = httpget._Reading()
    reading.messages = 1
    reading.on_status(b"y" * 100_000)
    assert len(reading.reason) == httpget.MAX_REASON_BYTES
    start = time.monotonic()
    try:
        with pytest.raises(GetError):
            wire.get("/x", {}, 0.5)
    finally:
        wire.close()
    assert time.monotonic() - start < 2.0


def test_connection_close_is_honoured(serve):
    server = serve(answering(length_reply(extra=b"Connection: close\r\n"), close_after=True))
    wire = Connections(server.url, {}, keep=2)
    try:
        assert [wire.get("/x", {}, 2.0).status for _ in range(3)] == [200, 200, 200]
    finally:
        wire.close()
    assert server.connections == 3


def test_a_connection_the_server_closed_while_idle_is_not_used_and_the_get_is_sent_once(serve):
    # The server answers one request per connection, then closes it without saying so.
    server = serve(answering(length_reply(), close_after=True))
    wire = Connections(server.url, {}, keep=2)
    try:
        assert wire.get("/x", {}, 2.0).status == 200
        eventually(lambda: server.closed == 1, 5, what="the server's close (its FIN, on loopback at once)",
                   interval=0.005)
        assert wire.get("/x", {}, 2.0).status == 200
    finally:
        wire.close()
    assert (server.connections, len(server.requests)) == (2, 2)


def test_a_server_that_closes_after_reading_the_request_is_a_connection_error_not_a_retry(serve):
    def hang_up(server: Server, conn: socket.socket, index: int) -> None:
        server.read_request(conn)

    server = serve(hang_up)
    err = failure(server, "/x", {}, 2.0)
    assert (err.kind, err.name) == ("connection", "RemoteDisconnected")
    assert len(server.requests) == 1


def test_a_dripping_reply_times_out_within_the_whole_deadline(serve):
    def drip(server: Server, conn: socket.socket, index: int) -> None:
        server.read_request(conn)
        for byte in length_reply():
            conn.sendall(bytes([byte]))
            time.sleep(0.05)  # the behaviour: a peer that drips its reply on purpose

    server = serve(drip)
    start = time.monotonic()
    err = failure(server, "/x", {}, 0.5)
    assert err.kind == "timeout"
    assert time.monotonic() - start < 1.5  # each byte came within 0.05 s: only a whole-exchange deadline stops it


def test_a_reply_larger_than_the_bound_is_refused(serve, monkeypatch):
    monkeypatch.setattr(httpget, "MAX_REPLY_BYTES", 1000)
    server = serve(answering(chunked_reply(b"x" * 5000, pieces=10)))
    err = failure(server, "/x", {}, 2.0)
    assert (err.kind, err.name) == ("protocol", "ReplyTooLarge")


def test_garbage_is_a_protocol_error(serve):
    server = serve(answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))
    err = failure(server, "/x", {}, 2.0)
    assert err.kind == "protocol"


def test_bytes_after_the_reply_drop_the_connection(serve):
    server = serve(answering(length_reply() + length_reply(b"{}")))
    wire = Connections(server.url, {}, keep=2)
    try:
        assert wire.get("/x", {}, 2.0).body == POD
        assert wire.get("/x", {}, 2.0).body == POD  # not the stray second reply
    finally:
        wire.close()
    assert server.connections == 2


@pytest.mark.parametrize("headers,path", [
    pytest.param({"Authorization": "Bearer abc\r\nX-Injected: 1"}, "/x", id="line-break-in-value"),
    pytest.param({"X-Bad\r\nName": "v"}, "/x", id="line-break-in-name"),
    pytest.param({}, "/x HTTP/1.1\r\nX-Injected: 1\r\n\r\nGET /y", id="line-break-in-path"),
])
def test_nothing_is_sent_for_a_request_that_would_inject_lines(serve, headers, path):
    server = serve(answering(length_reply()))
    err = failure(server, path, headers, 2.0)
    assert err.kind == "protocol"
    assert server.requests == []


def test_a_refused_connection_is_a_connection_error():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    wire = Connections(f"http://127.0.0.1:{port}", {}, keep=1)
    with pytest.raises(GetError) as err:
        wire.get("/x", {}, 2.0)
    assert (err.value.kind, err.value.name) == ("connection", "NewConnectionError")



def test_tls_connections_share_one_context_and_a_rotated_ca_file_is_read_again(serve, tmp_path):
    """urllib3 builds a TLS context and reads the CA into it at each connect (about 1 ms of CPU): the GET's
    connections share one, built as urllib3 builds it, and built again once the CA file changes on disk
    (a rotation: the next connection trusts the new CA only, as a fresh urllib3 context would)."""
    lab_ca, other_ca = CA("lab-ca"), CA("other-ca")
    pair = lab_ca.serving("127.0.0.1")
    (tmp_path / "server.crt").write_bytes(pair.cert_pem)
    (tmp_path / "server.key").write_bytes(pair.key_pem)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    ca_file = tmp_path / "ca.crt"

    def rotate(pem: bytes) -> None:
        (tmp_path / "ca.new").write_bytes(pem)
        os.replace(tmp_path / "ca.new", ca_file)  # a new file, as a rotation writes it

    def script(server: Server, conn: socket.socket, index: int) -> None:
        with server_tls.wrap_socket(conn, server_side=True) as tls:
            if server.read_request(tls):  # type: ignore[arg-type]
                tls.sendall(length_reply(extra=b"Connection: close\r\n"))

    server = serve(script)
    url = server.url.replace("http://", "https://")
    rotate(lab_ca.cert_pem)
    wire = Connections(url, {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(ca_file)}, keep=2)
    try:
        contexts = []
        for _ in range(3):
            assert wire.get("/api/v1/namespaces/ns/pods/p", {}, 5.0).body == POD
            contexts.append(wire._tls[1] if wire._tls else None)
        assert server.connections == 3  # each GET's connection closed by the server: three connects
        assert contexts[0] is not None and all(c is contexts[0] for c in contexts)  # one context for the three
        rotate(other_ca.cert_pem)
        with pytest.raises(GetError) as err:
            wire.get("/api/v1/namespaces/ns/pods/p", {}, 5.0)
        assert err.value.kind == "tls"  # the new CA file was read: the lab's certificate is not trusted now
        rotate(lab_ca.cert_pem)
        assert wire.get("/api/v1/namespaces/ns/pods/p", {}, 5.0).body == POD
        assert wire._tls is not None and wire._tls[1] is not contexts[0]
        os.remove(ca_file)
        with pytest.raises(GetError) as err:
            wire.get("/api/v1/namespaces/ns/pods/p", {}, 5.0)
        assert err.value.kind == "tls"  # a CA file gone: no connection, as urllib3 fails to load it
    finally:
        wire.close()
