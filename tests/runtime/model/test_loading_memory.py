"""Loading like a serving engine: a fresh process loads a ~200 MB bf16 checkpoint and its resident
set grows by about one checkpoint, not two (no random init, no float32 copy, no mmap + copy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet_runtime.model import ModelArgs, generate_checkpoint

_CHILD = r"""
import json, sys
import torch
from kvfleet_runtime.model import load_checkpoint

def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

before = status("VmRSS:")
loaded = load_checkpoint(sys.argv[1], device=torch.device("cpu"))
print(json.dumps({"before": before, "peak": status("VmHWM:"), "dtype": loaded.args.dtype,
                  "digest": loaded.weights_digest}))
"""


@pytest.mark.slow
def test_peak_rss_of_loading_is_about_one_checkpoint(tmp_path: Path) -> None:
    args = ModelArgs(dim=1024, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=128,
                     intermediate_size=2816, vocab_size=16384, max_seq_len=1024,
                     dtype="bfloat16")
    digest = generate_checkpoint(tmp_path, args)
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size > 200e6
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=True)
    out = json.loads(done.stdout)
    assert (out["dtype"], out["digest"]) == ("bfloat16", digest)
    grown = out["peak"] - out["before"]
    assert size * 0.9 <= grown <= size * 1.15, (grown, size)
