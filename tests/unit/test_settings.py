import dataclasses

import click
import pytest

from guard.core.settings import Settings, SettingsError


@pytest.mark.parametrize("kw,reason", [
    pytest.param({}, "HTTPS is the default: pass --tls-cert and --tls-key", id="no-tls"),
    pytest.param({"insecure_http": True, "bind": "0.0.0.0:8443"}, "--insecure-http serves plain HTTP and is for a "
                 "loopback sidecar only; bind 127.0.0.1 (got 0.0.0.0)", id="insecure-public"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:1", "tls_cert": "c"},
                 "--insecure-http cannot be combined", id="insecure-and-tls"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1"}, "--bind must be HOST:PORT", id="no-port"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:70000"}, "--bind port must be 1-65535", id="port-range"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "get_timeout": 5},
                 "--get-timeout must be between 0 and the scheduler's httpTimeout (5s), got 5", id="get-timeout"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "alive_ttl": 1.5},
                 "--alive-ttl must be between 0 and 1s", id="alive-ttl"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "threads": 0}, "--threads must be at least 1",
                 id="threads"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "audit_store": "etcd"},
                 "--audit-store must be `kubernetes`, `sqlite` or `sqlite:PATH`, got 'etcd'", id="audit-store"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "audit_store": "sqlite:"},
                 "--audit-store must be", id="audit-store-empty-path"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "audit_max_age": 0},
                 "--audit-retention must be positive", id="audit-retention"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "audit_queue_size": 0},
                 "--audit-queue-size must be at least 1", id="audit-queue-size"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "audit_write_qps": 0},
                 "--audit-write-qps must be positive", id="audit-write-qps"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:80", "prepare_idle_after": -1},
                 "--prepare-idle-after must be between 0 (always verify ahead) and 86400 seconds, got -1",
                 id="prepare-idle-after"),
])
def test_invalid_settings_name_the_flag(kw, reason):
    with pytest.raises(SettingsError) as e:
        Settings(**kw).validate()
    assert str(e.value).startswith(reason)


@pytest.mark.parametrize("kw", [
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:8080"}, id="loopback-http"),
    pytest.param({"insecure_http": True, "bind": "[::1]:8080"}, id="loopback-v6"),
    pytest.param({"insecure_http": True, "bind": "localhost:8080"}, id="localhost"),
    pytest.param({"tls_cert": "c.pem", "tls_key": "k.pem"}, id="https-default-bind"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:8080", "audit_store": "kubernetes"}, id="audit-kubernetes"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:8080", "audit_store": "sqlite:/tmp/a.db"}, id="audit-sqlite-path"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:8080", "audit_store": "sqlite"}, id="audit-sqlite"),
    pytest.param({"insecure_http": True, "bind": "127.0.0.1:8080", "prepare_idle_after": 0}, id="always-verify-ahead"),
])
def test_valid_settings(kw):
    assert Settings(**kw).validate() is not None


NO_FIELD = "(no Settings field of this name)"


def defaults_that_differ(command: click.Command, defaults: dict[str, object]) -> dict[str, tuple[object, object]]:
    """Option name -> (the option's default, the Settings field's) for every option of ``command``
    whose default is not the field's; an option without a field of its name gets NO_FIELD."""
    return {p.name: (p.default, defaults.get(p.name, NO_FIELD)) for p in command.params
            if isinstance(p, click.Option) and p.name and p.default != defaults.get(p.name, NO_FIELD)}


SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def test_every_serve_option_takes_its_default_from_settings():
    """`serve` has one option per Settings field, and each option's default is the field's."""
    from guard.cli import serve

    assert {p.name for p in serve.params if isinstance(p, click.Option)} == set(SETTINGS_DEFAULTS)
    assert defaults_that_differ(serve, SETTINGS_DEFAULTS) == {}


