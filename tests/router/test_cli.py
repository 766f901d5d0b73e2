"""`kvfleet router` and `kvfleet bench fleet` refuse bad input with exit code 2 and one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_runtime.cli import app


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  acme: [sk-acme]\n")
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--fleet-config or at least one --replica"),
        (["--replica", "r0"], "NAME=http://host:port"),
        (["--replica", "r0=http://a:1", "--replica", "r0=http://b:1"], "given twice"),
        (["--replica", "r0=http://a:1", "--k", "0"], "--k must be"),
        (["--replica", "r0=http://a:1", "--occupancy-threshold", "1.5"], "occupancy-threshold"),
        (["--replica", "r0=http://a:1", "--recompute-s-per-token", "0"], "recompute"),
        (["--replica", "r0=http://a:1", "--kv-events", "r0"], "NAME=tcp://host:port"),
        (["--replica", "r0=http://a:1", "--kv-events", "r0=http://a:1"], "NAME=tcp://host:port"),
        (["--replica", "r0=http://a:1", "--kv-events", "r0=tcp://a:1", "--kv-events",
          "r0=tcp://b:1"], "--kv-events 'r0' given twice"),
        (["--replica", "r0=http://a:1", "--kv-events-port", "0"], "--kv-events-port must be"),
    ],
)
def test_router_bad_flags(keys: Path, extra: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["router", "--keys", str(keys), *extra])
    assert result.exit_code == 2
    assert message in result.output


def test_router_bad_keys_file(tmp_path: Path) -> None:
    bad = tmp_path / "keys.yaml"
    bad.write_text("tenants:\n  __platform__: [k]\n")
    result = CliRunner().invoke(app, ["router", "--keys", str(bad), "--replica", "r0=http://a:1"])
    assert result.exit_code == 2 and "__platform__" in result.output


def test_bench_fleet_bad_flags(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "fleet", "--skip", "everything"])
    assert result.exit_code == 2 and "--skip" in result.output
    result = runner.invoke(
        app,
        [
            "bench",
            "fleet",
            "--skip",
            "t2",
            "--skip",
            "router",
            "--trace",
            str(tmp_path / "none.jsonl"),
        ],
    )
    assert result.exit_code == 2 and "--trace: trace not found" in result.output
    result = runner.invoke(app, ["bench", "fleet", "--t2-layout", "8,8", "--skip", "hit-rates"])
    assert result.exit_code == 2 and "LAYERS,KV_HEADS,HEAD_DIM" in result.output


def test_a_redis_password_on_the_command_line_is_refused(keys: Path) -> None:
    # Issue 25: a password in argv shows in the pod's process list.
    result = CliRunner().invoke(app, ["router", "--keys", str(keys), "--replica",
                                      "r0=http://a:1", "--redis-url", "redis://:hunter2@r:6379/0"])
    assert result.exit_code == 2 and "must not hold a password" in result.output
    assert "hunter2" not in result.output


def test_the_redis_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from kvfleet_runtime.cli.router import redis_url_from

    secret = tmp_path / "password"
    secret.write_text("p@ss/word\n")
    assert redis_url_from(None, {}) is None
    assert redis_url_from(None, {"KVFLEET_REDIS_URL": "redis://:a@r:1/0"}) == "redis://:a@r:1/0"
    assert redis_url_from("redis://r:1/0", {"KVFLEET_REDIS_PASSWORD": "b"}) == "redis://:b@r:1/0"
    assert redis_url_from(None, {"KVFLEET_REDIS_URL": "redis://r:1/0",
                                 "KVFLEET_REDIS_PASSWORD_FILE": str(secret)}) == (
        "redis://:p%40ss%2Fword@r:1/0")


def test_cli_defaults_are_the_router_state_defaults() -> None:
    """An option named like a RouterState field defaults to that field's default: the CLI
    states each deadline and limit, the state holds them, and a change to one must reach both."""
    import dataclasses
    import inspect

    from kvfleet_runtime.cli.router import router
    from kvfleet_runtime.router import RouterState

    fields = {f.name: f.default for f in dataclasses.fields(RouterState)
              if f.default is not dataclasses.MISSING}
    shared = {name: p.default for name, p in inspect.signature(router).parameters.items()
              if name in fields}
    assert {"upstream_first_byte_timeout_s", "upstream_read_timeout_s", "replica_backoff_s",
            "body_read_timeout_s", "header_read_timeout_s", "poll_interval_s"} <= set(shared)
    assert {name: fields[name] for name in shared} == shared
