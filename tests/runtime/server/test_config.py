"""Replica config: file, environment and overrides, strict keys, live vs restart-only fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_runtime.server import ReplicaConfig, load_config
from kvfleet_runtime.server._config import restart_fields


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "replica.yaml"
    path.write_text("model_id: from-file\nport: 9000\nlimits: {max_tokens: 10}\n")
    env = {"KVFLEET_REPLICA_PORT": "9001", "KVFLEET_REPLICA_LIMITS__MAX_TOKENS": "20",
           "KVFLEET_REPLICA_MODEL_ID": "123", "UNRELATED": "x",
           "KVFLEET_REPLICA_CONFIG": "/the/file/path/itself"}
    cfg = load_config(path, environ=env, overrides={"port": 9002})
    assert (cfg.model_id, cfg.port, cfg.limits.max_tokens) == ("123", 9002, 20)
    assert cfg.limits.max_prompt_tokens == 2048  # untouched defaults survive the merge


def test_json_file_works_too(tmp_path: Path) -> None:
    path = tmp_path / "replica.json"
    path.write_text('{"cache": {"enabled": false}}')
    assert load_config(path, environ={}).cache.enabled is False


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        ("limits: {max_tokenz: 3}\n", {}, "limits.max_tokenz: Extra inputs are not permitted"),
        ("port: 70000\n", {}, "port: Input should be less than or equal to 65535"),
        ("- a list\n", {}, "must hold a mapping"),
        ("a: [unclosed\n", {}, "cannot read config file"),
        ("", {"KVFLEET_REPLICA_ENGINE__MAX_BATCH_SIZE": "0"}, "engine.max_batch_size"),
        ("engine: {max_tokens_per_step: 100}\n", {},
         "engine.max_tokens_per_step: Input should be a multiple of 16"),
        ("engine: {max_tokens_per_step: 32, max_batch_size: 32}\n", {},
         "max_tokens_per_step 32 must be at least max_batch_size 32 + 16"),
    ],
)
def test_bad_config_names_the_problem(tmp_path: Path, text: str, env: dict[str, str],
                                      needle: str) -> None:
    path = tmp_path / "replica.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(path, environ=env)
    assert needle in str(err.value)


def test_restart_fields_lists_only_non_live_changes() -> None:
    old = ReplicaConfig()
    new = ReplicaConfig.model_validate({
        "port": 1, "limits": {"max_tokens": 5}, "engine": {"num_kv_blocks": 7, "max_batch_size": 2,
                                                           "max_tokens_per_step": 512,
                                                           "deterministic": True},
        "cache": {"enabled": False, "t0_enabled": False, "num_t1_blocks": 3},
    })
    # the budget and T0 apply live; determinism changes the cache key, so it waits for a restart
    assert restart_fields(old, new) == ["port", "engine.num_kv_blocks", "engine.deterministic",
                                        "cache.num_t1_blocks"]


@pytest.mark.parametrize(
    ("text", "env", "where"),
    [
        ("cache: {num_t0_blocks: 512}\n", {}, "in "),
        ("", {"KVFLEET_REPLICA_CACHE__NUM_T0_BLOCKS": "0"}, "from the environment"),
    ],
)
def test_the_old_t0_key_is_refused_naming_its_replacement(
    tmp_path: Path, text: str, env: dict[str, str], where: str
) -> None:
    path = tmp_path / "replica.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(path, environ=env)
    message = str(err.value)
    assert f"cache.num_t0_blocks ({where}" in message
    assert "was replaced by cache.t0_enabled (true or false" in message
    assert "KVFLEET_REPLICA_CACHE__NUM_T0_BLOCKS by KVFLEET_REPLICA_CACHE__T0_ENABLED" in message
    with pytest.raises(ValueError, match=r"cache\.num_t0_blocks \(in the overrides\)"):
        load_config(None, environ={}, overrides={"cache": {"num_t0_blocks": 1}})


def test_t0_enabled_is_a_live_boolean(tmp_path: Path) -> None:
    path = tmp_path / "replica.yaml"
    path.write_text("cache: {t0_enabled: false}\n")
    cfg = load_config(path, environ={"KVFLEET_REPLICA_CACHE__T0_ENABLED": "true"})
    assert cfg.cache.t0_enabled is True  # the environment wins over the file
    assert ReplicaConfig().cache.t0_enabled is True
    assert restart_fields(ReplicaConfig(), cfg.model_copy(
        update={"cache": cfg.cache.model_copy(update={"t0_enabled": False})})) == []
