"""vLLM's own `BlockPool` as a replayed policy, when vllm can be found: in this interpreter, or in
the separate environment `vllm_pool.py` documents (`$KVFLEET_VLLM_PYTHON`, else
`$KVFLEET_HOME/vllm-venv/bin/python`, KVFLEET_HOME defaulting to ~/.cache/kvfleet). The replay
runs in a subprocess either way (vllm pins its own torch), once per workload for all capacities.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvfleet_lab.cache.sim import SimResult, TraceRequest
from kvfleet_lab.cache.vllm_pool import write_requests

__all__ = ["DRIVER", "simulate_vllm_pool", "vllm_python"]

DRIVER = Path(__file__).with_name("vllm_pool.py")


def vllm_python() -> str | None:
    """An interpreter that can import vllm, or None."""
    explicit = os.environ.get("KVFLEET_VLLM_PYTHON")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    home = Path(os.environ.get("KVFLEET_HOME", Path.home() / ".cache" / "kvfleet"))
    candidate = home / "vllm-venv" / "bin" / "python"
    return str(candidate) if candidate.is_file() else None


def simulate_vllm_pool(
    requests: Sequence[TraceRequest], capacities: Sequence[int], *, python: str
) -> dict[int, SimResult]:
    """Each capacity's hits through vLLM's BlockPool, one request at a time (`vllm_pool.replay`).

    Raises RuntimeError with vllm's own message when the replay fails (e.g. vllm does not import
    on this machine)."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-vllm-") as tmp:
        src, out = Path(tmp) / "requests.bin", Path(tmp) / "hits.json"
        write_requests(src, [r.blocks for r in requests])
        done = subprocess.run(
            [python, str(DRIVER), str(src), str(out), ",".join(str(c) for c in capacities)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"vLLM BlockPool replay failed with {python}: {tail[0]}")
        hits: dict[str, list[int]] = json.loads(out.read_text())
    results = {}
    for capacity in capacities:
        result = SimResult("vllm-pool", capacity)
        for request, hit in zip(requests, hits[str(capacity)], strict=True):
            result.record(request, hit)
        results[capacity] = result
    return results
