"""The engine: continuous batching over the reference model, prefilling only what the cache lacks.

Per request, through the cache's request-level pair: `prepare` looks the prompt up and puts the
hit's T0 blocks into the request's block table as they are (T0 is this engine's own KV: no copy,
the blocks are shared and never written, since computation resumes at the first unmatched
block); fresh blocks for the rest (the cache gives back unreferenced cached blocks when the pool
is short); `fill` copies the hit's T1 blocks into the first fresh ones, one copy per run; prefill
the unmatched suffix in block-aligned chunks, decode; `finish` indexes the prompt's full blocks
in the cache where they are and releases the hit's refs (after the first token is on its way);
the blocks go back when the request ends. The cache applies the last-prompt-token rule
(`usable_tokens`). Every cache failure degrades to recompute. With T0 turned off (the cache's
`set_t0_enabled(False)`, the fleet config's `tiers.t0_device`), the same calls need no other path
here: a hit has no T0 blocks to share, so all of it is copied from T1, and `finish` queues a copy
into T1 (QUEUED, for the drain task) instead of indexing the blocks in place; a sequence already
running on shared T0 blocks keeps them until it ends.

Concurrency: one asyncio scheduler task admits requests between steps; each step runs on one
dedicated worker thread (torch releases the GIL, so the HTTP server stays responsive). All model
and cache calls happen on that thread, so neither needs to be thread-safe. A step's events reach
the loop in batches, not one wake-up per token (each wake-up handed the GIL to the loop in the
middle of the step): a step with first tokens returns to the loop once they are sampled, and
the loop hands them to their streams before the engine thread stores those prompts and runs
the decode forward; other events go out once before the decode forward and when the step
returns. Decoding sequences keep their model inputs across steps (`DecodeBatch`: block tables,
positions, last tokens as tensors), so a step writes only its new tokens; on CUDA the decode
forward itself is replayed from CUDA graphs (`EngineConfig.decode_graphs`).

A step has a token budget (`max_tokens_per_step`), shared as continuous-batching engines share
it: every decoding sequence's next token is counted first, the rest goes to prefill chunks (whole
blocks; a prompt's last chunk may end mid-block), one forward per chunk; then one batched decode
forward runs for every decoding sequence. So a long prompt stalls the others' token streams by at
most one budget of prefill per step.

Determinism is a choice (`deterministic`). By default a prompt is prefilled in chunks as large as
the budget allows: a hit's KV and the logits after it equal recomputation to floating-point
tolerance (the suffix is computed by other matmul shapes than in a full prefill, and CPU and GPU
kernels round differently per shape). `deterministic=True` prefills in one-block chunks, so the
tokens after any block-aligned hit are computed by exactly the calls of a full prefill and a hit
equals a miss bitwise (same device, same thread count), at the price docs/replica.md states. The
mode is part of the cache key's attention id: a deterministic replica never takes fast-path KV.

What is stored, and why only that: the prompt's full blocks, which prefill computed. KV written by
decode is computed one row per sequence (other shapes again), so it is never stored; it is stored
later, by prefill, when a next turn sends it back as part of a prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from torch import Tensor

from kvfleet_runtime.background import Supervisor
from kvfleet_runtime.cache import (
    CacheKey,
    LoadTarget,
    LowerTier,
    Prefix,
    PrefixCache,
    StoreOutcome,
    TierQuery,
    usable_tokens,
)
from kvfleet_runtime.engine._batch import DecodeBatch
from kvfleet_runtime.engine._sampling import Sampled, Sampler, SamplingParams, sample_batch
from kvfleet_runtime.model import DecodeGraphs, LoadedModel, PagedKV, Transformer
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = [
    "CacheKeyFields",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "EngineShuttingDown",
    "Finished",
    "GenerationRequest",
    "RequestStream",
    "TokenEvent",
]

log = logging.getLogger(__name__)

DETERMINISTIC_RULE = f"chunk{BLOCK_SIZE}"
"""Appended to the cache key's attention id in deterministic mode."""

TIER_POLL_S = 0.001
"""A stalled engine with requests waiting (a tier still finding out: `num_matched` None) looks
again after this long, sooner when a load, a submit or a cancel wakes it."""

FinishReason = Literal["stop", "length", "abort", "error"]
DecodeGraphMode = Literal["auto", "eager", "off"]


