"""`run_demo`: model -> fleet -> cache-off baseline -> cached run -> report, plots.

The fleet's processes live inside one `with LocalFleet(...)`: however the run ends (done, an
error, KeyboardInterrupt from Ctrl-C or the CLI's SIGTERM handler), they are stopped.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfleet_lab.demo._driver import RequestResult, drive
from kvfleet_lab.demo._fleet import FleetOptions, LocalFleet, ensure_model
from kvfleet_lab.demo._plots import write_plots
from kvfleet_lab.demo._report import build_report
from kvfleet_lab.demo._workload import Workload

__all__ = ["DemoOptions", "DemoProgress", "default_cache_dir", "run_demo"]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfleet" / "demo"


class DemoProgress(Protocol):
    def status(self, text: str) -> None: ...

    def phase(self, name: str, total: int) -> None: ...

    def result(self, result: RequestResult) -> None: ...


@dataclass(slots=True)
class DemoOptions:
    out: Path
    concurrency: int = 4
    num_replicas: int = 3
    redis_url: str | None = None
    model_dir: Path | None = None
    """None: generate (once) and reuse a checkpoint under `cache_dir`."""
    model_preset: str = "small"
    num_kv_blocks: int = 512
    """Each replica's working KV (in-flight requests), in 16-token blocks: the occupancy the
    router's spill threshold is about."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    command: str = "kvfleet demo"
    on_fleet_up: Callable[[LocalFleet], None] | None = None


def run_demo(workload: Workload, options: DemoOptions, progress: DemoProgress) -> dict[str, Any]:
    """Run the workload without and with the cache; write report.json and plots to `out`."""
    started = time.monotonic()
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    model_dir = options.model_dir
    if model_dir is None:
        progress.status(f"model: generating or reusing a '{options.model_preset}' checkpoint")
        model_dir = ensure_model(options.cache_dir, options.model_preset, 0,
                                 out / "logs" / "model.log")
    fleet_opts = FleetOptions(
        model_dir=model_dir,
        work_dir=out,
        tenants=workload.tenants,
        num_replicas=options.num_replicas,
        redis_url=options.redis_url,
        num_kv_blocks=options.num_kv_blocks,
    )
    timings: dict[str, float] = {}
    with LocalFleet(fleet_opts) as fleet:
        progress.status(f"fleet: starting a router and {options.num_replicas} replicas")
        fleet.start(cache_enabled=False)
        timings["startup"] = time.monotonic() - started
        if options.on_fleet_up is not None:
            options.on_fleet_up(fleet)
        progress.status(f"fleet: router {fleet.router_url}, replicas "
                        + ", ".join(f"{n}={u}" for n, u in fleet.replica_urls.items()))

        def run(name: str) -> list[RequestResult]:
            progress.phase(name, len(workload.requests))
            t = time.monotonic()
            results = asyncio.run(drive(workload, fleet.router_url, fleet.api_keys,
                                        concurrency=options.concurrency,
                                        on_result=progress.result))
            timings[name] = time.monotonic() - t
            return results

        baseline = run("no cache")
        fleet.set_cache(True)
        t2_before = fleet.t2_counters()
        cached = run("cache")
        t2_measured = _t2_measured(t2_before, fleet.t2_counters())
    timings["total"] = time.monotonic() - started
    fleet_info = {
        "num_replicas": options.num_replicas,
        "model_preset": options.model_preset if options.model_dir is None else "given",
        "model_dir": str(model_dir),
        "hint_index": "redis" if options.redis_url else "peer-probe (no Redis: replicas ask "
        "each other over loopback)",
        "t2_measured": t2_measured,
        "concurrency": options.concurrency,
        "num_kv_blocks": options.num_kv_blocks,
        "cpu_count": os.cpu_count(),
    }
    report = build_report(workload, baseline, cached, fleet=fleet_info, timings_s=timings,
                          command=options.command)
    (out / "report.json").write_text(json.dumps(_finite(report), indent=1) + "\n")
    report["plots"] = [str(p) for p in write_plots(report, out)]
    return report


def _t2_measured(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """What the replicas fetched over T2 during the cached run, from their own counters (the
    report's tier mix infers T2 from hit tokens; this is the transfers that happened)."""
    outcomes: dict[str, int] = {}
    blocks = num_bytes = 0
    for name, now in after.items():
        then = before.get(name, {})
        for outcome, n in (now.get("fetches") or {}).items():
            delta = int(n) - int((then.get("fetches") or {}).get(outcome, 0))
            if delta:
                outcomes[outcome] = outcomes.get(outcome, 0) + delta
        blocks += int(now.get("blocks_fetched", 0)) - int(then.get("blocks_fetched", 0))
        num_bytes += int(now.get("bytes_fetched", 0)) - int(then.get("bytes_fetched", 0))
    return {
        "fetches_ok": outcomes.get("ok", 0) + sum(
            n for o, n in outcomes.items() if o.startswith("partial_")),
        "tokens_fetched": blocks * 16,
        "bytes_fetched": num_bytes,
        "outcomes": dict(sorted(outcomes.items())),
    }


def _finite(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
