"""Lint the Dockerfile (no Docker engine here): pinned bases, a final stage
without build tools, non-root, entrypoint, healthcheck, and agreement with the
Deployment (UID, port, probe one-liner) and .dockerignore."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continuation
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


@pytest.fixture(scope="module")
def parsed():
    ins = instructions(DOCKERFILE.read_text())
    global_args = {}
    stages: list[dict] = []
    for word, rest in ins:
        if word == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif word == "FROM":
            parts = substitute(rest, global_args).split()
            stages.append({"image": parts[0], "name": parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None,
                           "ins": []})
        else:
            assert stages, f"{word} before the first FROM"
            stages[-1]["ins"].append((word, rest))
    return stages


def final(parsed) -> list[tuple[str, str]]:
    return parsed[-1]["ins"]


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


PINNED_BASE = re.compile(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}")


def test_multi_stage_same_pinned_base(parsed):
    assert len(parsed) == 2
    builder, last = parsed
    assert builder["name"] == "builder"
    for stage in parsed:
        image = stage["image"]
        # an exact tag for the reader, the digest for the builder: a tag can be re-pushed, a digest cannot
        assert PINNED_BASE.fullmatch(image), f"{image}: pin python:3.11.X-slim-bookworm@sha256:<digest> (INSTALL.md)"
    assert last["image"] == builder["image"]  # the virtualenv links to this interpreter


def test_every_from_line_is_pinned_by_digest():
    """Raw FROM lines too: a FROM naming an image directly (not through the pinned ARG) needs its own digest."""
    args, stages = {}, set()
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            image, *alias = substitute(rest, args).split()
            stages.update(alias[1:2])
            if image in stages - set(alias[1:2]):
                continue  # FROM an earlier stage
            assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"FROM {rest}: not pinned by digest"


def test_from_digest_check_can_fail():
    assert not PINNED_BASE.fullmatch("python:3.11.9-slim-bookworm")
    assert not PINNED_BASE.fullmatch("python:3.11.9-slim-bookworm@sha256:abc")
    assert PINNED_BASE.fullmatch("python:3.11.9-slim-bookworm@sha256:" + "0" * 64)


def pip_commands(parsed) -> list[list[str]]:
    """Every `pip ...` invocation in the builder's RUN lines, as argument lists from the pip subcommand on."""
    out = []
    for word, rest in parsed[0]["ins"]:
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            argv = shlex.split(command)
            for i, a in enumerate(argv):
                if a.endswith("/pip") or a == "pip" or (a == "-m" and i + 1 < len(argv) and argv[i + 1] == "pip"):
                    start = i + 2 if a == "-m" else i + 1
                    out.append(argv[start:])
                    break
    return out


def test_builder_installs_only_hashed_locks_and_the_guards_own_wheel(parsed):
    commands = pip_commands(parsed)
    installs = [c for c in commands if c[0] == "install"]
    locks = set()
    for c in installs:
        if "-r" in c:
            # from a lock: every file checked against its hash, nothing the lock does not name
            assert "--require-hashes" in c and "--no-deps" in c and "--only-binary=:all:" in c, c
            locks.add(c[c.index("-r") + 1])
        else:
            # the guard's wheel, built in this stage: its dependencies came from the lock
            assert "--no-deps" in c and all(a.startswith("--") or a.startswith("/wheels/") for a in c[1:]), c
    assert locks == {"requirements.lock", "requirements-build.lock"}
    copied = " ".join(rest for w, rest in parsed[0]["ins"] if w == "COPY")
    for lock in locks:
        assert lock in copied.split(), f"{lock} is not copied into the builder"
    assert ["check"] in commands  # the locked set is consistent (pip check)


def test_builder_builds_the_wheel_without_fetching_anything(parsed):
    (wheel,) = [c for c in pip_commands(parsed) if c[0] == "wheel"]
    # no build isolation: pip would otherwise download an unpinned setuptools to build the wheel
    assert "--no-deps" in wheel and "--no-build-isolation" in wheel, wheel


def test_final_stage_has_no_build_tools(parsed):
    words = [w for w, _ in final(parsed)]
    assert "RUN" not in words  # nothing is installed or compiled in the final stage
    text = " ".join(rest for _, rest in final(parsed))
    for tool in ("gcc", "build-essential", "apt-get", "make ", "pip install", "/src"):
        assert tool not in text, tool
    copies = [rest for w, rest in final(parsed) if w == "COPY"]
    assert copies == ["--from=builder /opt/ghost-guard /opt/ghost-guard"]


def test_runs_as_numeric_non_root(parsed):
    users = [rest for w, rest in final(parsed) if w == "USER"]
    assert users, "no USER in the final stage"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) == 65532 and gid == "65532"
    dep = yaml.safe_load_all((REPO / "manifests/base/deployment.yaml").read_text())
    (deployment,) = [d for d in dep if d]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_entrypoint_and_cmd(parsed):
    ins = dict(final(parsed))
    assert exec_form(ins["ENTRYPOINT"]) == ["ghost-guard"]
    assert exec_form(ins["CMD"]) == ["serve"]
    assert ins["EXPOSE"] == "8443"


def healthcheck(parsed) -> tuple[list[str], list[str]]:
    (rest,) = [rest for w, rest in final(parsed) if w == "HEALTHCHECK"]
    options, _, cmd = rest.partition("CMD ")
    return shlex.split(options), exec_form(cmd)


def test_healthcheck(parsed):
    options, cmd = healthcheck(parsed)
    assert {o.split("=")[0] for o in options} == {"--interval", "--timeout", "--start-period", "--retries"}
    assert cmd[:2] == ["python", "-c"] and len(cmd) == 3
    assert "'https://127.0.0.1:8443/healthz'" in cmd[2]
    compile(cmd[2], "<healthcheck>", "exec")


def test_healthcheck_is_the_deployment_probe(parsed):
    _, cmd = healthcheck(parsed)
    (deployment,) = [d for d in yaml.safe_load_all((REPO / "manifests/base/deployment.yaml").read_text()) if d]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["exec"]["command"][:3] == cmd
    assert c["readinessProbe"]["exec"]["command"][:3] == cmd


def dockerignore_allows(path: str) -> bool:
    allowed = True
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.rstrip("/")
        parts = path.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) for i in range(len(parts)))
        if pattern.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        if hit:
            allowed = negate
    return allowed


@pytest.mark.parametrize("path,expected", [
    ("pyproject.toml", True), ("README.md", True), ("guard/cli.py", True), ("guard/http/app.py", True),
    ("certs/ca.key", False), ("certs/tls.key", False), (".git/config", False), ("tests/unit/test_certs.py", False),
    ("guard/__pycache__/cli.cpython-311.pyc", False),
], ids=lambda v: str(v))
def test_dockerignore(path, expected):
    assert dockerignore_allows(path) is expected


def test_copied_sources_exist(parsed):
    for w, rest in parsed[0]["ins"]:
        if w == "COPY":
            *sources, _dest = rest.split()
            for s in sources:
                assert (REPO / s).exists(), s
                assert dockerignore_allows(s.rstrip("/")), f"{s} is excluded by .dockerignore"
