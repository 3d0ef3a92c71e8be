"""guard.core.podlist.read_pod_list_stream: a PodList read from its body's pieces as they arrive (the
HTTP response in chunks) gives what decoding the whole body gives, reduced, wherever the pieces are
cut (inside a string, inside an escape, inside the separator, between pods, in the head), and never
holds the whole body: its peak is the lean items plus a piece."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.core import podlist
from guard.core.podlist import read_pod_list_stream
from tests.unit.test_podlist import NESTED, apiserver_pod, pod_list, whole


def cut(body: bytes, at: list[int]) -> list[bytes]:
    """``body`` in pieces, cut at the offsets ``at`` (any order, repeats give empty pieces)."""
    bounds = [0, *sorted(min(max(a, 0), len(body)) for a in at), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:])]


ESCAPED = {**apiserver_pod(1), "metadata": {**apiserver_pod(1)["metadata"],
                                            "annotations": {"a": '\\"},{"metadata":{"x":"\\\\', "b": 'é"}]}'}}}
BODIES = {
    "apiserver": pod_list([apiserver_pod(i) for i in range(4)]),
    "empty": pod_list([]),
    "one": pod_list([apiserver_pod(0)]),
    "escapes-and-separators-in-strings": pod_list([apiserver_pod(0), ESCAPED, apiserver_pod(2)]),
    "separator-inside-a-pod": pod_list([apiserver_pod(0, **NESTED), apiserver_pod(1), apiserver_pod(2, **NESTED)]),
    "trailing-newline": pod_list([apiserver_pod(0), apiserver_pod(1)]) + b"\n",
    "a pod not beginning with metadata": pod_list([apiserver_pod(0), {"spec": {}, "metadata": {"name": "s", "uid": "u"}},
                                                   apiserver_pod(2), {"spec": {"nodeName": "n"}}]),
    "not objects": pod_list([1, "x", None, [apiserver_pod(0)]]),
    "indented (decoded whole)": orjson.dumps({"kind": "PodList", "metadata": {"resourceVersion": "9"},
                                              "items": [apiserver_pod(0)]}, option=orjson.OPT_INDENT_2),
    "items-before-metadata (decoded whole)": orjson.dumps({"items": [apiserver_pod(0)], "metadata": {"resourceVersion": "9"}}),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_every_single_cut_reads_as_decoding_whole(name):
    body = BODIES[name]
    expected = whole(body)
    for at in range(len(body) + 1):
        assert read_pod_list_stream(cut(body, [at])) == expected, f"cut at {at}: {body[max(0, at - 20):at + 20]!r}"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13, 14, 15, 64])
def test_pieces_of_any_size_read_as_decoding_whole(size):
    for body in BODIES.values():
        assert read_pod_list_stream(body[i:i + size] for i in range(0, len(body), size)) == whole(body)


@settings(max_examples=100, deadline=None, database=None)
@given(pods=st.lists(st.fixed_dictionaries({"metadata": st.dictionaries(
    st.sampled_from(["name", "uid", "namespace", "x", "metadata"]),
    st.text(alphabet='ab"\\{}[],:é', max_size=8) | st.lists(st.dictionaries(st.sampled_from(["metadata", "a"]),
                                                                           st.integers(-9, 9)), max_size=2)),
    "spec": st.dictionaries(st.sampled_from(["nodeName", "metadata"]), st.text(max_size=4))}), max_size=6),
    cuts=st.lists(st.integers(0, 2000), max_size=12), bad=st.integers(0, 2000),
    junk=st.sampled_from([b"", b"}", b",", b'{"metadata":{', b'"', b"]", b"\\"]))
def test_any_listing_in_any_pieces_reads_as_decoding_whole_or_fails(pods, cuts, bad, junk):
    body = pod_list(pods)
    body = body[:bad] + junk + body[bad:]
    try:
        expected = whole(body)
    except ValueError:
        expected = None  # not JSON: the stream must not invent a listing
    except (AttributeError, KeyError, TypeError):
        return  # JSON but not a PodList: the whole decode is the reference only for what it reads
    try:
        got = read_pod_list_stream(cut(body, cuts))
    except ValueError:
        assert expected is None, "the stream failed on a listing the whole decode reads"
        return
    assert got == expected


def test_a_listing_broken_after_its_first_pod_fails_the_stream():
    """Past its first pod the stream no longer holds the body to decode it whole: it says so (the
    replica's view fails visibly) instead of answering with the pods before the break."""
    good = pod_list([apiserver_pod(i) for i in range(3)])
    broken = good.replace(b'"p-00002"', b'"p-00002', 1)
    with pytest.raises(ValueError):
        read_pod_list_stream(cut(broken, [len(broken) // 2]))
    extra_key = good[:-1] + b',"kind":"PodList"}'  # a key after the items: not kube-apiserver's shape
    with pytest.raises(ValueError):
        read_pod_list_stream(cut(extra_key, [100]))


def test_a_pod_over_the_bound_is_not_held(monkeypatch):
    monkeypatch.setattr(podlist, "MAX_ITEM_BYTES", 4096)
    big = apiserver_pod(1)
    big["metadata"]["annotations"] = {"a": "x" * 8192}
    body = pod_list([apiserver_pod(0), big, apiserver_pod(2)])
    held = []

    def pieces():
        for i in range(0, len(body), 512):
            held.append(i)
            yield body[i:i + 512]

    with pytest.raises(ValueError):
        read_pod_list_stream(pieces())
    assert len(held) * 512 < len(body)  # it stopped reading before the end


def test_the_peak_is_the_lean_items_plus_a_piece_never_the_body():
    body = pod_list([apiserver_pod(i) for i in range(3000)])
    piece = 64 * 1024

    def pieces():
        view = memoryview(body)
        for i in range(0, len(body), piece):
            yield bytes(view[i:i + piece])

    tracemalloc.start()
    try:
        result = read_pod_list_stream(pieces())
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result == whole(body)
    assert peak < held + 4 * piece, (peak, held, len(body))  # the items kept, plus a piece or two in flight