@pytest.mark.parametrize("name", ["report", "diagnose", "heal"])
def test_options_shared_with_serve_take_its_defaults(name):
    """The commands that dial the replicas as `serve` does verify the same TLS server name by default."""
    from guard.cli import main

    command = main.commands[name]
    shared = [p for p in command.params if p.name in ("apiserver_server_name", "apiserver_replicas", "kubeconfig")]
    assert "apiserver_server_name" in {p.name for p in shared}
    assert {p.name: p.default for p in shared} == {p.name: SETTINGS_DEFAULTS[p.name] for p in shared}


def test_serve_help_shows_every_default_and_variable():
    """--help names each option's GHOST_GUARD_<FLAG> variable and its default (the Settings field's)."""
    from click.testing import CliRunner

    from guard.cli import main, serve

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=10_000).output.split())
    for p in serve.params:
        assert isinstance(p, click.Option)
        flag = p.opts[0]
        envvar = "GHOST_GUARD_" + flag.lstrip("-").upper().replace("-", "_")
        assert envvar in text, flag
        if SETTINGS_DEFAULTS[p.name] not in (None, False):
            shown = SETTINGS_DEFAULTS[p.name]
            shown = ("" if shown else "no-") + flag.lstrip("-") if isinstance(shown, bool) else shown
            assert f"default: {shown}" in text, flag


def test_a_default_written_twice_is_found():
    """The check above fails when an option writes its own default (or names no field)."""
    @click.command()
    @click.option("--get-timeout", type=float, default=1.0)
    @click.option("--threads", type=int, default=8)
    @click.option("--prepare/--no-prepare", default=True)
    @click.option("--no-such-setting", default="x")
    def command(**kwargs: object) -> None:
        pass

    assert SETTINGS_DEFAULTS["get_timeout"] == 1.0 and SETTINGS_DEFAULTS["prepare"] is True
    assert defaults_that_differ(command, SETTINGS_DEFAULTS) == {
        "threads": (8, SETTINGS_DEFAULTS["threads"]),
        "no_such_setting": ("x", NO_FIELD),
    }


_LOCAL = {"insecure_http": True, "bind": "127.0.0.1:80"}


@pytest.mark.parametrize("kw,reason", [
    pytest.param({"missing_after": 0}, "--missing-after must be between 0 and 3600 seconds, got 0", id="missing-zero"),
    pytest.param({"missing_after": -1}, "--missing-after must be between 0 and 3600 seconds, got -1", id="missing-negative"),
    pytest.param({"frozen_after": 7200}, "--frozen-after must be between 0 and 3600 seconds, got 7200", id="frozen-large"),
    pytest.param({"frozen_after": float("nan")}, "--frozen-after must be between 0 and 3600 seconds, got nan",
                 id="frozen-nan"),
])
def test_cache_health_flags_are_checked(kw, reason):
    with pytest.raises(SettingsError) as e:
        Settings(**_LOCAL, **kw).validate()
    assert str(e.value) == reason


@pytest.mark.parametrize("frozen_after, interval", [
    pytest.param(30.0, 10.0, id="default-every-10s"),
    pytest.param(1.5, 1.0, id="at-least-1s"),
    pytest.param(600.0, 20.0, id="at-most-20s"),
])
def test_revision_interval_is_a_third_of_frozen_after_within_bounds(frozen_after, interval):
    assert Settings(**_LOCAL, frozen_after=frozen_after).validate().revision_interval == interval
@pytest.mark.parametrize("spec,expect", [
    pytest.param(None, ("sqlite", "/d.db"), id="default"),
    pytest.param("sqlite", ("sqlite", "/d.db"), id="sqlite-means-audit-db"),
    pytest.param("sqlite:/x/a.db", ("sqlite", "/x/a.db"), id="sqlite-path"),
    pytest.param("kubernetes", ("kubernetes", None), id="kubernetes"),
])
def test_parse_store(spec, expect):
    from guard.audit.backend import parse_store

    assert parse_store(spec, "/d.db") == expect
