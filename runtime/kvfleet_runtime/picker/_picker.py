"""The choice of a replica for one request, shared by both fronts (`kvfleet router`, `kvfleet epp`).

    pick(request)  tokenize the prompt once -> matched tokens per replica (the hint index and
                   vLLM's KV events, the larger per replica) -> the pure decision
                   (`affinity.choose_replica`) over the fleet view -> the failover order (the
                   same decision again without the replicas before it)
    begin / end    the front's requests in flight per replica (decision inputs until the
                   replicas' next load reports)
    mark_down      a replica that did not answer is out of decisions

The picker owns the fleet view, the hint index client, the KV-event views, the in-flight
accounting and the decision's metrics; the fronts own the sockets and the tenant's
authentication (`picker.Tenancy`).

The cache-aware override needs each replica's matched tokens for this prompt: the picker
computes the prompt's chained block hashes itself (the key fields come from the replicas' load
reports, so they cannot drift from what replicas hash) and asks the hint index for the leading
run per host, in one round trip under a ~1 ms budget. No index, no key yet, or a failed lookup:
the override is simply off for that request. A vLLM replica whose KV events the picker follows
also counts what it holds in its own GPU cache (the chain rooted at the tenant's `cache_salt`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet_runtime.affinity import RouteDecision, RouteReason, choose_replica, prefix_key
from kvfleet_runtime.auth import cache_salt
from kvfleet_runtime.background import Supervisor
from kvfleet_runtime.cache import CacheKey, block_hashes
from kvfleet_runtime.fleet.hint_index import HintIndex
from kvfleet_runtime.picker._kv_events import KvEventViews
from kvfleet_runtime.picker._kv_metrics import KvEventCollector
from kvfleet_runtime.picker._tokens import encode_chat, encode_prompt, tokenizer_named
from kvfleet_runtime.picker._view import FleetView
from kvfleet_runtime.tokenizer import Tokenizer
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["Pick", "PickRequest", "Picker", "Target", "larger_match"]

log = logging.getLogger(__name__)

INLINE_ENCODE_MAX_CHARS = 4096
"""Longer text prompts are tokenized on a worker thread: tens of milliseconds for a long document
would stall every request on the front's event loop."""
DECISION_BUCKETS_S = (2.5e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3,
                      5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25)
"""Fine below 2 ms: the picker's budget on a 2,000-token prompt."""


@dataclass(frozen=True, slots=True)
class PickRequest:
    tenant: str
    """Authenticated by the front (`Tenancy.authenticate`)."""
    body: Mapping[str, Any]
    """The OpenAI body: `prompt` (completions) or `messages` (chat)."""
    chat: bool
    exclude: frozenset[str] = frozenset()
    """Replica names the front will not send this request to."""


@dataclass(frozen=True, slots=True)
class Target:
    """One replica of a pick's failover order."""

    replica: str
    url: str
    """The replica's base URL (`scheme://host:port`)."""
    reason: RouteReason
    matched_tokens: int

    @property
    def address(self) -> str:
        return urlsplit(self.url).netloc


@dataclass(frozen=True, slots=True)
class Pick:
    replica: str
    address: str
    """`host:port` of `replica`."""
    fallbacks: tuple[str, ...]
    """Addresses in failover order after `address` (GIE's fallback list)."""
    reason: RouteReason
    matched_tokens: int
    decision_s: float
    """From `pick`'s start to its answer (tokenizing and the hint lookup included)."""
    targets: tuple[Target, ...]
    """The pick first, then the fallbacks: what a front that fails over itself walks."""
    prompt_tokens: int
    """What `begin` and `end` count for this request."""


