"""What a pod's identity may be, and how text a person reads or pastes is made safe. Pure.

1. **Names as the apiserver validates them** (k8s.io/apimachinery ``pkg/util/validation``:
   ``IsDNS1123Label``, ``IsDNS1123Subdomain``; ``ValidateNamespaceName`` is the label rule,
   ``ValidatePodName`` the subdomain rule). A namespace is a DNS-1123 label of at most 63
   characters, a pod name a DNS-1123 subdomain of at most 253. Anything else names no pod the
   apiserver can hold, so a caller that sends it is refused (400) before any read, selector or
   write is built from it (issue 25: a name ``live,metadata.namespace=default`` became a field
   selector that matched a live pod, and every replica was named stale).
2. **UIDs**: the apiserver makes every object's UID itself (RFC 4122 text) and does not check
   the format of one a client names (a Binding's ``metadata.uid``, a precondition): it compares
   it. A caller-named UID is taken as at most 128 characters of letters, digits and ``-._:``
   starting with a letter or digit (every UID the apiserver makes, and nothing that can break
   a selector, a log line or a terminal). Empty is allowed: it names no identity, and then the
   guard names no replica for it (guard.engine.incident: a read of a name says nothing about a pod
   created under it a moment later, kubernetes-facts.md section 9).
3. **Text for people**: :func:`visible` escapes control, format (bidirectional overrides and
   isolates, zero-width marks), separator and surrogate characters, so a log line, an Event
   message or a table cell shows what is there; :func:`shell_line` quotes a command with
   ``shlex.quote`` and refuses an argument that holds such characters (no quoting makes them
   safe to paste: a right-to-left override shows the operator a different command).
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from collections.abc import Sequence
from typing import Final

MAX_NAMESPACE: Final = 63
MAX_POD_NAME: Final = 253
MAX_UID: Final = 128

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL: Final = re.compile(_LABEL)
DNS1123_SUBDOMAIN: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
UID_FORMAT: Final = re.compile(r"[A-Za-z0-9][-A-Za-z0-9._:]*")

#: Bidirectional controls named by the Unicode bidi algorithm (all of category Cf, listed for the docs).
BIDI: Final = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# Categories never shown as themselves: control, format (bidi, zero-width), line/paragraph
# separators, surrogates, private use and unassigned.
_HIDDEN: Final = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def _shown(value: str, limit: int = 80) -> str:
    """A caller's value in a reason: escaped and cut."""
    text = visible(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def namespace_problem(namespace: str) -> str | None:
    """Why ``namespace`` is no namespace the apiserver accepts (a DNS-1123 label, 1-63), or None."""
    if len(namespace) > MAX_NAMESPACE:
        return f"namespace is {len(namespace)} characters, more than {MAX_NAMESPACE} (a DNS-1123 label)"
    if not DNS1123_LABEL.fullmatch(namespace):
        return (f"namespace {_shown(namespace)!r} is not a DNS-1123 label (lower-case letters, digits and '-', "
                "starting and ending with a letter or digit)")
    return None


def pod_name_problem(name: str) -> str | None:
    """Why ``name`` is no pod name the apiserver accepts (a DNS-1123 subdomain, 1-253), or None."""
    if len(name) > MAX_POD_NAME:
        return f"name is {len(name)} characters, more than {MAX_POD_NAME} (a DNS-1123 subdomain)"
    if not DNS1123_SUBDOMAIN.fullmatch(name):
        return (f"name {_shown(name)!r} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.', "
                "each dot-separated part starting and ending with a letter or digit)")
    return None


def uid_problem(uid: str) -> str | None:
    """Why ``uid`` is no UID the guard takes (empty, or 1-128 of letters, digits and ``-._:``), or None."""
    if not uid:
        return None
    if len(uid) > MAX_UID:
        return f"uid is {len(uid)} characters, more than {MAX_UID}"
    if not UID_FORMAT.fullmatch(uid):
        return f"uid {_shown(uid)!r} is not a UID (letters, digits, '-', '.', '_' and ':', starting with a letter or digit)"
    return None


def pod_identity_problem(namespace: str, name: str, uid: str) -> str | None:
    """The first problem of a pod identity a caller sent (:func:`namespace_problem`,
    :func:`pod_name_problem`, :func:`uid_problem`), or None when the apiserver could hold it."""
    return namespace_problem(namespace) or pod_name_problem(name) or uid_problem(uid)


def hidden(char: str) -> bool:
    """Whether ``char`` shows as something else or nothing (control, bidi, zero-width, separators,
    and every space but the ASCII one: U+1680, U+2000..U+200A, U+3000 look like a blank or nothing)."""
    category = unicodedata.category(char)
    return category in _HIDDEN or (category == "Zs" and char != " ")


def visible(text: str) -> str:
    """``text`` with every :func:`hidden` character escaped (``\\x1b``, ``\\u202e``, ``\\U000e0001``):
    what a terminal, a log viewer or ``kubectl describe`` shows is what is there."""
    if text.isascii() and text.isprintable():
        return text
    out = []
    for c in text:
        if not hidden(c):
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return "".join(out)


def pastable(arg: str) -> bool:
    """Whether ``arg`` can be put in a command a person pastes: no :func:`hidden` character."""
    return not any(hidden(c) for c in arg)


def shell_line(argv: Sequence[str]) -> str:
    """The command ``argv`` as one shell line: every argument ``shlex.quote``\\ d, so that
    ``shlex.split`` (and a POSIX shell) gives back exactly ``argv`` and nothing runs. ValueError
    when an argument is not :func:`pastable` (the caller leaves it out, and says so)."""
    for arg in argv:
        if not pastable(arg):
            raise ValueError(f"argument {visible(arg)!r} holds control or bidirectional characters")
    return " ".join(shlex.quote(arg) for arg in argv)


def json_hidden_escaped(line: str) -> str:
    """A JSON text with every :func:`hidden` character written as a ``\\uXXXX`` escape (a surrogate
    pair beyond U+FFFF): the same JSON value, but a log line that shows what is there (orjson
    writes U+202E and the like raw; control characters it escapes already)."""
    if line.isascii():
        return line
    out = []
    for c in line:
        if not hidden(c):
            out.append(c)
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            v = ord(c) - 0x10000
            out.append(f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04x}")
    return "".join(out)
