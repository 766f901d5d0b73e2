"""`kvfleet bench router` and `kvfleet bench hints`: fleet-scale figures (`kvfleet_lab.fleet`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from kvfleet_lab.cli.benchmarks import bench
from kvfleet_runtime.cli._app import fail

__all__ = ["hints", "router_capacity"]


@bench.command("router")
def router_capacity(
    prompt_tokens: Annotated[
        int, typer.Option(help="Prompt length (text, byte tokenizer).")
    ] = 2000,
    concurrency: Annotated[int, typer.Option(help="Closed-loop clients for the capacity.")] = 32,
    seconds: Annotated[float, typer.Option(help="Seconds per measured level.")] = 5.0,
    replicas: Annotated[int, typer.Option(help="Stub replicas behind the router.")] = 4,
    profile: Annotated[bool, typer.Option(help="cProfile the router at 80% with the override.")]
    = True,
    override_cost: Annotated[
        bool,
        typer.Option(help="Instead: the override's own cost per stage, the hint lookup with the "
                          "chain as KEYS (before) and as one argument (now), side by side."),
    ] = False,
    rounds: Annotated[int, typer.Option(help="Rounds of --override-cost.")] = 2000,
) -> None:
    """One router process: capacity (requests/s) and overhead p50/p99 at 50/80/100% of it, with
    and without the cache-aware override (tokenize + hint lookup); JSON."""
    from kvfleet_lab.fleet.router_capacity import bench_router_capacity

    if prompt_tokens < 16 or concurrency < 1 or seconds <= 0 or replicas < 1 or rounds < 1:
        fail("--prompt-tokens >= 16, --concurrency >= 1, --seconds > 0, --replicas >= 1, "
             "--rounds >= 1")
    if override_cost:
        from kvfleet_lab.fleet.override_cost import bench_override_cost

        try:
            cost = bench_override_cost(prompt_tokens=prompt_tokens, rounds=rounds)
        except (OSError, RuntimeError) as exc:
            fail(str(exc))
        Console(highlight=False).print(cost.to_json(), markup=False)
        return
    try:
        report = bench_router_capacity(prompt_tokens=prompt_tokens, concurrency=concurrency,
                                       seconds_per_level=seconds, num_replicas=replicas,
                                       profile=profile)
    except (OSError, RuntimeError) as exc:
        fail(str(exc))
    Console(highlight=False).print(report.to_json(), markup=False)


@bench.command("hints")
def hints(
    targets: Annotated[
        str, typer.Option(help="Comma-separated: redis, cluster-3, cluster-6 (masters).")
    ] = "redis,cluster-3,cluster-6",
    replicas: Annotated[
        str, typer.Option(help="Comma-separated simulated replica counts, run until saturation.")
    ] = "10,44,100,200,400",
    seconds: Annotated[float, typer.Option(help="Seconds per level.")] = 4.0,
    publish_fraction: Annotated[
        float, typer.Option(help="Share of each request's 100 blocks published (1: cold fleet).")
    ] = 1.0,
    lookups_per_request: Annotated[
        float, typer.Option(help="Hint lookups per request (router + replica's own).")
    ] = 2.0,
    layouts: Annotated[bool, typer.Option(help="Also compare the two cluster layouts.")] = True,
    keys: Annotated[bool, typer.Option(help="Instead: block names by raw hash (default user) vs "
                                            "keyed digests (ACL role users), side by side on "
                                            "redis and cluster-3.")] = False,
) -> None:
    """N simulated replicas' hint publish and lookup streams against one Redis and 3-/6-master
    Redis Clusters on loopback; and the cluster key layouts compared; JSON."""
    from kvfleet_lab.fleet.hints import bench_hints

    try:
        counts = tuple(int(x) for x in replicas.split(",") if x.strip())
    except ValueError:
        fail(f"--replicas expects numbers like 10,44,100, got {replicas!r}")
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    if not counts or min(counts) < 1 or seconds <= 0 or not 0 < publish_fraction <= 1:
        fail("--replicas >= 1 each, --seconds > 0, --publish-fraction in (0, 1]")
    try:
        report = bench_hints(targets=names, replica_counts=counts, seconds=seconds,
                             publish_fraction=publish_fraction,
                             lookups_per_request=lookups_per_request, layouts=layouts,
                             keys=keys)
    except ValueError as exc:
        fail(str(exc))
    except (OSError, RuntimeError) as exc:
        fail(str(exc))
    Console(highlight=False).print(report.to_json(), markup=False)