class _PromptIds:
    """One request's prompt as ids, encoded at most once per tokenizer: the replicas of a fleet
    share one, so the hint lookup and the KV events share one encoding."""

    def __init__(self, prompt: Any, chat: bool, local: Tokenizer | None) -> None:
        self.prompt = prompt
        self.chat = chat
        self.local = local
        self._encoded: dict[int, list[int] | None] = {}

    @property
    def is_text(self) -> bool:
        return self.chat or isinstance(self.prompt, str)

    async def under(self, tokenizer_name: str) -> list[int] | None:
        """The ids under the tokenizer the replicas call `tokenizer_name` (None: unknown)."""
        if not self.chat and isinstance(self.prompt, list):
            return encode_prompt(self.prompt, None)
        own = tokenizer_named(tokenizer_name, self.local)
        if own is None:
            return None
        key = id(own)
        if key not in self._encoded:
            self._encoded[key] = await self._encode(own)
        return self._encoded[key]

    async def first_known(self, tokenizer_names: Sequence[str]) -> list[int] | None:
        """The ids under the first of these tokenizers that gives any (already encoded ones
        cost nothing)."""
        for name in tokenizer_names:
            ids = await self.under(name)
            if ids is not None:
                return ids
        return None

    async def _encode(self, tokenizer: Tokenizer) -> list[int] | None:
        encode = encode_chat if self.chat else encode_prompt
        prompt = self.prompt
        chars = (len(json.dumps(prompt)) if self.chat
                 else len(prompt) if isinstance(prompt, str) else 0)
        if chars > INLINE_ENCODE_MAX_CHARS:
            return await asyncio.to_thread(encode, prompt, tokenizer)
        return encode(prompt, tokenizer)


def larger_match(hinted: Mapping[str, int], held: Mapping[str, int]) -> dict[str, int]:
    """Per replica, the larger of what the hint index and its KV events say it holds."""
    return {**hinted, **{r: max(n, hinted.get(r, 0)) for r, n in held.items()}}


