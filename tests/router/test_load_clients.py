"""Real load clients against a replica and against the router in front of it, unchanged:
vLLM's `vllm bench serve` (from vLLM's own environment, `scripts/vllm-env.sh`) on its
`prefix_repetition` and `random` datasets. Every request must succeed, and the token counts the
client reports must equal the ones the replica counted (its Prometheus counters); the client's
own failure (a non-zero exit, a missing result) is a test failure.

The checkpoint is a tiny random one with a real tokenizer (the BPE fixture), which the client
loads as vLLM clients do: from the folder `/v1/models` names as the model's `root`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvfleet_runtime.affinity import parse_api_keys
from kvfleet_runtime.auth import DEFAULT_TENANT
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState
from kvfleet_runtime.server import ReplicaAuth, build_replica, load_config
from kvfleet_runtime.tokenizer import load_tokenizer
from tests.router.test_openai_fleet import RouterThread
from tests.runtime.server.conftest import TEST_CONFIG, ServerThread
from tests.runtime.tokenizer.conftest import bpe_dir  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TIMEOUT_S = 900
"""vLLM's CLI imports for minutes on a loaded machine; the requests themselves take seconds."""
API_KEY = "sk-acme"


@dataclasses.dataclass
class Served:
    replica_url: str
    router_url: str
    replica: ServerThread
    model_dir: Path

    def counters(self) -> dict[str, float]:
        """The replica's token counters, as /metrics reports them."""
        metrics = self.replica.replica.engine.metrics
        return {"prompt": metrics.prompt_tokens._value.get(),
                "generated": metrics.generated_tokens._value.get(),
                "cached": sum(s.value for m in metrics.cached_tokens.collect()
                              for s in m.samples if s.name.endswith("_total"))}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, bpe_dir: Path  # noqa: F811
           ) -> Iterator[Served]:
    torch.set_num_threads(1)
    tok = load_tokenizer(bpe_dir)
    out = tmp_path_factory.mktemp("load-clients") / "tiny-bpe"
    args = dataclasses.replace(ModelArgs.from_preset("tiny"), vocab_size=tok.vocab_size)
    generate_checkpoint(out, args, seed=0)
    config = json.loads((out / "config.json").read_text())
    config.pop("kvfleet_tokenizer")
    (out / "config.json").write_text(json.dumps(config))
    for f in bpe_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    config_path = out.parent / "replica.yaml"
    limits = {**TEST_CONFIG["limits"], "max_prompt_tokens": 1024, "max_tokens": 64}
    config_path.write_text(yaml.safe_dump({**TEST_CONFIG, "model_id": "tiny", "limits": limits}))
    overrides = {"model_dir": str(out)}
    replica = build_replica(load_config(config_path, environ={}, overrides=overrides),
                            overrides=overrides)
    with contextlib.ExitStack() as stack:
        # No router secret: the clients reach the replica directly as tenant `default` (on
        # loopback), and the router in front of it serves that tenant's key.
        server = stack.enter_context(ServerThread(replica, ReplicaAuth()))
        replica_url = f"http://127.0.0.1:{server.port}"
        view = FleetView(static_replicas={"r0": replica_url})
        keys = parse_api_keys({"tenants": {DEFAULT_TENANT: [API_KEY]}})
        state = RouterState(view=view, keys=keys, poll_interval_s=0.2)
        router = stack.enter_context(RouterThread(state))
        yield Served(replica_url, f"http://127.0.0.1:{router.port}", server, out)


def vllm_command() -> Path:
    """The `vllm` command of vLLM's environment (built from its lock on first use)."""
    python = subprocess.run([str(ROOT / "scripts" / "vllm-env.sh")], capture_output=True,
                            text=True, check=True, timeout=CLIENT_TIMEOUT_S).stdout.strip()
    return Path(python).parent / "vllm"


