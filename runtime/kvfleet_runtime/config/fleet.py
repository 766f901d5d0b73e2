"""The fleet config: what the operator publishes (a ConfigMap, mounted as a file) and the router
and every replica read. One schema, one loader, shared by all three.

The file is YAML or JSON. Unknown fields are refused: a typo in a ConfigMap must not silently
turn a tier on or off. Readers watch the file and reload it on change; a file that fails to
parse keeps the last good config in force.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfleet_runtime.config.watch import (
    MAX_CONFIG_BYTES,
    ConfigFileWatcher,
    one_line_error,
    parse_config_text,
)
from kvfleet_runtime.wire import Engine

log = logging.getLogger(__name__)

FLEET_CONFIG_FILENAME = "fleet.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierToggles(_Strict):
    """Decided by the operator from the break-even arithmetic and measured bandwidths."""

    t0_device: bool = True
    t1_host: bool = True
    t2_peer: bool = True
    nvme: bool = False
    nvme_shadow: bool = False


class AdmissionSettings(_Strict):
    min_sightings: Annotated[int, Field(ge=1, le=16)] = 1
    hot_sightings: Annotated[int, Field(ge=2, le=1024)] = 3
    pin_max_tokens: Annotated[int, Field(ge=0)] = 2048
    store_queue_size: Annotated[int, Field(ge=1)] = 256
    thrash_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9


class AffinitySettings(_Strict):
    k: Annotated[int, Field(ge=1, le=16)] = 3
    occupancy_threshold: Annotated[float, Field(gt=0, le=1)] = 0.85


class ReplicaEndpoint(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[^,\s]+$")]
    """A pod name in the operator's config; never a comma or a space: the name is the audience
    of a tenant assertion, and the EPP lists one assertion per replica comma-separated."""
    url: Annotated[str, Field(pattern=r"^https?://")]
    weights_digest: str | None = None
    ready: bool = True
    engine: Engine = "kvfleet"
    """What serves it (`wire.ENGINES`; the operator copies the pod's `kvfleet.dev/engine`
    annotation, which the chart sets from `replica.engine`): the router sets `cache_salt` in
    what it sends a `vllm` replica and probes its `/health`. Left out of the text when kvfleet
    (`dump_fleet_config`)."""
    peer_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """Where peers fetch its T2 blocks when that is not `url`: a vLLM replica's connector serves
    T2 on its own port (`kvfleet.peer_port`; the operator reads the pod's `kvfleet.dev/peer-port`).
    Every peer-probe and fetch user takes `peer_url or url`. Left out of the text when None."""


class FleetConfig(_Strict):
    """Everything a router or replica needs from the control plane."""

    version: Literal[1] = 1
    policy: str = ""
    generation: Annotated[int, Field(ge=0)] = 0
    model_id: str = ""
    tiers: TierToggles = TierToggles()
    admission: AdmissionSettings = AdmissionSettings()
    affinity: AffinitySettings = AffinitySettings()
    recompute_s_per_token: Annotated[float, Field(gt=0)] | None = None
    replicas: tuple[ReplicaEndpoint, ...] = ()
    home_sets: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    platform_prefixes: tuple[str, ...] = ()


def parse_fleet_config(text: str | bytes, source: str = "<fleet config>") -> FleetConfig:
    """Parse YAML or JSON text within the config bounds (`config.watch.parse_config_text`);
    raises ValueError, one line naming the source and the offending field."""
    data = parse_config_text(text, source) if text.strip() else {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at top level, got {type(data).__name__}")
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ValueError(one_line_error(f"{source}: {problems}")) from None


def load_fleet_config(path: Path) -> FleetConfig:
    try:
        with path.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read fleet config {path}: {exc.strerror or exc}") from exc
    return parse_fleet_config(text, str(path))


def check_successor(
    previous: FleetConfig | None, new: FleetConfig, source: str = "<fleet config>"
) -> FleetConfig:
    """`new`, unless it lacks the `generation` that the config in force had: the operator always
    writes one, so a file without it after one with it is a truncated write that still parsed
    (ValueError naming the source). Generations may go down: a recreated policy restarts at 1."""
    if (
        previous is not None
        and "generation" in previous.model_fields_set
        and "generation" not in new.model_fields_set
    ):
        raise ValueError(
            f"{source}: no `generation` (the config in force has generation "
            f"{previous.generation}): refusing what looks like a truncated write"
        )
    return new


def next_fleet_config(
    path: Path,
    content: bytes | None,
    in_force: FleetConfig | None,
    watcher: ConfigFileWatcher | None,
) -> FleetConfig | None:
    """The fleet config to apply next, for every reader of the file (router, fleet tier, vLLM
    connector): `content` as `watcher.poll()` read it, else the file itself (start-up). None when
    it does not parse or drops the generation in force (`check_successor`): the config in force
    stays, the watcher hands the content out again until the file changes, and the refusal is
    logged once, then at debug. The caller calls `watcher.accept(content)` once it applied it."""
    try:
        new = load_fleet_config(path) if content is None else parse_fleet_config(content,
                                                                                 str(path))
        return check_successor(in_force, new, str(path))
    except (ValueError, RecursionError, MemoryError) as exc:
        repeated = False
        if content is not None and watcher is not None:
            watcher.reject(content, str(exc))
            repeated = watcher.repeated
        log.log(logging.DEBUG if repeated else logging.ERROR,
                "fleet config rejected, keeping the last good one: %s", one_line_error(str(exc)))
        return None


def dump_fleet_config(config: FleetConfig) -> str:
    """Canonical text (sorted JSON, which is also YAML): equal configs give equal bytes, so the
    operator's ConfigMap update is a no-op when nothing changed."""
    data = config.model_dump(mode="json")
    for replica in data["replicas"]:
        # A kvfleet fleet's text stays what it was before `engine` and `peer_url` existed, so a
        # router or replica that predates the fields still reads it during an upgrade.
        if replica["engine"] == "kvfleet":
            del replica["engine"]
        if replica["peer_url"] is None:
            del replica["peer_url"]
    return json.dumps(data, sort_keys=True, indent=2) + "\n"
