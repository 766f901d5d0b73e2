"""`kvfleet breakeven` as a user runs it: a real process, its output and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet_runtime.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def test_reference_case_prints_the_design_figures() -> None:
    result = kvfleet("breakeven")
    assert result.returncode == 0, result.stderr
    for figure in (
        "327,680 B = 320 KiB",
        "625 MiB",
        "70.7 ms",
        "9.26 GB/s",
        "141.5 us",
        "70.7 us",
        "35.4 us",
        "17.7 us",
        "2.32 GB/s",
        "4.63 GB/s",
        "18.53 GB/s",
        "360x",
        "6.9x",
        "2.7x",
        "0.76x",
        "0.11x",
        "batch only",
        "never",
    ):
        assert figure in result.stdout, figure


def test_json_output_is_machine_readable() -> None:
    result = kvfleet("breakeven", "--json", "--kv-dtype", "fp8")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kv_bytes_per_token"] == 163_840
    assert round(data["break_even_bytes_per_s"] / 1e9, 2) == 4.63
    assert {t["medium"]: t["verdict"] for t in data["tiers"]}["nvme-gen4"] == "build"


def test_measured_bandwidth_overrides_the_profile() -> None:
    result = kvfleet("breakeven", "--json", "--bandwidth", "nvme-gen4=12")
    nvme = {t["medium"]: t for t in json.loads(result.stdout)["tiers"]}["nvme-gen4"]
    assert nvme["bandwidth_bytes_per_s"] == 12e9 and nvme["verdict"] == "build"


def test_hf_config_path(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
            }
        )
    )
    result = kvfleet("breakeven", "--model-config", str(config), "--tp", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 131_072


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'; choose one of: reference-70b, llama-3-8b"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'; choose one of: h100, h200, a100, b200"),
        (["--kv-dtype", "int3"], "unknown KV dtype 'int3'; choose one of: fp32, bf16, fp16, fp8"),
        (["--media", "hbm,floppy"], "unknown medium 'floppy'"),
        (["--tp", "3"], "TP degree 3 does not divide the 8 KV heads"),
        (["--tp", "0"], "TP degree must be a positive integer"),
        (["--prefix-tokens", "-5"], "prefix length must be a positive number"),
        (["--gpu-tflops", "nan"], "--gpu-tflops must be a positive finite number"),
        (["--gpu-tflops", "-1"], "--gpu-tflops must be a positive finite number"),
        (["--params", "0"], "--params must be a positive finite number"),
        (["--bandwidth", "nvme-gen4"], "--bandwidth expects MEDIUM=GB/s"),
        (["--bandwidth", "nvme-gen4=fast"], "is not a number of GB/s"),
        (["--bandwidth", "rdma-400g=50"], "not among the media planned"),
        (["--model-config", "/nonexistent/config.json"], "cannot read model config"),
    ],
)
def test_bad_input_is_one_line_exit_2_no_traceback(args: list[str], message: str) -> None:
    result = kvfleet("breakeven", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_malformed_config_json_is_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("{oops")
    result = kvfleet("breakeven", "--model-config", str(config))
    assert result.returncode == 2 and "is not valid JSON" in result.stderr
