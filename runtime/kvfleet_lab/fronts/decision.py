"""The picker's decision latency, in-process: `Picker.pick` on a long text prompt (2,000 tokens by
default) over two vLLM replicas whose KV-event views hold a working set, with the model's own
tokenizer, as `kvfleet router --tokenizer` runs it (a prompt over 4,096 characters is encoded on
a worker thread). Each pick's time from the picker's own clock (what its histogram exports) and
the process's CPU time over it (on a shared box the wall time is mostly waiting for a core), the
exact p50/p99 over `--picks` picks, half of them on a held prefix. Runs in the main venv."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfleet_lab.fronts.figures import percentile

__all__ = ["main", "measure"]


async def _measure(model: Path, prompt_tokens: int, picks: int, num_prefixes: int
                   ) -> dict[str, Any]:
    from kvfleet_runtime.auth import cache_salt
    from kvfleet_runtime.picker import FleetView, KvEventViews, Picker, PickRequest
    from kvfleet_runtime.picker._kv_events import BlockStored, KvEventBatch
    from kvfleet_runtime.tokenizer import load_tokenizer
    from kvfleet_runtime.wire import LoadReport

    tokenizer = load_tokenizer(model)
    secret = b"decision-bench-secret"
    view = FleetView(static_replicas={"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"},
                     recompute_s_per_token=1e-3)
    for r in view.replicas.values():
        r.report = LoadReport(ready=True, kv_occupancy=0.2)
    views = KvEventViews()
    salt = cache_salt(secret, "acme")
    texts = []
    for p in range(num_prefixes):
        words = [f"w{(p * 7 + i) % 590 + 5}" for i in range(prompt_tokens)]
        texts.append(" ".join(words))
        ids = tokenizer.encode(texts[-1])
        held = ids[: len(ids) // 16 * 16]
        blocks = len(held) // 16
        extra: list[list[object] | None] = [[salt], *([None] * (blocks - 1))]
        views.view("ab"[p % 2]).apply(p, KvEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[p * 100_000 + i for i in range(blocks)], parent_block_hash=None,
            token_ids=held, block_size=16, extra_keys=extra,
            medium="GPU", group_idx=0)]))
    picker = Picker(view, kv_events=views, tokenizer=tokenizer, router_secret=secret)
    cold = [" ".join(f"w{(n * 13 + i) % 590 + 5}" for i in range(prompt_tokens))
            for n in range(8)]
    times_s, cpu_s, reasons = [], [], []
    for n in range(picks):
        text = texts[n % len(texts)] if n % 2 == 0 else cold[n % len(cold)]
        cpu = time.process_time()  # every thread of this process: the encoding's worker too
        pick = await picker.pick(PickRequest("acme", {"prompt": text + f" w{n % 5}"}, False))
        cpu_s.append(time.process_time() - cpu)
        assert pick is not None
        times_s.append(pick.decision_s)
        reasons.append(pick.reason)
    ms = [1000 * t for t in times_s]
    cpu_ms = [1000 * t for t in cpu_s]
    return {"prompt_tokens": len(tokenizer.encode(texts[0])), "picks": picks,
            "decision_p50_ms": percentile(ms, 50), "decision_p99_ms": percentile(ms, 99),
            "decision_cpu_p50_ms": percentile(cpu_ms, 50),
            "decision_cpu_p99_ms": percentile(cpu_ms, 99),
            "warm_picks": reasons.count("warm")}


def measure(model: Path, prompt_tokens: int = 2000, picks: int = 2000,
            num_prefixes: int = 12) -> dict[str, Any]:
    started = time.perf_counter()
    out = asyncio.run(_measure(model, prompt_tokens, picks, num_prefixes))
    out["wall_s"] = time.perf_counter() - started
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet_lab.fronts.decision",
                                description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="a model folder (its tokenizer)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--picks", type=int, default=2000)
    args = p.parse_args(argv)
    sys.stdout.write(json.dumps(measure(args.model, args.prompt_tokens, args.picks)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