@dataclass(slots=True, frozen=True)
class CacheKeyFields:
    """The model half of the cache key; the tenant completes it per request."""

    model_id: str
    weights_digest: str
    kv_dtype: str
    rope_config_hash: str
    attn_impl_id: str

    @classmethod
    def for_model(cls, loaded: LoadedModel, model_id: str, *,
                  deterministic: bool = False) -> CacheKeyFields:
        """Everything prefill depends on besides the tokens, derived from the loaded model.

        `deterministic` (the engine's mode) names the prefill rule in the attention id: KV of
        one-block chunks is what a deterministic replica can reproduce bit for bit."""
        args = loaded.args  # the KV is written in the serving dtype
        attn = args.attn_impl_id()
        if deterministic:
            attn = f"{attn}-{DETERMINISTIC_RULE}"
        return cls(model_id, loaded.weights_digest, args.dtype, args.rope_config_hash(), attn)

    def key(self, tenant_id: str) -> CacheKey:
        return CacheKey(tenant_id, self.model_id, self.weights_digest, self.kv_dtype,
                        self.rope_config_hash, self.attn_impl_id)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    num_kv_blocks: int = 1024
    """The device block pool, in 16-token blocks: running sequences' KV and the cache's T0 (one
    pool; an engine given a pool takes its size from it)."""
    max_batch_size: int = 32
    """Sequences running at once (prefilling or decoding)."""
    max_waiting: int = 256
    """Queued requests beyond which `submit` refuses (the server answers 503)."""
    max_tokens_per_step: int = 2048
    """Token budget of one step: decode tokens (one per decoding sequence) first, then prefill
    chunks of whole blocks. A multiple of the block size, at least `max_batch_size` + one block
    so a prompt always makes progress beside a full batch of decoders."""
    deterministic: bool = False
    """Prefill in one-block chunks so a hit equals a miss bitwise (module docstring); slower."""
    stop_ids: frozenset[int] = frozenset()
    """A sequence ends ("stop") on any of these, unless its request ignores EOS: the model's
    stop ids, from its tokenizer (`Tokenizer.stop_ids`); empty: only max_tokens ends one."""
    decode_graphs: DecodeGraphMode = "auto"
    """How the decode step runs (`kvfleet_runtime.model.DecodeGraphs`): "auto" captures it in
    CUDA graphs on a GPU and runs it plainly elsewhere; "eager" takes the graphs' padded,
    bucketed path without capturing (a GPU whose capture misbehaves; tests of that path on the
    CPU); "off" runs it plainly everywhere. The padded paths reserve one block of the pool."""
    max_tier_wait_s: float = 5.0
    """A tier below the cache that still answers "finding out" (None) this long after it was
    first asked for a request is taken to hold nothing for it: the request goes ahead."""

    def __post_init__(self) -> None:
        budget = self.max_tokens_per_step
        if budget <= 0 or budget % BLOCK_SIZE != 0:
            raise ValueError(f"max_tokens_per_step {budget} is not a positive multiple of "
                             f"{BLOCK_SIZE}")
        if budget < self.max_batch_size + BLOCK_SIZE:
            raise ValueError(f"max_tokens_per_step {budget} leaves no prefill block beside "
                             f"max_batch_size {self.max_batch_size} decoding sequences")


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    tenant_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True, frozen=True)
class TokenEvent:
    token_id: int
    cached_tokens: int
    """Prompt tokens whose KV came from the cache (block-aligned)."""
    logprob: float | None = None
    """The token's log-probability, when the request asked for logprobs."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cache_tier: str | None = None
    """The tier the cached prefix came from (None: a miss)."""


@dataclass(slots=True, frozen=True)
class Finished:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_tier: str | None
    error: str | None = None


Event = TokenEvent | Finished


class EngineOverloaded(Exception):
    """The waiting queue is full; retry later (HTTP 503 with Retry-After)."""


class EngineShuttingDown(Exception):
    """The engine is stopping and takes no new requests; another replica should (HTTP 503,
    no Retry-After: this one will not be back)."""


class RequestStream:
    """The events of one request, in order: TokenEvent..., then exactly one Finished."""

    def __init__(self, seq: _Sequence, wake: Callable[[], None] | None = None) -> None:
        self._seq = seq
        self._wake = wake
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def _put(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def cancel(self, reason: FinishReason = "abort") -> None:
        """Stop generating; blocks and refs are freed at the next step. `reason` is what the
        request finished as: "abort" (the client went away) or "stop" (a stop string matched)."""
        self._seq.cancelled = True
        self._seq.cancel_reason = reason
        if self._wake is not None:  # a stalled engine (every request loading) ends it now
            self._wake()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                return


@dataclass(slots=True, eq=False)
class _Load:
    """One lower tier's part of a request's prefix: blocks [query.start_block, + num_blocks)."""

    tier: LowerTier
    query: TierQuery
    num_blocks: int
    started: bool = False
    landed: int | None = None
    """Leading blocks the tier landed verified, once its `done` was called (None before)."""


@dataclass(slots=True)
class _Sequence:
    request: GenerationRequest
    key: CacheKey
    sampler: Sampler
    stream: RequestStream | None = None
    table: list[int] = field(default_factory=list)
    prefix: Prefix | None = None
    """The prompt's prefix as the cache prepared it (its refs held until `finish`)."""
    prefix_cache: PrefixCache | None = None
    """The cache that holds `prefix` (the engine's cache may be switched off meanwhile)."""
    looked_up: bool = False
    """The cache was asked once (admission may wait for room and retry without asking again)."""
    request_id: int = 0
    tiers: tuple[LowerTier, ...] = ()
    """The tiers below the cache this request asks, in order (fixed at its lookup)."""
    num_asked: int = 0
    """Tiers that answered so far (the next one is asked at the next admission attempt)."""
    asking: TierQuery | None = None
    """The query the tier now being asked answered "finding out" (None) to, if any."""
    asking_since_s: float = 0.0
    """When that tier first answered so."""
    loads: list[_Load] = field(default_factory=list)
    """What the tiers asked so far will supply (each > 0 blocks), in order."""
    num_loading: int = 0
    """Loads started whose `done` the engine has not processed yet."""
    gone: bool = False
    """The request ended while loads were out: its blocks go back when the last one is done."""
    cached_tokens: int = 0
    cache_tier: str | None = None
    prefill_pos: int = 0
    output: list[int] = field(default_factory=list)
    last_logits: Tensor | None = None
    cancelled: bool = False
    cancel_reason: FinishReason = "abort"
    submitted_s: float = 0.0

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.token_ids

    @property
    def prefilled(self) -> bool:
        return self.prefill_pos >= len(self.prompt)

    @property
    def loading(self) -> bool:
        """Admitted, its blocks allocated, waiting for tiers below the cache to land them."""
        return self.num_loading > 0


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "kvfleet_replica_"
        self.requests = Counter(p + "requests", "Finished requests.", ["finish_reason"],
                                registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received.",
                                     registry=registry)
        # By the tier that supplied them ("t0" shared, "t1" copied, "t3" NVMe and "t2" peers
        # landed in the engine's blocks), so a dashboard can split the hit rate by tier without
        # a second counter to keep in step: the sum over tiers is every cached prompt token.
        self.cached_tokens = Counter(p + "cached_prompt_tokens",
                                     "Prompt tokens whose KV came from the prefix cache or a "
                                     "tier below it, by the tier that supplied them.", ["tier"],
                                     registry=registry)
        self.prefilled_tokens = Counter(p + "prefilled_tokens", "Prompt tokens computed.",
                                        registry=registry)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated.",
                                        registry=registry)
        self.cache_errors = Counter(p + "cache_errors", "Cache calls that failed and fell back "
                                    "to recompute.", ["op"], registry=registry)
        # `cache`: "hit" when any prompt token came from the cache, else "miss": what the cache
        # buys is the distance between the two, which one histogram over both hides.
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submit to first token.",
                              ["cache"],
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                              registry=registry)
        self.running = Gauge(p + "running_sequences", "Sequences prefilling or decoding.",
                             registry=registry)
        self.waiting = Gauge(p + "waiting_requests", "Requests queued for admission.",
                             registry=registry)
        self.free_blocks = Gauge(p + "kv_free_blocks", "Blocks of the KV pool new work can "
                                 "have: free, or cached and used by no sequence.",
                                 registry=registry)
        self.loading = Gauge(p + "loading_requests", "Requests whose blocks tiers below the "
                             "cache are landing.", registry=registry)