def vllm_bench(base_url: str, out_dir: Path, *args: str, headers: dict[str, str] | None = None
               ) -> dict[str, Any]:
    """Run `vllm bench serve` to the end; its result file, which must exist."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    cmd = [str(vllm_command()), "bench", "serve", "--backend", "openai",
           "--endpoint", "/v1/completions", "--base-url", base_url, "--save-result",
           "--save-detailed", "--result-dir", str(out_dir), "--result-filename", "result.json",
           "--disable-tqdm", "--num-warmups", "0", *args]
    for name, value in (headers or {}).items():
        cmd += ["--header", f"{name}={value}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=CLIENT_TIMEOUT_S, check=False)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"vllm bench serve exited {proc.returncode}:\n{log}"
    result = out_dir / "result.json"
    assert result.exists(), f"vllm bench serve wrote no result:\n{log}"
    data: dict[str, Any] = json.loads(result.read_text())
    data["_log"] = log
    return data


NUM_PROMPTS = 16
OUTPUT_LEN = 8


@pytest.mark.parametrize("target", ["replica", "router"])
def test_the_body_vllm_bench_sends_streams_with_usage_last(served: Served, target: str) -> None:
    """Without the client's start-up: its exact body (vLLM 0.33, `--ignore-eos --top-k --min-p
    --temperature`), and the stream's last chunk carries the usage with `choices: []`."""
    base = served.replica_url if target == "replica" else served.router_url
    body = {"model": "tiny", "prompt": "Hello world " * 8, "repetition_penalty": 1.0,
            "max_tokens": OUTPUT_LEN, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 20,
            "min_p": 0.05, "temperature": 0.8}
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        lines = [ln for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == OUTPUT_LEN


def _check_counts(result: dict[str, Any], before: dict[str, float], after: dict[str, float],
                  num_prompts: int, output_len: int) -> None:
    log = result["_log"]
    assert result["completed"] == num_prompts and result.get("failed", 0) == 0, log
    assert not any(result.get("errors") or []), result.get("errors")
    assert result["total_output_tokens"] == num_prompts * output_len, log  # ignore_eos
    assert result["total_output_tokens"] == after["generated"] - before["generated"]
    assert result["total_input_tokens"] == after["prompt"] - before["prompt"]


@pytest.mark.parametrize("target", ["replica", "router"])
def test_vllm_bench_serve_prefix_repetition(served: Served, target: str,
                                            tmp_path: Path) -> None:
    base = served.replica_url if target == "replica" else served.router_url
    before = served.counters()
    # No --model: the client takes the id and its tokenizer's folder (`root`) from /v1/models.
    result = vllm_bench(
        base, tmp_path, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "16",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len",
        str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4",
        "--ignore-eos", "--temperature", "0.8", "--top-k", "20", "--min-p", "0.05",
        "--repetition-penalty", "1.1", "--seed", "1",
        headers={"Authorization": f"Bearer {API_KEY}"})
    _check_counts(result, before, served.counters(), NUM_PROMPTS, OUTPUT_LEN)
    assert result["model_id"] == str(served.model_dir)  # the card's root: its tokenizer
    # The prefixes repeat: the replica served some prompt tokens from its cache.
    assert served.counters()["cached"] > before["cached"]


def test_vllm_bench_serve_random_through_the_router(served: Served, tmp_path: Path) -> None:
    before = served.counters()
    result = vllm_bench(
        served.router_url, tmp_path, "--model", "tiny", "--tokenizer", str(served.model_dir),
        "--dataset-name", "random", "--random-input-len", "40", "--random-output-len",
        str(OUTPUT_LEN), "--num-prompts", "8", "--max-concurrency", "8", "--ignore-eos")
    _check_counts(result, before, served.counters(), 8, OUTPUT_LEN)


def guidellm_command() -> Path:
    """The `guidellm` command of the load clients' environment (built from its lock)."""
    bin_dir = subprocess.run([str(ROOT / "scripts" / "clients-env.sh")], capture_output=True,
                             text=True, check=True, timeout=CLIENT_TIMEOUT_S).stdout.strip()
    return Path(bin_dir) / "guidellm"


@pytest.mark.parametrize("target", ["replica", "router"])
def test_guidellm_concurrent_synthetic(served: Served, target: str, tmp_path: Path) -> None:
    base = served.replica_url if target == "replica" else served.router_url
    before = served.counters()
    out = tmp_path / "benchmarks.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    backend = (f"kind=openai_http,target={base},model=tiny,request_format=/v1/completions,"
               f"api_key={API_KEY}")
    proc = subprocess.run(
        [str(guidellm_command()), "run", "--backend", backend,
         "--profile", "kind=concurrent,streams=4",
         "--constraint", f"kind=max_requests,count={NUM_PROMPTS}",
         "--data", f"kind=synthetic_text,prompt_tokens=64,output_tokens={OUTPUT_LEN}",
         "--tokenizer", f"kind=huggingface_auto,model={served.model_dir}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        capture_output=True, text=True, env=env, timeout=CLIENT_TIMEOUT_S, check=False)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"guidellm exited {proc.returncode}:\n{log}"
    assert out.exists(), f"guidellm wrote no result:\n{log}"
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": NUM_PROMPTS, "errored": 0, "incomplete": 0,
                      "total": NUM_PROMPTS}, log
    after = served.counters()
    done = bench["requests"]["successful"]
    assert sum(r["output_tokens"] for r in done) == NUM_PROMPTS * OUTPUT_LEN
    assert sum(r["output_tokens"] for r in done) == after["generated"] - before["generated"]
    assert sum(r["prompt_tokens"] for r in done) == after["prompt"] - before["prompt"]
    assert sum(r["cached_tokens"] or 0 for r in done) == after["cached"] - before["cached"]
