"""guard.serving.framing.plain_call: which complete requests the worker hands to the app's direct lane.

Only kube-scheduler's exact shape goes direct; every other request, well-formed or not, must
fall through (None) to gunicorn's parser and the WSGI lanes, which answer or refuse it.
"""

from __future__ import annotations

import re

import pytest

from guard.serving.framing import plain_call, plain_reply

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
    from guard.serving.framing import status_phrase as _reason

    assert [_reason(s) for s in (200, 400, 403, 413, 415, 503, 599)] == [
        "OK", "Bad Request", "Forbidden", "Content Too Large", "Unsupported Media Type", "Service Unavailable", "Unknown"]


# -- the one-pass check against the line-by-line one it replaced --------------------------------

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


def line_by_line(request: bytes, paths: frozenset[bytes], max_body: int) -> tuple[str, bytes, bool] | None:
    """plain_call as it was written first (one header line at a time), the reference."""
    end = request.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = request[:end].split(b"\r\n")
    if len(lines) > 101 or len(lines[0]) > 4094:
        return None
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1" or parts[1] not in paths:
        return None
    json_type = length = None
    keep = True
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or len(line) > 8190 or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            return None
        key = name.lower()
        value = value.strip(b" \t")
        if key == b"content-type":
            if json_type is not None:
                return None
            json_type = value.split(b";", 1)[0].strip(b" \t").lower() == b"application/json"
        elif key == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif key == b"transfer-encoding":
            return None
        elif key == b"connection":
            if b"close" in (t.strip(b" \t").lower() for t in value.split(b",")):
                keep = False
    body = request[end + 4:]
    if not json_type or length is None or length > max_body or len(body) != length:
        return None
    return parts[1].decode("ascii"), body, keep


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FIELDS_OF_INTEREST = {
    "Content-Type": ["application/json", " application/json ", "Application/JSON; charset=utf-8", "application/jsonx",
                     "text/plain", "", "application/json,text/plain"],
    "Content-Length": ["5", " 5 ", "+5", "5 5", "", "0", "05"],
    "Transfer-Encoding": ["chunked", "identity", ""],
    "Connection": ["close", "keep-alive, Close", "closed", "keep-alive", " close ,x", "", "upgrade"],
    "X-Content-Length": ["5"], "Content-Type-X": ["text/plain"], "Host": ["guard:8443"],
}
_INTERESTING = st.sampled_from(sorted(_FIELDS_OF_INTEREST)).flatmap(lambda name: st.builds(
    lambda case, sep, value: f"{getattr(name, case)()}{sep}{value}", st.sampled_from(["title", "lower", "upper"]),
    st.sampled_from([": ", ": ", ":", ":\t", " :"]), st.sampled_from(_FIELDS_OF_INTEREST[name])))
_LINES = st.one_of(_INTERESTING, _INTERESTING, _INTERESTING, st.text(st.characters(max_codepoint=255), max_size=12))


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINES, max_size=2), st.sampled_from(["POST /filter HTTP/1.1", "POST /preempt HTTP/1.1", "POST /filter HTTP/1.0"]),
       st.sampled_from([5, 5, 5, 4]), st.randoms(use_true_random=False))
def test_the_one_pass_check_judges_every_head_as_the_line_by_line_one(extra, line, body_len, rnd):
    """kube-scheduler's head with a line or two added, in any order: the same verdict and result."""
    lines = ["Content-Type: application/json", "Content-Length: 5", *extra]
    rnd.shuffle(lines)
    req = ("\r\n".join([line, *lines]) + "\r\n\r\n").encode("latin-1") + b"x" * body_len
    assert plain_call(req, PATHS, 6) == line_by_line(req, PATHS, 6)
