"""`kvfleet bench vllm-serve`, the pure parts: the Mooncake trace turned into prompts, vLLM's
`/metrics` and `vllm bench serve --save-result` read back, and the figures compared.

The runner (kvfleet_lab.vllm.serve_run) starts the servers and the client; everything here is
plain data in, plain data out, so the unit tests need neither vLLM nor a server."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BY_SOURCE", "FLEET_FRONTS", "FRONTS", "FRONT_SEEDS", "SOURCES", "RunFigures",
           "SourceTokens", "busiest_roots", "by_source", "read_run", "saved_ratio",
           "select_fronts", "summary", "trace_rows", "word_vocab"]

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's own split of prompt tokens: computed here, its prefix cache, a KV connector."""

FRONT_SEEDS = {"vllm": 1, "kvfleet": 2, "vllm-offloading": 3, "lmcache": 4,
               "fleet-router": 11, "fleet-round-robin": 12, "fleet-round-robin-plain": 13}
"""Each front's prompt seed, fixed per front (whatever else a run selects): a front's prompts are
the same in every run, and no two fronts share a block."""
FRONTS = tuple(FRONT_SEEDS)
"""Every front the bench knows, in its default order: one server each, then the two replicas."""
FLEET_FRONTS = tuple(f for f in FRONTS if f.startswith("fleet-"))
"""The fronts served by the two kvfleet-connector replicas sharing T2."""

_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def word_vocab(num_words: int) -> list[str]:
    """The bench checkpoint's words: one token each under its word-level tokenizer, so a prompt
    of n words is n tokens and decode/encode round-trip exactly."""
    return [f"w{i}" for i in range(num_words)]


def select_fronts(text: str | None, *, lmcache: bool) -> tuple[str, ...]:
    """`--fronts a,b,...` -> the fronts to measure, in the order given (duplicates dropped).
    None: every front in FRONTS' order, `lmcache` only when its env is given (`lmcache`). An
    unknown name, an empty list or `lmcache` without its env is refused (ValueError, the
    message names the known fronts)."""
    if text is None:
        return tuple(f for f in FRONTS if lmcache or f != "lmcache")
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRONT_SEEDS]
    if unknown:
        raise ValueError(f"unknown front(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(FRONTS)}")
    if not names:
        raise ValueError(f"no front named; known: {', '.join(FRONTS)}")
    if "lmcache" in names and not lmcache:
        raise ValueError("front 'lmcache' needs --lmcache-vllm (the `vllm` command of an env "
                         "with LMCache)")
    return tuple(dict.fromkeys(names))


def busiest_roots(rows: Iterable[Mapping[str, Any]], num_roots: int) -> set[int]:
    """The `num_roots` first block ids that start the most requests (ties: the smaller id)."""
    counts = Counter(int(r["hash_ids"][0]) for r in rows if r.get("hash_ids"))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {h for h, _ in ranked[:num_roots]}


def trace_rows(rows: Sequence[Mapping[str, Any]], *, num_requests: int, num_roots: int,
               block_tokens: int, max_blocks: int, max_output_tokens: int, id_offset: int = 0
               ) -> list[dict[str, Any]]:
    """Mooncake trace rows (`hash_ids`, `input_length`, `output_length`) sized for a small
    replica, for `vllm bench serve --dataset-name timed_trace --timed-trace-chunk-hash-size
    block_tokens` (vLLM's own replay: each block id becomes the same `block_tokens` random
    tokens wherever it appears, so a shared block prefix is a shared token prefix).

    Mooncake's blocks are 512 tokens and its prompts run to 40k; a CPU replica serves 2k. A prompt
    keeps its first `max_blocks` blocks. The whole trace reuses 60% of its blocks but a window of a
    few hundred consecutive requests only 6% (its reuse distances are thousands of requests), so the
    rows are the requests that start with one of the trace's `num_roots` busiest first blocks, in
    trace order: their reuse (0.82 of blocks for 96 requests from 16 roots) is the trace's own
    sharing, interleaved as it was. `id_offset` moves every block id (another run's blocks, never
    this one's); timestamps are 0 (the client's concurrency paces the replay)."""
    if num_requests < 1 or num_roots < 1 or block_tokens < 1 or max_blocks < 1:
        raise ValueError(f"num_requests={num_requests}, num_roots={num_roots}, "
                         f"block_tokens={block_tokens}, max_blocks={max_blocks}: each must be >= 1")
    roots = busiest_roots(rows, num_roots)
    out: list[dict[str, Any]] = []
    for row in rows:
        ids = [int(h) for h in row.get("hash_ids") or ()]
        if not ids or ids[0] not in roots:
            continue
        kept = ids[:max_blocks]
        out.append({"timestamp": 0, "input_length": len(kept) * block_tokens,
                    "output_length": max(1, min(int(row["output_length"]), max_output_tokens)),
                    "hash_ids": [h + id_offset for h in kept]})
        if len(out) == num_requests:
            break
    return out


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.append((name, dict(_LABEL.findall(labels or "")), number))
    return out


