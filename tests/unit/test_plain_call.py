"""guard.worker.plain_call: which complete requests the worker hands to the app's direct lane.

Only kube-scheduler's exact shape goes direct; every other request, well-formed or not, must
fall through (None) to gunicorn's parser and the WSGI lanes, which answer or refuse it.
"""

from __future__ import annotations

import re

import pytest

from guard.worker import plain_call, plain_reply

PATHS = frozenset({b"/filter", b"/preempt"})
BODY = b'{"Pod":{"metadata":{"name":"p","namespace":"ns","uid":"u"}},"NodeNames":["a"]}'


def request(head_lines: list[str], body: bytes = BODY, line: str = "POST /filter HTTP/1.1") -> bytes:
    return ("\r\n".join([line, *head_lines]) + "\r\n\r\n").encode("latin-1") + body


STANDARD = ["Host: guard:8443", "Content-Type: application/json", f"Content-Length: {len(BODY)}",
            "Accept-Encoding: gzip", "User-Agent: Go-http-client/1.1"]


def test_kube_schedulers_call_goes_direct():
    assert plain_call(request(STANDARD), PATHS, 1 << 20) == ("/filter", BODY, True)
    assert plain_call(request(STANDARD, line="POST /preempt HTTP/1.1"), PATHS, 1 << 20) == ("/preempt", BODY, True)


def test_content_type_parameters_and_case_are_allowed():
    head = [h.replace("application/json", "Application/JSON; charset=utf-8") for h in STANDARD]
    assert plain_call(request(head), PATHS, 1 << 20) == ("/filter", BODY, True)


@pytest.mark.parametrize("value", ["close", "keep-alive, close", " Close "])
def test_connection_close_ends_keep_alive(value):
    assert plain_call(request([*STANDARD, f"Connection: {value}"]), PATHS, 1 << 20) == ("/filter", BODY, False)


@pytest.mark.parametrize("req", [
    pytest.param(request(STANDARD, line="POST /filter HTTP/1.0"), id="http-1.0"),
    pytest.param(request(STANDARD, line="POST /filter?x=1 HTTP/1.1"), id="query"),
    pytest.param(request(STANDARD, line="POST /validate/binding HTTP/1.1"), id="other-path"),
    pytest.param(request(STANDARD, line="PUT /filter HTTP/1.1"), id="other-method"),
    pytest.param(request(STANDARD, line="POST  /filter HTTP/1.1"), id="double-space"),
    pytest.param(request([h for h in STANDARD if not h.startswith("Content-Type")]), id="no-content-type"),
    pytest.param(request([h.replace("application/json", "text/plain") for h in STANDARD]), id="text"),
    pytest.param(request([*STANDARD, "Content-Type: application/json"]), id="two-content-types"),
    pytest.param(request([h for h in STANDARD if not h.startswith("Content-Length")]), id="no-length"),
    pytest.param(request([*STANDARD, f"Content-Length: {len(BODY)}"]), id="two-lengths"),
    pytest.param(request([*STANDARD, "Transfer-Encoding: chunked"]), id="transfer-encoding"),
    pytest.param(request([h.replace(f": {len(BODY)}", ": +12") for h in STANDARD]), id="signed-length"),
    pytest.param(request(STANDARD, body=BODY[:-1]), id="short-body"),
    pytest.param(request(STANDARD, body=BODY + b"x"), id="long-body"),
    pytest.param(request([*STANDARD, "X-Folded: a", " continued"]), id="obs-fold"),
    pytest.param(request([*STANDARD, "Bad Name: x"]), id="space-in-name"),
    pytest.param(request([*STANDARD, "X-Nul: a\x00b"]), id="control-character"),
    pytest.param(request([*STANDARD, "no colon"]), id="no-colon"),
    pytest.param(request([*STANDARD, *[f"X-{i}: v" for i in range(100)]]), id="too-many-fields"),
    pytest.param(request([*STANDARD, "X-Long: " + "v" * 9000]), id="field-too-long"),
    pytest.param(BODY, id="no-head"),
])
def test_anything_else_falls_through(req):
    assert plain_call(req, PATHS, 1 << 20) is None


def test_a_body_over_the_lanes_size_falls_through():
    assert plain_call(request(STANDARD), PATHS, len(BODY) - 1) is None
    assert plain_call(request(STANDARD), PATHS, len(BODY)) is not None


def test_the_reply_is_complete_http():
    reply = plain_reply(200, "OK", b'{"x":1}', True)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK" and body == b'{"x":1}'
    assert b"Content-Length: 7" in lines and b"Content-Type: application/json" in lines
    assert b"Connection: keep-alive" in lines
    assert any(re.fullmatch(rb"Date: \w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", l) for l in lines)
    assert b"Connection: close" in plain_reply(403, "Forbidden", b"{}", False).split(b"\r\n")


def test_every_status_gets_its_reason_phrase():
    from guard.worker import _reason

    assert [_reason(s) for s in (200, 400, 403, 413, 415, 503, 599)] == [
        "OK", "Bad Request", "Forbidden", "Content Too Large", "Unsupported Media Type", "Service Unavailable", "Unknown"]
