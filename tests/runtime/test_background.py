"""The supervisor of every background loop (issue 44 item 4): a loop that raises or is killed
(cancelled by anyone but its supervisor) is logged in one ERROR line and started again; one that
returns has finished; stopping cancels them all. Then the kill itself, in a real replica and a
real router on loopback: their config watchers are killed, and the next valid file still applies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvfleet_runtime.background import Supervisor
from tests.router.conftest import (  # noqa: F401 (fixtures: fake replicas, a router)
    FakeReplica,
    StartRouter,
    replicas,
    start_router,
)
from tests.runtime.server.conftest import (  # noqa: F401 (fixtures: the real replica)
    TEST_CONFIG,
    RunningReplica,
    _one_cpu_thread,
    model_dir,
    running,
)


def _task_named(name: str) -> asyncio.Task[object]:
    found = [t for t in asyncio.all_tasks() if t.get_name() == name]
    assert len(found) == 1, [t.get_name() for t in asyncio.all_tasks()]
    return found[0]


async def test_a_loop_that_raises_is_logged_once_and_restarted(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    runs: list[int] = []

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError("boom\nsecond line")
        await asyncio.Event().wait()

    supervisor = Supervisor(min_backoff_s=0.01, max_backoff_s=0.02)
    supervisor.start("the-loop", loop)
    for _ in range(200):
        if len(runs) == 3:
            break
        await asyncio.sleep(0.01)
    assert runs == [0, 1, 2] and supervisor.restarts == {"the-loop": 2}
    deaths = [r for r in caplog.records if "background loop the-loop died" in r.getMessage()]
    assert len(deaths) == 2 and all(r.levelno == logging.ERROR for r in deaths)
    assert all("\n" not in r.getMessage() for r in deaths)
    assert deaths[0].exc_info is not None and deaths[1].exc_info is None  # traceback once
    assert "RuntimeError: boom second line" in supervisor.last_death["the-loop"]
    await supervisor.stop()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("the-loop")]


async def test_a_loop_killed_from_outside_is_restarted_and_one_that_returns_is_done() -> None:
    started = asyncio.Event()
    runs = 0

    async def forever() -> None:
        nonlocal runs
        runs += 1
        started.set()
        await asyncio.Event().wait()

    supervisor = Supervisor(min_backoff_s=0.01)
    supervisor.start("forever", forever)
    await started.wait()
    started.clear()
    _task_named("forever").cancel()  # the kill
    await asyncio.wait_for(started.wait(), 10)
    assert runs == 2 and supervisor.last_death["forever"] == "cancelled from outside its supervisor"

    async def once() -> None:
        return None

    handle = supervisor.start("once", once)
    await asyncio.wait_for(handle, 10)  # finished: not restarted
    assert supervisor.restarts["once"] == 0
    await supervisor.stop()


async def test_back_off_doubles_to_its_bound_and_cancelling_the_handle_stops_the_loop(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)

    async def dies() -> None:
        raise ValueError("again")

    supervisor = Supervisor(min_backoff_s=0.01, max_backoff_s=0.04)
    handle = supervisor.start("dies", dies)
    for _ in range(300):
        if supervisor.restarts["dies"] >= 5:
            break
        await asyncio.sleep(0.01)
    waits = [r.args[2] for r in caplog.records if r.args and r.args[0] == "dies"]
    assert waits[:5] == [0.01, 0.02, 0.04, 0.04, 0.04]
    handle.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handle
    with pytest.raises(ValueError, match="need 0"):
        Supervisor(min_backoff_s=0)


def _wait(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_replicas_config_watcher_killed_is_restarted_and_applies_the_next_file(
    running: RunningReplica, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level(logging.INFO)
    replica = running.replica
    loop = replica.engine._loop
    assert loop is not None
    before = replica.supervisor.restarts["kvfleet-config-watch"]

    async def kill() -> None:
        _task_named("kvfleet-config-watch").cancel()

    asyncio.run_coroutine_threadsafe(kill(), loop).result(10)
    _wait(lambda: replica.supervisor.restarts["kvfleet-config-watch"] == before + 1, "the death")
    try:
        changed = json.loads(json.dumps(TEST_CONFIG))
        changed["limits"]["max_tokens"] = 7
        running.config_path.write_text(yaml.safe_dump(changed))
        _wait(lambda: replica.config.limits.max_tokens == 7, "the next valid file")
    finally:
        running.config_path.write_text(yaml.safe_dump(TEST_CONFIG))
        _wait(lambda: replica.config.limits.max_tokens == 32, "the test config")
    deaths = [r.getMessage() for r in caplog.records
              if "background loop kvfleet-config-watch died" in r.getMessage()]
    assert len(deaths) == 1 and "cancelled from outside" in deaths[0]


async def test_the_routers_poll_loop_killed_is_restarted_and_applies_the_next_fleet_config(
    replicas: list[FakeReplica], start_router: StartRouter, tmp_path: Path  # noqa: F811
) -> None:
    path = tmp_path / "fleet.json"
    reps = [{"name": r.name, "url": r.url} for r in replicas]
    path.write_text(json.dumps({"replicas": reps, "home_sets": {"acme": ["r2"]}, "generation": 1}))
    router = await start_router(replicas[:1], config_path=path)
    router.state.picker.supervisor.min_backoff_s = 0.01
    await router.refresh()
    _task_named("router-poll").cancel()
    for _ in range(200):
        if router.state.picker.supervisor.restarts["router-poll"]:
            break
        await asyncio.sleep(0.02)
    async with router.session.get(router.url + "/readyz") as r:
        assert (await r.json())["background_restarts"] == {"router-poll": 1}
    path.write_text(json.dumps({"replicas": reps, "home_sets": {"acme": ["r4"]}, "generation": 2}))
    for _ in range(200):
        config = router.state.view.config
        if config is not None and config.generation == 2:
            break
        await asyncio.sleep(0.05)
    await router.refresh()
    _, _, body = await router.post({"prompt": "x"})
    assert body["replica"] == "r4"
