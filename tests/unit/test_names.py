"""guard.core.names: pod identities as the apiserver validates them, and text safe to read and paste (pure)."""

from __future__ import annotations

import re
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.core.names import (
    BIDI,
    hidden,
    namespace_problem,
    pastable,
    pod_identity_problem,
    pod_name_problem,
    shell_line,
    uid_problem,
    visible,
)

# k8s.io/apimachinery/pkg/util/validation/validation.go, written out again independently
GO_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
GO_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
subdomain = st.lists(label, min_size=1, max_size=5).map(".".join).filter(lambda s: len(s) <= 253)


@pytest.mark.parametrize("ns", ["default", "kube-system", "a", "0", "a" * 63, "a-b-c", "9lives"])
def test_namespaces_the_apiserver_accepts(ns):
    assert namespace_problem(ns) is None


@pytest.mark.parametrize("ns", ["", "a" * 64, "Default", "a.b", "-a", "a-", "a_b", "a b", "a,b", "a/b", "ä",
                                "default,metadata.name=x", "a\x00", "\u202ea"])
def test_namespaces_the_apiserver_refuses(ns):
    assert namespace_problem(ns) is not None


@pytest.mark.parametrize("name", ["web-0", "a", "a.b.c", "x" * 253, "0-0.1-1", "a" * 63 + "." + "b" * 63])
def test_pod_names_the_apiserver_accepts(name):
    assert pod_name_problem(name) is None


@pytest.mark.parametrize("name", ["", "x" * 254, "live,metadata.namespace=default", "a..b", ".a", "a.", "a.-b",
                                  "A", "a_b", "a b", "a/b", "..", ".", "a%2Fb", "a\nb", "pöd", "a\u202eb", "a;b"])
def test_pod_names_the_apiserver_refuses(name):
    assert pod_name_problem(name) is not None


@settings(max_examples=200, deadline=None, database=None)
@given(st.text(max_size=70) | label | subdomain)
def test_the_rules_are_the_apiserver_regexes(text):
    assert (namespace_problem(text) is None) == bool(GO_LABEL.match(text) and len(text) <= 63 and "\n" not in text)
    assert (pod_name_problem(text) is None) == bool(GO_SUBDOMAIN.match(text) and len(text) <= 253 and "\n" not in text)


@pytest.mark.parametrize("uid", ["", "0b7e0ad4-4b5c-4d3e-9a6b-2f1e8c7d6a5b", "u-1", "u" * 128, "A.b_c:d"])
def test_uids_taken(uid):
    assert uid_problem(uid) is None


@pytest.mark.parametrize("uid", ["u" * 129, "-u", "a b", "a,b", "a/b", "\u202eu", "u\x00", "ü", "a=b"])
def test_uids_refused(uid):
    assert uid_problem(uid) is not None


def test_identity_problem_names_the_field():
    assert pod_identity_problem("default", "web-0", "u") is None
    assert pod_identity_problem("Default", "web-0", "u").startswith("namespace ")
    assert pod_identity_problem("default", "web,0", "u").startswith("name ")
    assert pod_identity_problem("default", "web-0", "u u").startswith("uid ")
    # the reason itself shows a caller's bidi or control characters escaped
    assert "\u202e" not in pod_identity_problem("default", "a\u202eb", "") and "\\u202e" in \
        pod_identity_problem("default", "a\u202eb", "")


def test_bidi_and_control_characters_are_hidden_and_escaped():
    for c in BIDI | {"\x00", "\x1b", "\n", "\r", "\t", "\x7f", "\x85", "\u200b", "\u2028", "\u2029", "\ufeff"}:
        assert hidden(c), hex(ord(c))
        assert c not in visible(f"a{c}b") and visible(f"a{c}b").startswith("a\\")
    assert visible("web-0 ポッド 🙂") == "web-0 ポッド 🙂"
    assert visible("a\u202eb\x1b") == "a\\u202eb\\x1b"
    assert visible("\U000e0001") == "\\U000e0001"


names_any = st.text(max_size=40)
shell_danger = st.sampled_from(["x$(touch${IFS}/tmp/PWNED)", "`id`", "a;rm -rf /", "'", '"', "a b", "-rf", "$HOME",
                                "a\\b", "*", "~", "!", "#c", "a\u202eb", "a\nb", "", "ns/na me", "&&", "|"])


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(names_any | shell_danger | subdomain, max_size=6))
def test_shell_line_splits_back_to_exactly_the_argv_or_is_refused(argv):
    argv = ["ghost-guard", "heal", *argv]
    if all(pastable(a) for a in argv):
        line = shell_line(argv)
        assert shlex.split(line) == argv
        assert line.isprintable() and not any(c in BIDI for c in line)
    else:
        with pytest.raises(ValueError) as e:
            shell_line(argv)
        assert str(e.value).isprintable()


def test_valid_names_are_printed_as_they_are():
    assert shell_line(["ghost-guard", "heal", "default/web-0", "kube-system/a.b"]) == \
        "ghost-guard heal default/web-0 kube-system/a.b"


def test_selectors_are_built_from_valid_names_only():
    from guard.kube.watch import name_selector

    assert name_selector("default", "web-0") == "metadata.name=web-0"
    for namespace, name in [("default", "live,metadata.namespace=default"), ("default", "a=b"), ("default", "a!=b"),
                            ("default,x", "web-0"), ("default", ""), ("", "web-0"), ("default", "a b")]:
        assert name_selector(namespace, name) is None, (namespace, name)


def test_a_replica_answer_counts_only_for_the_object_asked_about():
    from guard.kube.watch import only_object

    def pod(ns, name, uid="u"):
        return {"metadata": {"namespace": ns, "name": name, "uid": uid}, "spec": {}}

    items = [pod("default", "live"), pod("other", "web-0"), pod("default", "web-0", "u1"), {"metadata": None}, "x"]
    assert only_object(items, "default", "web-0") == [pod("default", "web-0", "u1")]
    assert only_object(items, "default", "live,metadata.namespace=default") == []
    assert only_object(None, "default", "web-0") == [] and only_object({"a": 1}, "default", "web-0") == []
