"""`kvfleet demo` bad input: exit 2, one line on stderr, no traceback, nothing started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_lab.cli import kvfleet_app

app = kvfleet_app()


@pytest.fixture
def bad_trace(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": ["a"]}) + "\n")
    return path


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workload", "chat"],
         "error: unknown workload 'chat'; choose one of: mixed, system-prompts, rag, "
         "conversations"),
        (["--requests", "0"], "error: --requests must be >= 1, got 0"),
        (["--scale", "2"], "error: --scale must be in (0, 1], got 2.0"),
        (["--concurrency", "0"], "error: --concurrency must be in [1, 64], got 0"),
        (["--tenants", "0"], "error: --tenants must be in [1, 1000], got 0"),
        (["--kv-blocks", "8"], "error: --kv-blocks must be in [64, 65536], got 8"),
        (["--kv-blocks", "64", "--scale", "1"], "cannot hold the workload's longest prompt"),
        (["--redis-url", "localhost:6379"], "error: --redis-url must start with redis://"),
        (["--trace", "/nonexistent/trace.jsonl"], "error: trace not found"),
        (["--trace-block-tokens", "40", "--trace", "TRACE"], "multiple of 16, got 40"),
        (["--trace", "TRACE"], "line 2: field 'hash_ids' must be a non-empty list"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], expected: str, bad_trace: Path, tmp_path: Path
) -> None:
    args = [str(bad_trace) if a == "TRACE" else a for a in args]
    result = CliRunner().invoke(app, ["demo", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_made_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(tmp_path / "file" / "out")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'file' / 'out'}: cannot create the folder: Not a directory"
    ]


def test_the_demo_ends_with_next_steps_and_how_to_reach_the_commands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvfleet_lab.cli.demo import next_steps

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as after `make demo`: the venv is not on it
    path_line, steps = next_steps()
    bin_dir = Path(sys.executable).parent
    assert path_line.endswith(f'export PATH="{bin_dir}:$PATH"')
    assert (bin_dir / "kvfleet").exists() and (bin_dir / "kvfleet-operator").exists()
    assert steps.startswith("next ") and "make demo-cluster" in steps
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert [line[:5] for line in next_steps()] == ["next "]
