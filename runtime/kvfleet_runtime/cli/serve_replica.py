"""`kvfleet replica`: serve one replica (its config, model, engine, cache and tiers, and the fleet
tier when the environment names a fleet)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kvfleet_runtime.cli._app import app, fail

WEIGHTS_DIGEST_ENV = "KVFLEET_WEIGHTS_DIGEST"
"""Set by the chart and by ModelRollout: the digest the pod is meant to serve."""

__all__ = ["WEIGHTS_DIGEST_ENV", "replica"]


@app.command("replica")
def replica(
    model_dir: Annotated[Path | None, typer.Option(help="Checkpoint folder (config.json + "
                                                   "*.safetensors).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 0.0.0.0).")] = None,
    config: Annotated[Path | None, typer.Option(
        help="YAML/JSON config file, watched for changes (env KVFLEET_REPLICA_CONFIG).")] = None,
    model_id: Annotated[str | None, typer.Option(help="Served model name.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="Serving dtype: bf16, fp16 or fp32 (default: the checkpoint's).")] = None,
    deterministic: Annotated[bool | None, typer.Option(
        "--deterministic/--fast",
        help="One-block prefill chunks: a cache hit equals a miss bitwise, at a measured price "
        "(default: the config's engine.deterministic, off).")] = None,
    log_level: Annotated[str, typer.Option(help="Python logging level.")] = "INFO",
) -> None:
    """Serve one replica: OpenAI-compatible completions over the prefix cache.

    Tenants come only from the router, signed with KVFLEET_ROUTER_SECRET[_FILE].
    Without it: only the tenant "default", on loopback.
    Cache control needs KVFLEET_OPERATOR_TOKEN[_FILE] (docs/security.md)."""
    from kvfleet_runtime.api import run_app
    from kvfleet_runtime.fleet.fleet_tier import attach_fleet, settings_from_env
    from kvfleet_runtime.server import (
        CONFIG_ENV,
        ReplicaAuth,
        build_replica,
        create_app,
        load_config,
    )

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_path = config or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    overrides: dict[str, Any] = {k: v for k, v in {
        "model_dir": str(model_dir) if model_dir else None, "port": port, "host": host,
        "model_id": model_id, "device": device, "dtype": dtype,
        "expected_weights_digest": os.environ.get(WEIGHTS_DIGEST_ENV) or None,
    }.items() if v is not None}
    if deterministic is not None:
        overrides["engine"] = {"deterministic": deterministic}
    try:
        cfg = load_config(config_path, overrides=overrides)
        rep = build_replica(cfg, config_path=config_path, overrides=overrides)
        fleet = settings_from_env(cfg.port)
        auth = ReplicaAuth.from_env()
    except (ValueError, OSError) as exc:
        fail(str(exc))
    logging.getLogger("kvfleet.replica").info(
        "serving %s (%s) on %s:%d", rep.model_id, rep.loaded.weights_digest, cfg.host, cfg.port)
    logging.getLogger("kvfleet.replica").info("tenant authentication: %s", auth.mode)
    app = create_app(rep, auth=auth)
    if fleet is not None:  # the fleet tier (issue 6): T2 endpoint, load report, hints
        attach_fleet(app, rep, fleet)
    run_app(app, host=cfg.host, port=cfg.port)
