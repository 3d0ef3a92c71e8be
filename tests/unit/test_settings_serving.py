"""Settings of the serving layer (connection deadlines and limits, TLS version, identities): defaults and validation."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from guard.core.settings import Settings, SettingsError

BASE = {"insecure_http": True, "bind": "127.0.0.1:8443"}


def test_defaults_fit_the_scheduler():
    s = Settings()
    assert (s.tls_handshake_timeout, s.header_timeout, s.body_timeout, s.write_timeout) == (2.0, 5.0, 5.0, 5.0)
    assert (s.keepalive_timeout, s.body_min_rate) == (30.0, 1024 * 1024)
    assert (s.max_connections, s.max_connections_per_client) == (512, 64)
    # Buffered requests bound the worker's memory: room for a body at the limit, and at most four
    # (docs/RELIABILITY.md: four at once keep the worker under half its 512 Mi limit).
    assert s.max_body_bytes <= s.max_buffered_bytes <= 4 * s.max_body_bytes
    assert s.tls_min_version == "1.2"
    Settings(**BASE).validate()


@pytest.mark.parametrize("field,value,flag", [
    ("tls_handshake_timeout", 0, "--tls-handshake-timeout"), ("header_timeout", -1, "--header-timeout"),
    ("body_timeout", 301, "--body-timeout"), ("write_timeout", 0, "--write-timeout"),
    ("keepalive_timeout", 0, "--keepalive-timeout"), ("body_min_rate", 0, "--body-min-rate"),
    ("max_connections", 0, "--max-connections"), ("max_connections_per_client", 0, "--max-connections-per-client"),
    ("max_connections_per_client", 600, "--max-connections-per-client"),
    ("max_buffered_bytes", 1024, "--max-buffered-bytes"), ("tls_min_version", "1.1", "--tls-min-version"),
])
def test_bad_values_name_their_flag(field, value, flag):
    with pytest.raises(SettingsError, match=flag):
        Settings(**BASE, **{field: value}).validate()


def test_cli_defaults_equal_the_dataclass():
    """Every serving option's click default repeats the Settings default (and has its GHOST_GUARD_ variable)."""
    from guard.cli import serve

    defaults = Settings()
    names = ("tls_handshake_timeout", "header_timeout", "body_timeout", "body_min_rate", "write_timeout",
             "keepalive_timeout", "max_connections", "max_connections_per_client", "max_buffered_bytes",
             "tls_min_version", "scheduler_identities", "apiserver_identities", "monitoring_identities")
    params = {p.name: p for p in serve.params}
    for name in names:
        assert params[name].default == getattr(defaults, name), name
        assert params[name].envvar == "GHOST_GUARD_" + name.upper(), name


def test_env_sets_a_deadline():
    from guard.cli import main

    r = CliRunner().invoke(main, ["serve", "--insecure-http", "--bind", "127.0.0.1:1", "--kubeconfig", "/nonexistent"],
                           env={"GHOST_GUARD_HEADER_TIMEOUT": "0"})
    assert r.exit_code == 2 and "--header-timeout must be between 0 and 300 seconds, got 0" in r.output