@dataclass(slots=True, frozen=True)
class SourceTokens:
    """Prompt tokens by where their KV came from (vLLM's own counter)."""

    local_compute: float = 0.0
    local_cache_hit: float = 0.0
    external_kv_transfer: float = 0.0

    def __sub__(self, other: SourceTokens) -> SourceTokens:
        return SourceTokens(*(getattr(self, s) - getattr(other, s) for s in SOURCES))

    def __add__(self, other: SourceTokens) -> SourceTokens:
        return SourceTokens(*(getattr(self, s) + getattr(other, s) for s in SOURCES))

    @property
    def saved(self) -> float:
        """Prompt tokens not computed: vLLM's prefix cache plus the connector."""
        return self.local_cache_hit + self.external_kv_transfer

    @property
    def total(self) -> float:
        return self.saved + self.local_compute


def by_source(metrics_text: str) -> SourceTokens:
    """`vllm:prompt_tokens_by_source_total` summed over its other labels, per source; an
    unknown source is refused (vLLM added one: the split would no longer add up)."""
    sums = dict.fromkeys(SOURCES, 0.0)
    for name, labels, value in parse_metrics(metrics_text):
        if name != BY_SOURCE:
            continue
        source = labels.get("source", "")
        if source not in sums:
            raise ValueError(f"{BY_SOURCE} has source {source!r}, not one of {SOURCES}")
        sums[source] += value
    return SourceTokens(**sums)


@dataclass(slots=True, frozen=True)
class RunFigures:
    """One `vllm bench serve` run against one front (a server, the router or round-robin)."""

    config: str
    workload: str
    num_requests: int
    num_failed: int
    request_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens: SourceTokens = field(default_factory=SourceTokens)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens"]["saved"] = self.tokens.saved
        out["hit_fraction"] = self.tokens.saved / self.tokens.total if self.tokens.total else 0.0
        return out


def read_run(config: str, workload: str, result: Mapping[str, Any],
             tokens: SourceTokens) -> RunFigures:
    """A run's figures from `--save-result` JSON (with `--percentile-metrics ttft
    --metric-percentiles 50,99`); a run with no completed request is refused."""
    completed = result.get("completed")
    if not isinstance(completed, int) or completed < 1:
        raise ValueError(f"{config}/{workload}: the bench completed {completed!r} requests")
    figures = {}
    for ours, theirs in (("request_throughput", "request_throughput"),
                         ("ttft_p50_ms", "median_ttft_ms"), ("ttft_p99_ms", "p99_ttft_ms")):
        value = result.get(theirs)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{config}/{workload}: the bench result's {theirs!r} is {value!r}")
        figures[ours] = float(value)
    failed = result.get("failed", 0)
    return RunFigures(config, workload, completed, int(failed) if isinstance(failed, int) else 0,
                      tokens=tokens, **figures)


def saved_ratio(ours: RunFigures, theirs: RunFigures) -> float | None:
    """Prompt tokens saved by `ours` / by `theirs` (None when theirs saved none)."""
    return ours.tokens.saved / theirs.tokens.saved if theirs.tokens.saved else None


def summary(runs: Sequence[RunFigures]) -> dict[str, Any]:
    """The targets, per workload: kvfleet's connector against vLLM's OffloadingConnector (hit
    tokens, TTFT p50; >= 1 and <= 1 meet them) and kvfleet's router against round-robin
    (prefill tokens saved, target >= 1.3)."""
    out: dict[str, Any] = {}
    for workload in sorted({r.workload for r in runs}):
        got = {r.config: r for r in runs if r.workload == workload}
        row: dict[str, Any] = {}
        kv, off = got.get("kvfleet"), got.get("vllm-offloading")
        if kv is not None and off is not None:
            row["kvfleet_vs_offloading_hit_tokens"] = saved_ratio(kv, off)
            row["kvfleet_vs_offloading_ttft_p50"] = (
                kv.ttft_p50_ms / off.ttft_p50_ms if off.ttft_p50_ms else None)
        router = got.get("fleet-router")
        for rr_name in ("fleet-round-robin", "fleet-round-robin-plain"):
            rr = got.get(rr_name)
            if router is not None and rr is not None:
                row[f"router_vs_{rr_name.removeprefix('fleet-')}_saved"] = saved_ratio(router, rr)
        out[workload] = row
    return out
