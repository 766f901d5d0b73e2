"""Start-up benchmark: a replica process from spawn to its first served token, next to
`transformers.AutoModelForCausalLM.from_pretrained` + `generate` of the same folder.

Both sides are fresh Python processes on the same machine and the same (page-cached) files, so
imports count on both sides. kvfleet's side is the real `kvfleet replica` process: it loads the
checkpoint (meta-device construction, one-pass read and digest), builds its cache and engine,
binds its port; the bench polls `/readyz` and sends one `/v1/completions` request of token ids
for one token. Transformers' side loads with `dtype="auto"` (the checkpoint's dtype) and runs
`generate(max_new_tokens=1)` on the same ids. Each process reports its own peak resident set
(`VmHWM` in /proc/<pid>/status, file-backed mmap pages included) just before it exits.

The replica's own KV pools are sized to a few blocks here: they are allocations the operator
chooses, not start-up cost, and would otherwise dominate the resident set of a small model.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvfleet_lab.processes import free_port
from kvfleet_runtime.wire import TENANT_HEADER

__all__ = ["BENCH_ARGS", "StartupReport", "run_startup_bench"]

BENCH_ARGS: dict[str, Any] = dict(
    dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=128, intermediate_size=5632,
    vocab_size=32000, max_seq_len=4096, dtype="bfloat16",
)
"""A Llama-shaped model of ~0.85B parameters: a ~1.7 GB bfloat16 checkpoint."""

PROMPT_IDS = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]

_HF_SCRIPT = r"""
import json, sys
import torch, transformers
torch.set_num_threads(int(sys.argv[2]))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="auto")
ids = torch.tensor([json.loads(sys.argv[3])])
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=1, do_sample=False)
token = int(out[0, -1])
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]
print(json.dumps({"token": token, "vmhwm_kib": int(hwm)}), flush=True)
"""


_IMPORTS = {
    # what each side's process imports before it touches the checkpoint
    "kvfleet": ("import kvfleet_runtime.cli, kvfleet_runtime.server, "
                "kvfleet_runtime.fleet.fleet_tier"),
    "transformers": "import torch, transformers; transformers.AutoModelForCausalLM",
}
_HWM = ("; print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))"
        ".split()[1])")


@dataclass(slots=True, frozen=True)
class StartupReport:
    checkpoint_bytes: int
    num_params: int
    dtype: str
    reps: int
    kvfleet_startup_s: float
    """Spawn of `kvfleet replica` to the first token of its first completion (median)."""
    kvfleet_peak_rss_bytes: int
    transformers_startup_s: float
    """Spawn to `from_pretrained` + `generate(max_new_tokens=1)` done (median)."""
    transformers_peak_rss_bytes: int
    same_first_token: bool
    kvfleet_import_rss_bytes: int
    """Peak RSS of a process that only imports what the replica imports (torch, aiohttp, ...)."""
    transformers_import_rss_bytes: int

    @property
    def startup_ratio(self) -> float:
        return self.kvfleet_startup_s / self.transformers_startup_s

    @property
    def rss_ratio(self) -> float:
        return self.kvfleet_peak_rss_bytes / self.transformers_peak_rss_bytes

    @property
    def rss_per_checkpoint(self) -> float:
        return self.kvfleet_peak_rss_bytes / self.checkpoint_bytes

    @property
    def loading_rss_per_checkpoint(self) -> float:
        """Peak RSS above the imports' own, per checkpoint byte: what loading costs."""
        return (self.kvfleet_peak_rss_bytes - self.kvfleet_import_rss_bytes) / self.checkpoint_bytes

    @property
    def transformers_loading_rss_per_checkpoint(self) -> float:
        return ((self.transformers_peak_rss_bytes - self.transformers_import_rss_bytes)
                / self.checkpoint_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "startup_ratio": self.startup_ratio,
                "rss_ratio": self.rss_ratio, "rss_per_checkpoint": self.rss_per_checkpoint,
                "loading_rss_per_checkpoint": self.loading_rss_per_checkpoint,
                "transformers_loading_rss_per_checkpoint":
                    self.transformers_loading_rss_per_checkpoint}


def _vmhwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _kvfleet_once(model_dir: Path, threads: int, timeout_s: float) -> tuple[float, int, int]:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")},
           "KVFLEET_REPLICA_CACHE__T0_ENABLED": "true",
           "KVFLEET_REPLICA_CACHE__NUM_T1_BLOCKS": "0",
           "KVFLEET_REPLICA_ENGINE__NUM_KV_BLOCKS": "16",
           "KVFLEET_REPLICA_CPU_THREADS": str(threads)}
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet_runtime.cli", "replica", "--model-dir", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--model-id", "bench",
         "--log-level",
         "WARNING"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = start + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"kvfleet replica exited with {proc.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"kvfleet replica not ready within {timeout_s} s")
            time.sleep(0.02)
        body = json.dumps({"model": "bench", "prompt": PROMPT_IDS, "max_tokens": 1,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json",
                                                  TENANT_HEADER: "bench"})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            answer = json.loads(r.read())
        elapsed = time.perf_counter() - start
        return elapsed, _vmhwm_bytes(proc.pid), int(answer["choices"][0]["token_ids"][0])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _transformers_once(model_dir: Path, threads: int, timeout_s: float) -> tuple[float, int, int]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT, str(model_dir), str(threads), json.dumps(PROMPT_IDS)],
        capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"transformers from_pretrained failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return elapsed, int(result["vmhwm_kib"]) * 1024, int(result["token"])


def _import_rss_bytes(side: str, timeout_s: float) -> int:
    done = subprocess.run([sys.executable, "-c", _IMPORTS[side] + _HWM], capture_output=True,
                          text=True, timeout=timeout_s, check=True)
    return int(done.stdout.split()[-1]) * 1024


def run_startup_bench(*, model_dir: Path | None = None, reps: int = 1, threads: int = 2,
                      timeout_s: float = 600.0, scale: float = 1.0) -> StartupReport:
    """Generate the checkpoint (unless `model_dir`), then time both sides `reps` times each,
    alternating; `scale` < 1 shrinks the generated model's layers (a quick run)."""
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint, inspect_checkpoint

    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-startup-") as tmp:
        if model_dir is None:
            args = ModelArgs(**BENCH_ARGS)
            args = replace(args, n_layers=max(1, round(args.n_layers * scale)))
            model_dir = Path(tmp) / "model"
            generate_checkpoint(model_dir, args, seed=0)
        report = inspect_checkpoint(model_dir, digest=False)
        if not report.supported:
            raise ValueError(f"{model_dir} is refused: {report.reason}")
        ours: list[tuple[float, int, int]] = []
        theirs: list[tuple[float, int, int]] = []
        for _ in range(reps):
            ours.append(_kvfleet_once(model_dir, threads, timeout_s))
            theirs.append(_transformers_once(model_dir, threads, timeout_s))
        return StartupReport(
            checkpoint_bytes=report.checkpoint_bytes, num_params=report.num_params,
            dtype=report.checkpoint_dtype, reps=reps,
            kvfleet_startup_s=statistics.median(r[0] for r in ours),
            kvfleet_peak_rss_bytes=int(statistics.median(r[1] for r in ours)),
            transformers_startup_s=statistics.median(r[0] for r in theirs),
            transformers_peak_rss_bytes=int(statistics.median(r[1] for r in theirs)),
            same_first_token=all(a[2] == b[2] for a, b in zip(ours, theirs, strict=True)),
            kvfleet_import_rss_bytes=_import_rss_bytes("kvfleet", timeout_s),
            transformers_import_rss_bytes=_import_rss_bytes("transformers", timeout_s),
        )