def inflight_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """What a request adds to its replica's occupancy until the next load report: a prompt's
    length (characters of text, or ids), a chat's characters of content."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, (str, list)) else 0


class Picker:
    """Today's choice: tenant affinity with bounded load, the hint index, vLLM's KV events,
    load reports, failover order."""

    def __init__(
        self,
        view: FleetView,
        *,
        index: HintIndex | None = None,
        kv_events: KvEventViews | None = None,
        tokenizer: Tokenizer | None = None,
        router_secret: bytes | None = None,
        kv_event_endpoints: Mapping[str, str] | None = None,
        kv_events_port: int | None = None,
        max_hint_blocks: int = 512,
        max_fallbacks: int = 2,
        spill_window: int = 1000,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if max_fallbacks < 0:
            raise ValueError(f"max_fallbacks must be >= 0, got {max_fallbacks}")
        self.view = view
        self.index = index
        self.kv_events = kv_events
        """What each vLLM replica holds in its own KV cache, from its KV events (None: not
        subscribed); the override takes the larger of this and the hint index."""
        self.tokenizer = tokenizer
        """The model's tokenizer, for text prompts; used for the hint index only while the
        replicas report the same tokenizer name (vLLM replicas report none: always)."""
        self.router_secret = router_secret
        self.kv_event_endpoints_given = dict(kv_event_endpoints or {})
        """Replica name -> ZMQ endpoint of its KV events (`--kv-events`)."""
        self.kv_events_port = kv_events_port
        """Every vLLM replica's events at its URL's host on this port (`--kv-events-port`)."""
        self.max_hint_blocks = max_hint_blocks
        self.max_fallbacks = max_fallbacks
        self.spill_window = spill_window
        self._clock = clock
        self._recent: deque[bool] = deque()
        self._warned_tokenizers: set[str] = set()
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.supervisor = Supervisor(registry=r)
        """Runs the picker's background loops (load and config polls, KV-event subscriptions):
        a loop that dies is logged and restarted (`kvfleet_runtime.background`)."""
        self.m_decisions = Counter(
            "kvfleet_router_decisions", "Routing decisions by reason.", ["reason"], registry=r)
        self.m_spill_rate = Gauge(
            "kvfleet_router_spill_rate",
            "Share of the last decisions that spilled off the tenant's homes.", registry=r)
        self.m_hint_errors = Counter(
            "kvfleet_router_hint_lookup_failures",
            "Hint lookups that did not answer (override off).", registry=r)
        self.m_decision = Histogram(
            "kvfleet_router_decision_seconds",
            "Time the picker takes to choose (tokenizing, hint lookup, KV views, decision).",
            buckets=DECISION_BUCKETS_S, registry=r)
        r.register(KvEventCollector(lambda: self.kv_events))

    # -- the choice --------------------------------------------------------------------------

    async def pick(self, request: PickRequest) -> Pick | None:
        """The replica for `request` and its failover order; None when no replica is ready."""
        started = self._clock()
        prompt = self._prompt(request)
        matched = await self._matched(request.tenant, prompt)
        # The prompt's ids as the replicas see them (the encoding above, not a second one):
        # its prefix picks its owner among the tenant's homes.
        ids = await prompt.first_known(self._tokenizer_names())
        prefix = None if ids is None else prefix_key(request.tenant, ids)
        decisions = self._order(request.tenant, matched, request.exclude, prefix,
                                None if ids is None else len(ids))
        if not decisions:
            return None
        self._record(decisions[0])
        replicas = self.view.replicas
        targets = tuple(Target(d.replica, replicas[d.replica].url, d.reason, d.matched_tokens)
                        for d in decisions)
        first = targets[0]
        decision_s = self._clock() - started
        self.m_decision.observe(decision_s)
        return Pick(first.replica, first.address, tuple(t.address for t in targets[1:]),
                    first.reason, first.matched_tokens, decision_s, targets,
                    inflight_tokens(request.body, request.chat))

    async def matched_tokens(self, request: PickRequest) -> dict[str, int]:
        """Prefix tokens each replica holds for this request's prompt ({} when unknown)."""
        return await self._matched(request.tenant, self._prompt(request))

    def _prompt(self, request: PickRequest) -> _PromptIds:
        return _PromptIds(request.body.get("messages" if request.chat else "prompt"),
                          request.chat, self.tokenizer)

    def _tokenizer_names(self) -> list[str]:
        """The replicas' tokenizer (a kvfleet replica's report names it), then the picker's own
        (vLLM replicas report none)."""
        reported = next((r.report.tokenizer for r in self.view.replicas.values()
                         if r.report is not None and r.report.ready and r.report.tokenizer), "")
        return [reported, self.tokenizer.name if self.tokenizer is not None else ""]

    async def _matched(self, tenant: str, prompt: _PromptIds) -> dict[str, int]:
        if self.view.recompute_cost is None:
            return {}
        hinted = await self._hinted(tenant, prompt)
        return larger_match(hinted, await self._held(tenant, prompt))

    async def _hinted(self, tenant: str, prompt: _PromptIds) -> dict[str, int]:
        """Hinted prefix tokens per replica, from the hint index."""
        view = self.view
        if self.index is None or not view.t2_enabled:
            return {}
        # Replicas of one fleet share one key template; take it from any ready reporter.
        report = next((r.report for r in view.replicas.values()
                       if r.report is not None and r.report.ready and r.report.cache_key), None)
        if report is None or report.cache_key is None:
            return {}
        token_ids = await prompt.under(report.tokenizer)
        if token_ids is None and prompt.is_text:
            self._warn_untokenized(report.tokenizer)
        if token_ids is None or len(token_ids) < BLOCK_SIZE:
            return {}
        try:
            hashes = block_hashes(CacheKey(tenant, *report.cache_key),
                                  token_ids[: self.max_hint_blocks * BLOCK_SIZE])
        except ValueError:
            return {}
        runs = await self.index.lookup_runs(hashes, tenant=tenant)
        if not runs and getattr(self.index, "available", True) is False:
            self.m_hint_errors.inc()
        return {host: n * BLOCK_SIZE for host, n in runs.items() if host in view.replicas}

    async def _held(self, tenant: str, prompt: _PromptIds) -> dict[str, int]:
        """What each vLLM replica's KV events say it holds for this prompt. vLLM replicas report
        no tokenizer name: text is encoded with the picker's own tokenizer (a different one only
        routes worse: vLLM's own cache decides what hits)."""
        views = self.kv_events
        if views is None or not views.views:
            return {}
        try:
            salt = cache_salt(self.router_secret, tenant)
        except ValueError:
            return {}
        token_ids = await prompt.under(self.tokenizer.name if self.tokenizer is not None else "")
        if token_ids is None:
            return {}
        return views.matched_tokens(salt, token_ids[: self.max_hint_blocks * BLOCK_SIZE],
                                    self.view.replicas)

    def _order(self, tenant: str, matched: Mapping[str, int], exclude: frozenset[str],
               prefix: bytes | None, prompt_tokens: int | None) -> list[RouteDecision]:
        """The decision, then the same decision without the replicas before it, up to
        `max_fallbacks` times: what deciding again after each failure would choose."""
        view = self.view
        loads = view.loads()
        home_set = view.home_set(tenant)
        tried = set(exclude)
        out: list[RouteDecision] = []
        for _ in range(1 + self.max_fallbacks):
            decision = choose_replica(
                tenant,
                [load for load in loads if load.name not in tried],
                k=view.affinity_k,
                occupancy_threshold=view.threshold,
                home_set=home_set,
                matched_tokens={r: n for r, n in matched.items() if r not in tried},
                recompute_s_per_token=view.recompute_cost,
                prefix=prefix,
                prompt_tokens=prompt_tokens,
            )
            if decision is None:
                break
            out.append(decision)
            tried.add(decision.replica)
        return out

    def _record(self, decision: RouteDecision) -> None:
        self.m_decisions.labels(decision.reason).inc()
        self._recent.append(decision.reason == "spill")
        if len(self._recent) > self.spill_window:
            self._recent.popleft()
        self.m_spill_rate.set(sum(self._recent) / len(self._recent))

    @property
    def spill_rate(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def _warn_untokenized(self, replica_tokenizer: str) -> None:
        if replica_tokenizer in self._warned_tokenizers:
            return
        self._warned_tokenizers.add(replica_tokenizer)
        mine = self.tokenizer.name if self.tokenizer is not None else "none (no --tokenizer)"
        log.warning("replicas report tokenizer %r, the picker has %s: text prompts are routed "
                    "without the cache-aware override", replica_tokenizer or "(none)", mine)

    def address_of(self, replica: str) -> str:
        """`host:port` of a replica of the view (what a gateway's destination names)."""
        return urlsplit(self.view.replicas[replica].url).netloc

    # -- in flight ---------------------------------------------------------------------------

    def begin(self, replica: str, tokens: int) -> None:
        """A request went to `replica` (counted in its load until `end`)."""
        self.view.begin(replica, tokens)

    def end(self, replica: str, tokens: int) -> None:
        self.view.end(replica, tokens)

    def mark_down(self, replica: str, backoff_s: float | None = None) -> None:
        """`replica` did not answer: out until its next report, or for `backoff_s` whatever
        its reports say (`FleetView.mark_down`)."""
        self.view.mark_down(replica, backoff_s)

    # -- lifecycle ---------------------------------------------------------------------------

    def kv_event_endpoints(self) -> dict[str, str]:
        """Replica -> KV event endpoint: the given endpoints, then every vLLM replica of the
        view at its URL's host on `kv_events_port`."""
        out = {}
        if self.kv_events_port is not None:
            for r in self.view.replicas.values():
                host = urlsplit(r.url).hostname
                if r.engine == "vllm" and host:
                    out[r.name] = f"tcp://{_zmq_host(host)}:{self.kv_events_port}"
        return {**out, **self.kv_event_endpoints_given}

    async def start(self, session: aiohttp.ClientSession, *, poll_interval_s: float,
                    config_poll_s: float) -> None:
        """Load the config, poll every replica once, then keep polling (and following KV
        events) until `stop`."""
        self.view.reload_config()
        await self.view.poll_once(session, timeout_s=1.0)
        self.supervisor.start("router-poll", lambda: self.view.run(
            session, poll_interval_s=poll_interval_s, config_poll_s=config_poll_s))
        if self.kv_events is not None:
            # zmq is imported only by a picker that subscribes
            from kvfleet_runtime.picker._kv_subscriber import KvEventSubscriber

            sub = KvEventSubscriber(self.kv_events, self.kv_event_endpoints,
                                    supervisor=self.supervisor)
            self.supervisor.start("router-kv-events", sub.run)

    async def stop(self) -> None:
        await self.supervisor.stop()
        if self.index is not None:
            await self.index.close()


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