class Engine:
    def __init__(
        self,
        model: Transformer,
        key_fields: CacheKeyFields,
        *,
        cache: PrefixCache | None,
        config: EngineConfig | None = None,
        registry: CollectorRegistry | None = None,
        kv: PagedKV | None = None,
        lower_tiers: Sequence[LowerTier] = (),
    ) -> None:
        """`cache` None runs without a prefix cache (every request prefills everything); the
        attribute may be switched at run time (the config's `cache.enabled`).

        `lower_tiers`: the tiers below the cache (T3, then T2: the composition root's order),
        asked after T0 and T1 for the blocks they lack (`LowerTier`); settable later
        (`lower_tiers` attribute), read once per request. They need the cache.

        `kv`: the device block pool, shared with the cache as its T0 (`PrefixCache(...,
        device_kv=kv)`); by default the cache's own T0 pool when it has one, else a pool of
        `config.num_kv_blocks`. The pool's size is the engine's `num_kv_blocks`."""
        self.model = model
        self.key_fields = key_fields
        self.cache = cache
        self.lower_tiers: tuple[LowerTier, ...] = tuple(lower_tiers)
        config = config or EngineConfig()
        if kv is None and cache is not None and cache.device_kv is not None:
            pool = cache.device_kv  # the same tensors, allocator and lock: one pool
            kv = pool if isinstance(pool, PagedKV) else PagedKV(
                k=pool.k, v=pool.v, refs=pool.refs, lock=pool.lock, reclaimer=pool.reclaimer)
        if kv is None:
            kv = PagedKV.allocate(model.args, config.num_kv_blocks, device=model.device)
        args = model.args
        expected = (args.n_layers, kv.num_blocks, args.n_kv_heads, BLOCK_SIZE, args.head_dim)
        if tuple(kv.k.shape) != expected:
            raise ValueError(f"the KV pool is {tuple(kv.k.shape)}, the model needs {expected} "
                             "[layers, blocks, kv_heads, 16, head_dim]")
        self.kv = kv
        self._graphs = self._decode_graphs(config)
        usable = kv.num_blocks - (self._graphs is not None)  # the padding rows' block
        self.config = dataclasses.replace(config, num_kv_blocks=usable)
        self.metrics = _Metrics(registry or CollectorRegistry())
        self.metrics.free_blocks.set(self.kv.num_free_blocks)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        max_blocks = -(-model.args.max_seq_len // BLOCK_SIZE)
        self._batch: DecodeBatch[_Sequence] = DecodeBatch(self.config.max_batch_size,
                                                          max_blocks, model.device)
        self._outbox: list[tuple[RequestStream, Event]] = []
        """Events of the step so far, for the loop (engine thread only; see `_emit`)."""
        self._firsts: list[tuple[_Sequence, int | None]] = []
        """The step's first tokens (None: sampling failed), sent before `_step_rest` runs."""
        self._lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._landed: list[_Sequence] = []
        """Sequences one of whose loads called `done` (any thread; under `_lock`)."""
        self._progress = 0
        """Counts what steps did (admissions, landed loads, prefill, decode, finishes): a step
        that leaves it unchanged stalled, and the scheduler sleeps until woken."""
        self._stalled = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-engine")
        self._wakeup = asyncio.Event()
        self._stores_pending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _decode_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        mode, device = config.decode_graphs, self.model.device
        if mode == "off" or (mode == "auto" and device.type != "cuda"):
            return None
        pad = self.kv.take(1)  # held for the engine's life: padding rows write only here
        if pad is None:
            raise ValueError("the KV pool has no free block for the decode step's padding")
        return DecodeGraphs(self.model, self.kv, max_batch=config.max_batch_size,
                            max_blocks=-(-self.model.args.max_seq_len // BLOCK_SIZE),
                            pad_block=pad[0], capture=mode == "auto")

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the scheduler and the cache drain, as loops of `supervisor` (the replica's:
        a loop that dies is logged and restarted); a private one when None."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._stores_pending = asyncio.Event()
        supervisor = Supervisor() if supervisor is None else supervisor
        self._task = supervisor.start("kvfleet-engine-scheduler", self._run)
        self._drain_task = supervisor.start("kvfleet-cache-drain", self._drain_loop)

    async def stop(self) -> None:
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._drain_task is not None:
            self._drain_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain_task
        self._executor.shutdown(wait=True)

    async def drain_stores(self) -> int:
        """Write every queued store into the cache now; returns blocks written (tests, bench)."""
        cache = self.cache
        if cache is None:
            return 0
        return await asyncio.to_thread(cache.drain_store_queue)

    async def _drain_loop(self) -> None:
        # Stores are copied into the pools off the engine thread, so they never delay a step.
        while True:
            await self._stores_pending.wait()
            self._stores_pending.clear()
            try:
                await self.drain_stores()
            except Exception:
                self.metrics.cache_errors.labels("drain").inc()
                log.exception("cache drain failed")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def wake(self) -> None:
        """From any thread: run a step soon (a tier below the cache knows more now)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to wake
            loop.call_soon_threadsafe(self._wakeup.set)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- requests --------------------------------------------------------------------------

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return -(-(prompt_tokens + max_tokens) // BLOCK_SIZE)

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError naming the problem when the request can never run here."""
        n, args = len(request.token_ids), self.model.args
        if n == 0:
            raise ValueError("prompt is empty")
        ids = request.token_ids
        # min/max run in C; the element-wise scan cost ~0.15 ms of a 2,000-token T0 hit's TTFT
        if min(ids) < 0 or max(ids) >= args.vocab_size:
            bad = next(t for t in ids if not 0 <= t < args.vocab_size)
            raise ValueError(f"token id {bad} is out of range [0, {args.vocab_size})")
        total = n + request.params.max_tokens
        if total > args.max_seq_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) "
                             f"= {total} exceeds the model's context of {args.max_seq_len}")
        need = self.blocks_needed(n, request.params.max_tokens)
        if need > self.config.num_kv_blocks:
            raise ValueError(f"request needs {need} KV blocks, the replica has "
                             f"{self.config.num_kv_blocks}")

    def submit(self, request: GenerationRequest) -> RequestStream:
        if self._closed:
            raise EngineShuttingDown("the replica is shutting down")
        self.check(request)
        key = self.key_fields.key(request.tenant_id)
        sampler = Sampler(request.params, prompt=request.token_ids,
                          eos_ids=self.config.stop_ids)
        seq = _Sequence(request=request, key=key, sampler=sampler, submitted_s=time.monotonic(),
                        request_id=next(self._request_ids))
        seq.stream = RequestStream(seq, self.wake)
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(seq)
            self.metrics.waiting.set(len(self._waiting))
        self._wakeup.set()
        return seq.stream

    async def generate(self, request: GenerationRequest) -> tuple[list[int], Finished]:
        """Submit and collect: the generated token ids and the final event."""
        tokens: list[int] = []
        async for event in self.submit(request):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            else:
                return tokens, event
        raise AssertionError("stream ended without a Finished event")

    # ---- scheduler -------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running and not self._waiting and not self._landed:
                if self._closed:
                    return
                await self._wakeup.wait()  # a submit, or a load done for a request that left
                self._wakeup.clear()
                continue
            if self._stalled:
                # The last step did nothing: every running request waits for its loads and
                # nothing waiting could start. Sleep until a load's `done`, a submit or a
                # cancel wakes the loop; with requests waiting (a tier still finding out, room
                # a background write still holds) look again after a short while.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(),
                                           TIER_POLL_S if self._waiting else None)
                self._wakeup.clear()
            progress = self._progress
            try:
                if await loop.run_in_executor(self._executor, self._step):
                    # The step stopped at its first tokens (flushed just before it returned, so
                    # they reach their streams ahead of this task's wake-up): the streams'
                    # readers run (the yield) before the engine thread goes on with the stores
                    # and the decode forward. Sent mid-step, they waited for that thread's
                    # Python work: the loop needs the GIL, which a busy thread hands over only
                    # at the switch interval (5 ms), so the ~0.8 ms store sat on the time to
                    # first token.
                    self._deliver(self._take_outbox())
                    await asyncio.sleep(0)
                    await loop.run_in_executor(self._executor, self._step_rest)
            except Exception:
                log.exception("engine step failed; failing the running requests")
                await loop.run_in_executor(self._executor, self._fail_running)
            self._deliver(self._take_outbox())  # the step is over: no thread hand-off needed
            self._stalled = self._progress == progress and not self._closed
            if self._closed:
                with self._lock:
                    for seq in [*self._waiting, *(s for s in self._running if s.loading)]:
                        seq.cancelled = True  # a load may never come: it is not waited for
                    self._running.extend(self._waiting)
                    self._waiting.clear()

    def _emit(self, seq: _Sequence, event: Event) -> None:
        # Collected, not sent: one wake-up of the loop per token cost a GIL hand-off in the
        # middle of the step (the profile's largest item at 4+ sequences). The scheduler
        # delivers the step's events when the step returns; `_flush` sends them earlier.
        assert seq.stream is not None
        self._outbox.append((seq.stream, event))

    def _take_outbox(self) -> list[tuple[RequestStream, Event]]:
        events, self._outbox = self._outbox, []
        return events

    def _flush(self) -> None:
        """Send the events so far to the loop now, in one wake-up (before the step's decode
        forward)."""
        if self._outbox:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, self._take_outbox())

    @staticmethod
    def _deliver(events: list[tuple[RequestStream, Event]]) -> None:
        for stream, event in events:
            stream._put(event)

    def _step(self) -> bool:
        """Admit, prefill, sample first tokens; then the rest (`_step_rest`), here unless
        there were first tokens: True says they wait in the outbox and the rest is due once the
        loop has delivered them."""
        self._land()
        self._admit()
        self._land()  # loads a tier finished at once
        for seq in [s for s in self._running if s.cancelled]:
            self._finish(seq, seq.cancel_reason)
        # Decode tokens are counted first; what remains of the budget goes to prefill.
        n_decoding = sum(1 for s in self._running if s.output)
        budget = self.config.max_tokens_per_step - n_decoding
        budget = max(BLOCK_SIZE, budget // BLOCK_SIZE * BLOCK_SIZE)
        plan: list[tuple[_Sequence, int]] = []  # (sequence, tokens to prefill this step)
        for seq in self._running:
            if budget <= 0:
                break
            if not seq.prefilled and not seq.loading:
                n = min(len(seq.prompt) - seq.prefill_pos, budget)
                plan.append((seq, n))
                # A prompt's tail may end mid-block; the next chunk still gets whole blocks.
                budget = (budget - n) // BLOCK_SIZE * BLOCK_SIZE
        if plan:
            self._prefill_chunks(plan)
        # First tokens go out before their prompts are stored: the store (the cache's plan for
        # a 2,000-token prompt: ~0.7 ms of CPU) is not on the time to first token. A snapshot,
        # since a request that ends at its first token leaves `_running`.
        self._firsts = [(seq, self._first_token(seq)) for seq in list(self._running)
                        if seq.prefilled and not seq.output and seq.last_logits is not None]
        if self._firsts:
            self._flush()  # one loop iteration sooner than the scheduler's own delivery
            return True
        self._step_rest()
        return False

    def _step_rest(self) -> None:
        """Store the prompts of the step's first tokens, then the decode forward."""
        firsts, self._firsts = self._firsts, []
        for seq, token in firsts:
            if token is not None:
                self._after_first_token(seq, token)
        for seq in [s for s in self._batch.seqs if s.cancelled]:
            self._finish(seq, seq.cancel_reason)
        if self._batch:
            self._flush()  # e.g. the ends of requests done at their first token
            self._decode()
        self.metrics.running.set(len(self._running))
        self.metrics.free_blocks.set(self.kv.num_free_blocks)

    def _admit(self) -> None:
        asking: set[int] = set()  # requests a tier is still finding out about: asked next step
        while len(self._running) < self.config.max_batch_size:
            with self._lock:
                # The first waiting request that need not wait for a running one's prefix.
                seq = next((s for s in self._waiting if s.request_id not in asking
                            and (s.cancelled or not self._prefix_pending(s))), None)
            if seq is None:
                break
            if seq.cancelled:
                self._pop_waiting(seq)
                self._let_go(seq)
                self._finished_event(seq, "abort")
                continue
            if not seq.looked_up:
                seq.looked_up = True
                self._restore_prefix(seq)
            if not self._ask_tiers(seq):
                asking.add(seq.request_id)  # waits; the requests behind it go on
                continue
            need = self.blocks_needed(len(seq.prompt), seq.request.params.max_tokens)
            fresh = self.kv.take(need - len(seq.table))  # the one allocation: every tier's
            if fresh is None:
                break  # head of line waits for room, keeping its shared prefix
            self._pop_waiting(seq)
            seq.table = seq.table + fresh
            self._running.append(seq)
            self._progress += 1
            self._copy_prefix(seq)
            self._start_loads(seq)

    def _prefix_pending(self, seq: _Sequence) -> bool:
        """A running sequence of the same key is still computing a full block this prompt
        starts with: admitting `seq` now would compute those blocks a second time, so it waits
        until that sequence stores its prompt (at its first token), then its lookup hits them.
        Bounded: the other's prefill ends within a few steps, or it is cancelled and leaves."""
        if seq.looked_up or self.cache is None:
            return False
        usable = usable_tokens(len(seq.prompt)) // BLOCK_SIZE
        for other in self._running:
            if other.output or other.cancelled or other.key != seq.key:
                continue
            shared = 0
            for b in range(min(usable, len(other.prompt) // BLOCK_SIZE)):
                lo, hi = b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE
                if seq.prompt[lo:hi] != other.prompt[lo:hi]:
                    break
                shared = b + 1
            if shared * BLOCK_SIZE > other.cached_tokens:  # blocks the cache does not have yet
                return True
        return False

    def _pop_waiting(self, seq: _Sequence) -> None:
        with self._lock:
            self._waiting.remove(seq)
            self.metrics.waiting.set(len(self._waiting))

    def _restore_prefix(self, seq: _Sequence) -> None:
        """Look the prompt up and place the hit's T0 blocks at the head of the table (shared,
        no copy); any failure means recompute."""
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        cache = self.cache  # one read: the config watcher may switch it between steps
        if cache is None:
            return
        try:
            prefix = cache.prepare(seq.key, seq.prompt, self.kv)
        except Exception:
            self.metrics.cache_errors.labels("prepare").inc()
            log.exception("cache lookup failed; recomputing")
            return
        seq.prefix, seq.prefix_cache = prefix, cache
        seq.table = list(prefix.table)
        seq.tiers = self.lower_tiers

    def _ask_tiers(self, seq: _Sequence) -> bool:
        """Ask the tiers below the cache, in order, how many blocks each supplies after those
        before it (T0 and T1's, then each tier's); False while the one being asked is still
        finding out (the request stays waiting and it is asked again next step). A tier that
        fails to answer supplies nothing."""
        prefix = seq.prefix
        if prefix is None or seq.num_asked == len(seq.tiers):
            return True
        try:
            chain = tuple(seq.loads[0].query.chain if seq.loads else prefix.usable_chain())
        except Exception:
            self.metrics.cache_errors.labels("tier").inc()
            log.exception("hashing the prompt for the tiers below the cache failed")
            seq.num_asked = len(seq.tiers)
            return True
        start = seq.loads[-1].query.start_block + seq.loads[-1].num_blocks if seq.loads else (
            prefix.num_blocks)
        while seq.num_asked < len(seq.tiers) and start < len(chain):
            tier = seq.tiers[seq.num_asked]
            query = TierQuery(seq.request_id, seq.key, seq.prompt, chain, start)
            try:
                n = tier.num_matched(query)
            except Exception:
                self.metrics.cache_errors.labels("tier").inc()
                log.exception("tier %s failed to answer; recomputing its part", tier.name)
                n = 0
            if n is None:
                now = time.monotonic()
                if seq.asking is None:
                    seq.asking, seq.asking_since_s = query, now
                if now - seq.asking_since_s < self.config.max_tier_wait_s:
                    return False
                log.warning("tier %s is still finding out after %.1f s; going ahead without it",
                            tier.name, now - seq.asking_since_s)
                n = 0
            seq.asking = None
            seq.num_asked += 1
            n = max(0, min(int(n), len(chain) - start))
            if n == 0:
                self._forget(tier, query)  # not loading after all
                continue
            seq.loads.append(_Load(tier, query, n))
            start += n
        return True

    def _copy_prefix(self, seq: _Sequence) -> None:
        """Copy the hit's blocks that are not in this pool (T1) into the sequence's first fresh
        blocks, then resume computation after the hit; a failed copy recomputes them."""
        prefix, cache = seq.prefix, seq.prefix_cache
        if prefix is None or cache is None or prefix.num_blocks == 0:
            return
        try:
            cache.fill(prefix, seq.table)
        except Exception:
            self.metrics.cache_errors.labels("fill").inc()
            log.exception("cache copy failed; recomputing the copied part")
        if prefix.cached_tokens == 0:
            return
        seq.cached_tokens = seq.prefill_pos = prefix.cached_tokens
        seq.cache_tier = prefix.tier
        shared = min(len(prefix.table) * BLOCK_SIZE, prefix.cached_tokens)
        if shared:
            self.metrics.cached_tokens.labels("t0").inc(shared)
        if prefix.cached_tokens > shared:
            self.metrics.cached_tokens.labels("t1").inc(prefix.cached_tokens - shared)

    def _start_loads(self, seq: _Sequence) -> None:
        """Start every tier's load into the blocks the allocation gave it; the request waits
        (`loading`) until each has called `done`. After a gap (T1's copy failed) nothing lands:
        the tiers are told to forget it."""
        prefix = seq.prefix
        if not seq.loads:
            return
        if prefix is None or prefix.cached_tokens != prefix.num_blocks * BLOCK_SIZE:
            for load in seq.loads:
                self._forget(load.tier, load.query)
            seq.loads = []
            return
        for load in seq.loads:
            lo = load.query.start_block
            target = LoadTarget(self.kv, tuple(seq.table[lo : lo + load.num_blocks]))
            load.started = True
            seq.num_loading += 1
            done = self._done_for(seq, load)
            try:
                load.tier.load_into(load.query, target, done)
            except Exception:
                self.metrics.cache_errors.labels("load").inc()
                log.exception("tier %s failed to start its load; recomputing", load.tier.name)
                done(0)
        self.metrics.loading.inc()

    def _done_for(self, seq: _Sequence, load: _Load) -> Callable[[int], None]:
        """`load`'s `done`: callable from any thread; counted once, on the engine thread."""

        def done(num_blocks: int) -> None:
            try:
                landed = max(0, min(int(num_blocks), load.num_blocks))
            except (TypeError, ValueError):
                landed = 0
            with self._lock:
                if load.landed is not None:
                    return  # exactly once: a second call is the tier's bug, not our data
                load.landed = landed
                self._landed.append(seq)
            self.wake()

        return done

    def _land(self) -> None:
        """Process the loads whose `done` came: a request with none left resumes prefill after
        its leading landed blocks; one that ended meanwhile gives its blocks back now."""
        with self._lock:
            landed, self._landed = self._landed, []
        for seq in landed:
            self._progress += 1
            seq.num_loading -= 1
            if seq.num_loading:
                continue
            self.metrics.loading.dec()
            if seq.gone:
                self.kv.give_back(seq.table)  # no tier writes into them any more
                seq.table = []
            else:
                self._resume_after_loads(seq)

    def _resume_after_loads(self, seq: _Sequence) -> None:
        """The request's prefix: T0 and T1's blocks, then each tier's landed blocks up to the
        first gap (a tier that landed fewer than it matched; everything after it is recomputed,
        even what later tiers landed)."""
        prefix = seq.prefix
        assert prefix is not None
        blocks = prefix.cached_tokens // BLOCK_SIZE
        tier = seq.cache_tier
        for load in seq.loads:
            if load.query.start_block != blocks:
                break
            n = load.landed or 0
            if n:
                blocks += n
                tier = load.tier.name
                self.metrics.cached_tokens.labels(tier).inc(n * BLOCK_SIZE)
            if n < load.num_blocks:
                break
        added = blocks * BLOCK_SIZE - prefix.cached_tokens
        if added:
            seq.cached_tokens = seq.prefill_pos = blocks * BLOCK_SIZE
            seq.cache_tier = tier

    def _forget(self, tier: LowerTier, query: TierQuery) -> None:
        try:
            tier.forget(query)
        except Exception:
            self.metrics.cache_errors.labels("tier").inc()
            log.exception("tier %s failed to forget a request", tier.name)

    def _prefill_chunks(self, plan: list[tuple[_Sequence, int]]) -> None:
        """Prefill the next `n` prompt tokens of each planned sequence: one packed forward for
        all of them (fast path), or each in one-block chunks on its own (deterministic)."""
        chunks = [(seq.prompt[seq.prefill_pos : seq.prefill_pos + n], seq.prefill_pos, seq.table)
                  for seq, n in plan]
        if self.config.deterministic:
            rows = [self.model.prefill(t, lo, table, self.kv, chunk_tokens=BLOCK_SIZE)
                    for t, lo, table in chunks]
        else:
            rows = list(self.model.prefill_packed(chunks, self.kv))
        self._progress += 1
        for (seq, n), logits in zip(plan, rows, strict=True):
            seq.prefill_pos += n
            seq.last_logits = logits if seq.prefilled else None
            self.metrics.prefilled_tokens.inc(n)

    def _first_token(self, seq: _Sequence) -> int | None:
        """Sample and emit the first token (None: sampling failed, the request is over)."""
        assert seq.last_logits is not None
        sampled = self._sample(seq, seq.last_logits)
        seq.last_logits = None
        if sampled is None:
            return None
        self._push_token(seq, sampled)
        self.metrics.generated_tokens.inc()
        self.metrics.ttft.labels("hit" if seq.cached_tokens else "miss").observe(
            time.monotonic() - seq.submitted_s)
        return sampled.token_id

    def _after_first_token(self, seq: _Sequence, token: int) -> None:
        """Store the prompt, then end the request or start decoding it."""
        self._store_prompt(seq)  # before a finish can free the blocks
        if not self._finish_if_done(seq, token):
            self._batch.add(seq, seq.table, len(seq.prompt), token)

    def _store_prompt(self, seq: _Sequence) -> None:
        """Offer the prompt's full blocks to the cache (after the first token is out): indexed
        where they are, no copy, and shared with this sequence until it ends; the prefix's
        refs are released (the sequence's own holds keep its blocks).

        Offered on hits too: every offer counts a sighting, and sightings decide admission. Not
        offered to a cache switched in since the lookup (its next request is)."""
        prefix, cache = seq.prefix, seq.prefix_cache
        if prefix is None or cache is None or cache is not self.cache:
            return
        try:
            outcome = cache.finish(prefix, seq.prompt, seq.table)
        except Exception:
            self.metrics.cache_errors.labels("store").inc()
            log.exception("cache store failed; continuing without it")
            return
        if outcome is StoreOutcome.QUEUED:  # a copy (into T1) waits for the drain task
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._stores_pending.set)

    def _decode(self) -> None:
        """One forward for every decoding sequence, from the batch's kept inputs."""
        batch = self._batch
        self._progress += 1
        seqs = list(batch.seqs)  # a finish below moves rows; sample in this order
        inputs = batch.inputs()
        logits = (self._graphs(*inputs) if self._graphs is not None
                  else self.model.decode_step(*inputs, self.kv))
        rows = logits.to("cpu", torch.float32)  # one copy for the batch, not one per row
        try:  # the batch's sampling is one tensor path
            batch_sampled: list[Sampled | None] = list(
                sample_batch([s.sampler for s in seqs], rows, [s.output for s in seqs]))
        except Exception:  # one bad request must not fail its neighbours: row by row
            batch_sampled = [self._sample(seq, row) for seq, row in zip(seqs, rows, strict=True)]
        generated = 0
        for seq, sampled in zip(seqs, batch_sampled, strict=True):
            if sampled is not None:
                generated += 1
                self._accept(seq, sampled)
        self.metrics.generated_tokens.inc(generated)
        batch.advance([s.output[-1] for s in batch.seqs])

    def _sample(self, seq: _Sequence, logits: Tensor) -> Sampled | None:
        """Sample one token; a failure ends this request only, never its batch neighbours."""
        try:
            return seq.sampler.step(logits, seq.output)
        except Exception:
            log.exception("sampling failed; failing this request")
            self._finish(seq, "error", "sampling failed")
            return None

    def _accept(self, seq: _Sequence, sampled: Sampled) -> None:
        self._push_token(seq, sampled)
        self._finish_if_done(seq, sampled.token_id)

    def _push_token(self, seq: _Sequence, sampled: Sampled) -> None:
        """Append and emit; the caller counts it (`generated_tokens`)."""
        seq.output.append(sampled.token_id)
        self._emit(seq, TokenEvent(token_id=sampled.token_id, cached_tokens=seq.cached_tokens,
                                   logprob=sampled.logprob, top_logprobs=sampled.top_logprobs,
                                   cache_tier=seq.cache_tier))

    def _finish_if_done(self, seq: _Sequence, token: int) -> bool:
        params = seq.request.params
        if token in params.stop_token_ids or (token in self.config.stop_ids
                                              and not params.ignore_eos):
            self._finish(seq, "stop")
        elif len(seq.output) >= params.max_tokens:
            self._finish(seq, "length")
        else:
            return False
        return True

    def _finish(self, seq: _Sequence, reason: FinishReason, error: str | None = None) -> None:
        self._progress += 1
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._batch:
            self._batch.remove(seq)
        self._let_go(seq)
        self._finished_event(seq, reason, error)

    def _let_go(self, seq: _Sequence) -> None:
        """Give back the table's blocks (cached ones stay cached) and the hit's refs; a tier
        still asked or loading is told to forget the request. Blocks a tier is landing in stay
        held until its `done` (`_land` gives them back)."""
        for load in seq.loads:
            if load.landed is None:
                self._forget(load.tier, load.query)
        if seq.asking is not None:  # a tier still finding out about it
            self._forget(seq.tiers[seq.num_asked], seq.asking)
            seq.asking = None
        seq.num_asked = len(seq.tiers)
        if seq.loading:
            seq.gone = True
        else:
            self.kv.give_back(seq.table)
            seq.table = []
        if seq.prefix is not None and seq.prefix_cache is not None:
            try:
                seq.prefix_cache.finish(seq.prefix)  # releases what `finish` has not yet
            except Exception:
                self.metrics.cache_errors.labels("release").inc()
                log.exception("cache release failed")
            seq.prefix, seq.prefix_cache = None, None

    def _finished_event(self, seq: _Sequence, reason: FinishReason,
                        error: str | None = None) -> None:
        self.metrics.requests.labels(reason).inc()
        self._emit(seq, Finished(finish_reason=reason, prompt_tokens=len(seq.prompt),
                                 completion_tokens=len(seq.output),
                                 cached_tokens=seq.cached_tokens, cache_tier=seq.cache_tier,
                                 error=error))

    def _fail_running(self) -> None:
        self._firsts = []
        for seq in list(self._running):
            self._finish(seq, "error", "internal error while generating")

