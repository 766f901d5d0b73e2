"""Side-by-side hit rates of prefix-cache policies on the same requests at the same capacities:
what `kvfleet bench` (issue 9) reports. Pure and torch-free; returns records, prints nothing.

Policies (all from `kvfleet_lab.cache.sim`, replayed one request at a time, capacity in
16-token blocks):

    no-cache   every prompt token is prefilled (hit rate 0: the prefill reference)
    vllm       per-block hash cache, LRU over freed blocks (vLLM v1 prefix caching)
    radix      radix tree, leaf-first LRU of whole segments (SGLang RadixAttention)
    s3fifo     S3-FIFO (SOSP'23): small probationary FIFO, main FIFO with 2-bit counts, ghost
    sieve      SIEVE (NSDI'24): one FIFO, a visited bit and a moving hand
    kvfleet    the shipped policy: kvfleet_runtime.cache.CacheManager
    belady     Belady's offline optimum at the same capacity (an upper bound of any policy)
    infinite   nothing is ever evicted (the workload's bound)

Hits count the longest cached prefix of full blocks, for every policy alike: the "recompute the
last prompt token" rule of the engines (vLLM, SGLang and kvfleet's own all have it) is left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfleet_lab.cache.blockpool import simulate_vllm_pool
from kvfleet_lab.cache.explain import LostHits, explain_lost_hits
from kvfleet_lab.cache.sim import (
    SimResult,
    TraceRequest,
    simulate_belady,
    simulate_infinite,
    simulate_kvfleet,
    simulate_radix,
    simulate_s3fifo,
    simulate_sieve,
    simulate_vllm,
    unique_blocks,
)

__all__ = [
    "ANCHORS",
    "BASELINES",
    "POLICIES",
    "CapacityRow",
    "PolicyComparison",
    "PolicyFigure",
    "WorkloadResult",
    "compare_policies",
    "compare_workload",
]

POLICIES = ("no-cache", "vllm", "radix", "s3fifo", "sieve", "kvfleet", "belady", "infinite")
BASELINES = ("vllm", "radix")
"""The LRU policies kvfleet is compared against (the engines' own)."""
ANCHORS = ("s3fifo", "sieve")
"""Published scan-resistant policies, replayed as anchors to beat."""

_AT_CAPACITY: dict[str, Callable[[Sequence[TraceRequest], int], SimResult]] = {
    "vllm": simulate_vllm,
    "radix": simulate_radix,
    "s3fifo": simulate_s3fifo,
    "sieve": simulate_sieve,
    "kvfleet": simulate_kvfleet,
    "belady": simulate_belady,
}


@dataclass(slots=True)
class PolicyFigure:
    policy: str
    token_hit_rate: float
    request_hit_rate: float
    num_hit_tokens: int
    seconds: float
    """Simulation wall time (noisy on a shared machine; never asserted)."""
    extra: dict[str, float] = field(default_factory=dict)
    compute_saved: float = 0.0
    """Share of the prefill FLOPs (sim.COST_MODEL) the hits saved."""


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@dataclass(slots=True)
class CapacityRow:
    capacity_fraction: float
    """Of the workload's unique blocks."""
    capacity_blocks: int
    figures: dict[str, PolicyFigure]
    vllm_pool: PolicyFigure | None = None
    """vLLM's own `BlockPool` replayed on the same requests (`blockpool.py`), beside the
    project's model of it ("vllm"); None where vllm was not found."""
    lost_hits: LostHits | None = None
    """What Belady hits and kvfleet does not, and what came between (`explain.py`); None unless
    asked for."""

    def rate(self, policy: str) -> float:
        return self.figures[policy].token_hit_rate

    def saved(self, policy: str) -> float:
        return self.figures[policy].compute_saved

    def kvfleet_saved_vs(self, policy: str) -> float | None:
        """kvfleet's prefill compute saved over `policy`'s."""
        return _ratio(self.saved("kvfleet"), self.saved(policy))

    def kvfleet_vs(self, policy: str) -> float | None:
        """kvfleet's token hit rate over `policy`'s (None when `policy` hits nothing)."""
        return _ratio(self.rate("kvfleet"), self.rate(policy))

    def of_infinite(self, policy: str) -> float | None:
        return _ratio(self.rate(policy), self.rate("infinite"))

    def prefill_vs_no_cache(self, policy: str) -> float:
        """Prompt tokens `policy` still prefills, as a share of what no cache prefills."""
        return 1.0 - self.rate(policy)


@dataclass(slots=True)
class WorkloadResult:
    name: str
    description: str
    num_requests: int
    num_tokens: int
    num_unique_blocks: int
    rows: list[CapacityRow]
    vllm_pool_error: str | None = None
    """Why vLLM's BlockPool replay did not run here (None: it ran, or vllm was not looked for)."""


@dataclass(slots=True)
class PolicyComparison:
    workloads: list[WorkloadResult]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for workload, raw in zip(self.workloads, data["workloads"], strict=True):
            for row, raw_row in zip(workload.rows, raw["rows"], strict=True):
                others = (*BASELINES, *ANCHORS, "belady")
                raw_row["kvfleet_vs"] = {p: row.kvfleet_vs(p) for p in others}
                raw_row["kvfleet_saved_vs"] = {p: row.kvfleet_saved_vs(p) for p in others}
                raw_row["of_infinite"] = {p: row.of_infinite(p) for p in POLICIES}
                raw_row["prefill_vs_no_cache"] = {p: row.prefill_vs_no_cache(p) for p in POLICIES}
        return data

    def to_markdown(self) -> str:
        lines = []
        for w in self.workloads:
            lines += [
                f"### {w.name}",
                "",
                f"{w.description}. {w.num_requests:,} requests, {w.num_tokens:,} prompt tokens, "
                f"{w.num_unique_blocks:,} unique blocks.",
                "",
                "| capacity | vLLM | radix | S3-FIFO | SIEVE | kvfleet | Belady | infinite "
                "| kvfleet / vLLM | kvfleet / radix | kvfleet / S3-FIFO | kvfleet / SIEVE "
                "| kvfleet / Belady | vLLM / inf | radix / inf | kvfleet / inf "
                "| Belady / inf | prefill vs no cache (kvfleet) | compute saved: vLLM | radix "
                "| kvfleet | Belady | kvfleet / Belady (compute) |",
                "|" + "---|" * 23,
            ]
            for r in w.rows:
                cells = [f"{r.capacity_fraction:.0%} ({r.capacity_blocks:,} blocks)"]
                cells += [
                    f"{r.rate(p):.1%}"
                    for p in ("vllm", "radix", *ANCHORS, "kvfleet", "belady", "infinite")
                ]
                cells += [_fmt_ratio(r.kvfleet_vs(p)) for p in (*BASELINES, *ANCHORS, "belady")]
                cells += [
                    _fmt_ratio(r.of_infinite(p)) for p in ("vllm", "radix", "kvfleet", "belady")
                ]
                cells.append(f"{r.prefill_vs_no_cache('kvfleet'):.0%}")
                cells += [f"{r.saved(p):.1%}" for p in ("vllm", "radix", "kvfleet", "belady")]
                cells.append(_fmt_ratio(r.kvfleet_saved_vs("belady")))
                lines.append("| " + " | ".join(cells) + " |")
            lines += ["", f"kvfleet / Belady, {w.name}: {_of_belady(w)}.", ""]
            if any(r.vllm_pool is not None for r in w.rows):
                lines += [
                    "vLLM's own BlockPool (`vllm.v1.core.block_pool`) on the same requests, beside "
                    "the project's vLLM replay:",
                    "",
                    "| capacity | vLLM BlockPool | vLLM replay | hit tokens equal |",
                    "|---|---|---|---|",
                ]
                for r in w.rows:
                    if r.vllm_pool is not None:
                        same = r.vllm_pool.num_hit_tokens == r.figures["vllm"].num_hit_tokens
                        lines.append(
                            f"| {r.capacity_fraction:.0%} | {r.vllm_pool.token_hit_rate:.2%} | "
                            f"{r.rate('vllm'):.2%} | {'yes' if same else 'no'} |"
                        )
                lines.append("")
            if w.vllm_pool_error:
                lines += [f"vLLM's BlockPool replay did not run: {w.vllm_pool_error}", ""]
            lines += _lost_hits_table(w)
        return "\n".join(lines)


def _lost_hits_table(w: WorkloadResult) -> list[str]:
    rows = [(r, r.lost_hits) for r in w.rows if r.lost_hits is not None]
    if not rows:
        return []
    lines = [
        f"What Belady hits and kvfleet does not, {w.name} (block-weighted; between the two uses "
        "of each lost block, in capacities, p25 / p50 / p75):",
        "",
        "| capacity | lost blocks (of Belady's hits) | kvfleet hits Belady misses | at their "
        "first reuse | blocks requested between | first sightings between | once-seen between "
        "| returning first sightings between | once-seen share of the first sightings | "
        "returning < capacity | first sightings < capacity | LRU storing only returning blocks "
        "(offline) / Belady |",
        "|" + "---|" * 12,
    ]
    for r, lost in rows:
        belady = r.figures["belady"].num_hit_tokens // 16
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r.capacity_fraction:.0%}",
                    f"{lost.num_lost_blocks:,} ({_share(lost.num_lost_blocks, belady)})",
                    f"{lost.num_gained_blocks:,}",
                    f"{lost.first_reuse_share:.0%}",
                    _fmt_quartiles(lost.accesses_quartiles),
                    _fmt_quartiles(lost.new_quartiles),
                    _fmt_quartiles(lost.once_quartiles),
                    _fmt_quartiles(lost.returning_quartiles),
                    f"{lost.once_share_of_new:.0%}",
                    f"{lost.share_returning_below_capacity:.0%}",
                    f"{lost.share_new_below_capacity:.0%}",
                    _fmt_ratio(_ratio(lost.returning_only_lru_hit_blocks, belady)),
                ]
            )
            + " |"
        )
    return [*lines, ""]


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "—"


