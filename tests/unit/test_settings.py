import pytest

from guard.settings import Settings, SettingsError


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


def test_serve_flags_repeat_the_settings_defaults():
    """Every `serve` option's default equals the Settings field's (the brief: both are kept equal)."""
    import dataclasses

    from guard.cli import serve

    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    options = [p for p in serve.params if p.name != "help"]
    assert {p.name for p in options} == set(fields)
    assert {p.name: p.default for p in options} == fields


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
    from guard.auditstore import parse_store

    assert parse_store(spec, "/d.db") == expect
