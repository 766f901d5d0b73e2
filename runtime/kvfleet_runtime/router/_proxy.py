"""The proxied completions: the picker's choice, then each replica of its failover order in turn.

A replica that cannot be reached, or answers 503 before any byte was sent to the client, is
skipped and the request goes to the next replica of the pick's failover order (what deciding
again without it chooses; at most `max_attempts` replicas), unless that one left the fleet
meanwhile. A replica that took the request and did not answer (or answered a non-JSON 5xx) is
also kept out for `replica_backoff_s`. A client that goes away is a `client_abort` outcome (the
upstream request is closed, so the replica cancels the sequence), never a broken replica and
never an ERROR log.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from kvfleet_runtime.api import error_response, one_line
from kvfleet_runtime.picker import PickRequest
from kvfleet_runtime.router._inbound import authenticate, json_body
from kvfleet_runtime.router._relay import (
    Attempt,
    ClientGone,
    Failover,
    answer_headers,
    relay_stream,
)
from kvfleet_runtime.router._state import STATE, RouterState

__all__ = ["chat_completions", "completions", "proxy"]

log = logging.getLogger(__name__)


async def completions(request: web.Request) -> web.StreamResponse:
    return await proxy(request, "/v1/completions", chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    # The replicas' chat template, when the picker has their tokenizer (chat_token_ids).
    return await proxy(request, "/v1/chat/completions", chat=True)


async def proxy(request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
    """Pick, then try the pick's replicas in order until one answers (at most `max_attempts`)."""
    state = request.app[STATE]
    started = time.perf_counter()
    tenant = authenticate(state, request)
    raw, body = await json_body(state, request)
    pick = await state.picker.pick(PickRequest(tenant, body, chat))
    last_error = "no replica is ready"
    salted: bytes | None = None
    for target in pick.targets if pick is not None else ():
        name = target.replica
        replica = state.view.replicas.get(name)
        if replica is None:  # left the fleet (a config reload) while an earlier one was tried
            continue
        data = raw
        if replica.engine == "vllm":
            if salted is None:
                salted = state.tenancy.vllm_body(body, tenant)
            data = salted
        headers = {"Content-Type": "application/json",
                   **state.tenancy.replica_headers(tenant, replicas=(name,), method="POST",
                                                   path=path, now_s=time.time())}
        assert pick is not None
        state.picker.begin(name, pick.prompt_tokens)
        state.m_overhead.observe(time.perf_counter() - started)
        attempt = Attempt(name, target)
        try:
            return await _attempt(state, request, replica.url + path, data, headers, attempt)
        except Failover as exc:
            state.m_requests.labels(name, exc.outcome).inc()
            if exc.back_off:
                state.picker.mark_down(name, backoff_s=state.replica_backoff_s)
                log.warning("replica %s: %s; marked down for %g s", name, exc.detail,
                            state.replica_backoff_s)
            elif exc.outcome == "unreachable":
                state.picker.mark_down(name)
            last_error = f"replica {name}: {exc.detail}"
            continue
        except ClientGone:
            state.m_requests.labels(name, "client_abort").inc()
            log.debug("client went away; closed the request to replica %s", name)
            assert attempt.out is not None
            return attempt.out
        except asyncio.CancelledError:
            # The client went away (handler cancellation), waiting for the replica or
            # mid-answer: the upstream request is closed, and the replica cancels.
            state.m_requests.labels(name, "client_abort").inc()
            log.debug("client went away; closed the request to replica %s", name)
            raise
        finally:
            state.picker.end(name, pick.prompt_tokens)
    return error_response(503, last_error, code="no_replica", headers={"Retry-After": "1"})


async def _attempt(state: RouterState, request: web.Request, url: str, data: bytes,
                   headers: dict[str, str], attempt: Attempt) -> web.StreamResponse:
    """One replica's try. Raises `_Failover` while nothing went to the client (the caller
    tries the next replica); once the answer started, a failure ends it in the stream."""
    loop = asyncio.get_running_loop()
    first_byte_by = loop.time() + state.upstream_first_byte_timeout_s
    timeout = aiohttp.ClientTimeout(total=state.upstream_timeout_s,
                                    sock_connect=state.upstream_connect_timeout_s)
    try:
        upstream = await asyncio.wait_for(
            state.client.post(url, data=data, headers=headers, timeout=timeout),
            state.upstream_first_byte_timeout_s)
    except TimeoutError:
        raise Failover("first_byte_timeout", "no answer within "
                        f"{state.upstream_first_byte_timeout_s:g} s", back_off=True) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise Failover("unreachable", f"unreachable ({type(exc).__name__})") from None
    # Closing (not releasing) on every path out: a request that did not finish is how the
    # replica learns to cancel its sequence.
    try:
        if upstream.status == 503:
            raise Failover("overloaded", "overloaded")
        kind = upstream.headers.get("Content-Type", "")
        if upstream.status >= 500 and not kind.startswith("application/json"):
            raise Failover("bad_gateway", f"HTTP {upstream.status} that is not JSON "
                            f"({one_line(kind or 'no content type', 60)})", back_off=True)
        if upstream.status == 200 and kind.startswith("text/event-stream"):
            return await relay_stream(state, request, upstream, attempt, first_byte_by)
        try:
            answer = await asyncio.wait_for(upstream.read(),
                                            max(0.0, first_byte_by - loop.time()))
        except TimeoutError:
            raise Failover("first_byte_timeout", "answer not complete within "
                            f"{state.upstream_first_byte_timeout_s:g} s",
                            back_off=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Failover("broken", f"answer cut ({type(exc).__name__})",
                            back_off=True) from None
        resp = web.Response(status=upstream.status, body=answer,
                            headers=answer_headers(upstream, attempt.decision))
        state.m_requests.labels(attempt.name, str(upstream.status)).inc()
        return resp
    finally:
        upstream.close()
