"""The engine comparison: a kvfleet replica vs vLLM serving the same checkpoint, same client.

Both servers are driven by the same `vllm bench serve` command line (same dataset, seed,
concurrency, prompt and output lengths), run after run in alternation (kvfleet, vLLM, kvfleet,
...) so a shared machine's load falls on both alike. Each run's `--save-result` JSON gives
TTFT and TPOT percentiles and the output throughput; the comparison takes, per side, the median
of each figure over its runs and reports kvfleet / vLLM:

    engine_vs_vllm: [{checkpoint, concurrency, tpot_p50_ratio, ttft_p99_ratio,
                      throughput_ratio, ...}]

(ratios under 1 are kvfleet faster for TPOT and TTFT; over 1 is kvfleet faster for
throughput). `compare` is the pure part (tested on its own); `run_interleaved` runs the client
against two already-started servers (`kvfleet bench vllm-serve` starts them).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["FIGURES", "EngineComparison", "ServeFigures", "compare", "read_result",
           "run_interleaved", "serve_command"]

FIGURES = {
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
    "output_tok_s": "output_throughput",
}
"""Our name -> the key of `vllm bench serve --save-result`'s JSON."""


@dataclass(slots=True, frozen=True)
class ServeFigures:
    """One `vllm bench serve` run against one server."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tok_s: float


@dataclass(slots=True, frozen=True)
class EngineComparison:
    checkpoint: str
    concurrency: int
    runs: int
    kvfleet: ServeFigures
    """Medians over kvfleet's runs."""
    vllm: ServeFigures

    @property
    def tpot_p50_ratio(self) -> float:
        return self.kvfleet.tpot_p50_ms / self.vllm.tpot_p50_ms

    @property
    def tpot_p99_ratio(self) -> float:
        return self.kvfleet.tpot_p99_ms / self.vllm.tpot_p99_ms

    @property
    def ttft_p50_ratio(self) -> float:
        return self.kvfleet.ttft_p50_ms / self.vllm.ttft_p50_ms

    @property
    def ttft_p99_ratio(self) -> float:
        return self.kvfleet.ttft_p99_ms / self.vllm.ttft_p99_ms

    @property
    def throughput_ratio(self) -> float:
        return self.kvfleet.output_tok_s / self.vllm.output_tok_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("tpot_p50_ratio", "tpot_p99_ratio", "ttft_p50_ratio", "ttft_p99_ratio",
                     "throughput_ratio"):
            out[name] = getattr(self, name)
        return out


def read_result(data: Mapping[str, Any]) -> ServeFigures:
    """The figures of one `--save-result` JSON; a missing or non-positive figure is refused
    (a run that produced no tokens has nothing to compare)."""
    values: dict[str, float] = {}
    for ours, theirs in FIGURES.items():
        value = data.get(theirs)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"the bench result's {theirs!r} is {value!r}, not a positive number")
        values[ours] = float(value)
    return ServeFigures(**values)


def _median(runs: Sequence[ServeFigures]) -> ServeFigures:
    return ServeFigures(**{name: statistics.median(getattr(r, name) for r in runs)
                           for name in FIGURES})


def compare(checkpoint: str, concurrency: int, kvfleet: Sequence[ServeFigures],
            vllm: Sequence[ServeFigures]) -> EngineComparison:
    """Medians per side, from interleaved runs (the same number of each)."""
    if not kvfleet or len(kvfleet) != len(vllm):
        raise ValueError(f"interleaved runs come in pairs: {len(kvfleet)} kvfleet, "
                         f"{len(vllm)} vLLM")
    return EngineComparison(checkpoint, concurrency, len(kvfleet), _median(kvfleet),
                            _median(vllm))


def serve_command(vllm: str, *, base_url: str, model: str, tokenizer: str, concurrency: int,
                  num_prompts: int, extra: Sequence[str], result_dir: Path, result_name: str
                  ) -> list[str]:
    """The client's command line; only the server it talks to differs between the sides."""
    return [vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
            "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
            *extra]


def run_interleaved(vllm: str, *, checkpoint: str, kvfleet_url: str, vllm_url: str, model: str,
                    tokenizer: str, concurrency: int, num_prompts: int, runs: int,
                    extra: Sequence[str] = (), timeout_s: float = 600.0) -> EngineComparison:
    """`runs` pairs of client runs, kvfleet then vLLM, against two started servers."""
    sides: dict[str, list[ServeFigures]] = {"kvfleet": [], "vllm": []}
    with tempfile.TemporaryDirectory(prefix="kvfleet-vs-vllm-") as tmp:
        for i in range(runs):
            for side, url in (("kvfleet", kvfleet_url), ("vllm", vllm_url)):
                name = f"{side}-{i}.json"
                cmd = serve_command(vllm, base_url=url, model=model, tokenizer=tokenizer,
                                    concurrency=concurrency, num_prompts=num_prompts,
                                    extra=extra, result_dir=Path(tmp), result_name=name)
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                      check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"vllm bench serve against {side} exited "
                                       f"{done.returncode}: {done.stderr[-2000:]}")
                sides[side].append(read_result(json.loads((Path(tmp) / name).read_text())))
    return compare(checkpoint, concurrency, sides["kvfleet"], sides["vllm"])
