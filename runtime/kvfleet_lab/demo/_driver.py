"""Drive a workload through the router: closed loop, `concurrency` requests in flight.

Each request is a 1-token completion (`max_tokens: 1`, greedy) of a token-id prompt, so its
latency through the router is its time to first token: prefill of what the cache did not supply,
one sampling step and the HTTP hops. A session's requests go out one after another (a transcript
turn needs the previous turn), everything else in workload order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvfleet_lab.demo._workload import DemoRequest, Workload

__all__ = ["RequestResult", "drive"]

REQUEST_TIMEOUT_S = 300.0


@dataclass(slots=True)
class RequestResult:
    index: int
    tenant: str
    population: str
    prompt_tokens: int
    start_s: float
    """Since the phase started."""
    end_s: float
    ttft_s: float
    status: int
    """HTTP status; 0 when no answer came (connection error or timeout)."""
    cached_tokens: int = 0
    tier: str = "none"
    """The replica's `X-Kvfleet-Cache-Tier`: t0, t1 or none."""
    replica: str = ""
    route: str = ""
    """The router's `X-Kvfleet-Route`: home, spill or warm."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


async def _one(
    session: aiohttp.ClientSession, url: str, key: str, req: DemoRequest, t0: float
) -> RequestResult:
    body = {"prompt": list(req.token_ids), "max_tokens": 1, "temperature": 0}
    start = time.monotonic()
    result = RequestResult(req.index, req.tenant, req.population, len(req.token_ids),
                           start - t0, 0.0, 0.0, 0)
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            data = await resp.json(content_type=None)
            end = time.monotonic()
            result.status = resp.status
            result.replica = resp.headers.get("X-Kvfleet-Replica", "")
            result.route = resp.headers.get("X-Kvfleet-Route", "")
            result.tier = resp.headers.get("X-Kvfleet-Cache-Tier", "none")
            if resp.status == 200:
                usage = data["usage"]
                result.prompt_tokens = int(usage["prompt_tokens"])
                result.cached_tokens = int(usage["prompt_tokens_details"]["cached_tokens"])
            else:
                result.error = str(data.get("error", {}).get("message", ""))[:200]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        end = time.monotonic()
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.end_s = end - t0
    result.ttft_s = end - start
    return result


async def drive(
    workload: Workload,
    router_url: str,
    api_keys: dict[str, str],
    *,
    concurrency: int,
    on_result: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send every request of `workload`; results in workload order."""
    results: list[RequestResult | None] = [None] * len(workload.requests)
    done: dict[int, asyncio.Event] = {r.index: asyncio.Event() for r in workload.requests}
    previous: dict[int, int] = {}
    last_of_session: dict[str, int] = {}
    for r in workload.requests:
        if r.session is not None:
            if r.session in last_of_session:
                previous[r.index] = last_of_session[r.session]
            last_of_session[r.session] = r.index
    slots = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency + 1)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def run(pos: int, req: DemoRequest) -> None:
            try:
                before = previous.get(req.index)
                if before is not None:
                    await done[before].wait()
                async with slots:
                    res = await _one(session, router_url, api_keys[req.tenant], req, t0)
                results[pos] = res
                if on_result is not None:
                    on_result(res)
            finally:
                done[req.index].set()

        # Tasks are created in workload order; the semaphore admits them in that order too.
        await asyncio.gather(*(run(i, r) for i, r in enumerate(workload.requests)))
    return [r for r in results if r is not None]