def _fmt_quartiles(q: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in q)


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _of_belady(w: WorkloadResult) -> str:
    """kvfleet / Belady at each capacity, in tokens and in prefill compute."""
    return ", ".join(
        f"{r.capacity_fraction:.0%} {_fmt_ratio(r.kvfleet_vs('belady'))} of its tokens, "
        f"{_fmt_ratio(r.kvfleet_saved_vs('belady'))} of its compute"
        for r in w.rows
    )


def _figure(result: SimResult, seconds: float) -> PolicyFigure:
    return PolicyFigure(
        result.policy,
        result.token_hit_rate,
        result.request_hit_rate,
        result.num_hit_tokens,
        seconds,
        dict(result.extra),
        result.compute_saved,
    )


def compare_workload(
    name: str,
    description: str,
    requests: Sequence[TraceRequest],
    fractions: Sequence[float],
    *,
    on_progress: Callable[[str], None] | None = None,
    vllm_python: str | None = None,
    explain: bool = False,
) -> WorkloadResult:
    """Every policy on `requests` at each capacity (a fraction of the unique blocks); with
    `vllm_python` (an interpreter that imports vllm), vLLM's own BlockPool too; with `explain`,
    each row's `lost_hits` (what Belady hits and kvfleet does not), from the same replays."""
    if not requests:
        raise ValueError(f"workload {name!r} has no requests")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"capacity fractions must be in (0, 1], got {list(fractions)}")
    unique = unique_blocks(requests)
    t0 = time.perf_counter()
    infinite = _figure(simulate_infinite(requests), time.perf_counter() - t0)
    no_cache = PolicyFigure("no-cache", 0.0, 0.0, 0, 0.0)  # saves no compute either
    rows = []
    for fraction in fractions:
        capacity = max(1, round(unique * fraction))
        figures = {"no-cache": no_cache}
        results: dict[str, SimResult] = {}
        for policy, simulate in _AT_CAPACITY.items():
            if on_progress is not None:
                on_progress(f"{name}: {policy} at {fraction:.0%} ({capacity:,} blocks)")
            t0 = time.perf_counter()
            result = results[policy] = simulate(requests, capacity)
            figures[policy] = _figure(result, time.perf_counter() - t0)
        figures["infinite"] = infinite
        row = CapacityRow(fraction, capacity, {p: figures[p] for p in POLICIES})
        if explain:
            if on_progress is not None:
                on_progress(f"{name}: what Belady keeps that kvfleet drops at {fraction:.0%}")
            row.lost_hits = explain_lost_hits(requests, results["kvfleet"], results["belady"])
        rows.append(row)
    error = None
    if vllm_python is not None:
        if on_progress is not None:
            on_progress(f"{name}: vLLM's BlockPool at every capacity ({vllm_python})")
        t0 = time.perf_counter()
        try:
            pool = simulate_vllm_pool(
                requests, [r.capacity_blocks for r in rows], python=vllm_python
            )
        except RuntimeError as exc:
            error = str(exc)
        else:
            seconds = (time.perf_counter() - t0) / len(rows)
            for row in rows:
                row.vllm_pool = _figure(pool[row.capacity_blocks], seconds)
    return WorkloadResult(
        name,
        description,
        len(requests),
        sum(r.num_tokens for r in requests),
        unique,
        rows,
        error,
    )


def compare_policies(
    workloads: Sequence[tuple[str, str, Sequence[TraceRequest]]],
    fractions: Sequence[float],
    *,
    on_progress: Callable[[str], None] | None = None,
    vllm_python: str | None = None,
    explain: bool = False,
) -> PolicyComparison:
    start = time.perf_counter()
    results = [
        compare_workload(
            name,
            description,
            requests,
            fractions,
            on_progress=on_progress,
            vllm_python=vllm_python,
            explain=explain,
        )
        for name, description, requests in workloads
    ]
    return PolicyComparison(results, time.perf_counter() - start)
