"""scripts/gpu-check.sh without a GPU: its plan, its test selection, and that the selection
misses no CUDA-guarded test."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _cuda_guarded_tests() -> set[str]:
    """Test ids whose decorators skip without CUDA (`skipif(... cuda.is_available() ...)`)."""
    out = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                "cuda.is_available" in ast.unparse(d) for d in node.decorator_list
            ):
                out.add(f"{path.relative_to(ROOT)}::{node.name}")
    return out


def test_dry_run_plans_the_tests_and_the_cuda_bench_into_one_log(tmp_path: Path) -> None:
    log = tmp_path / "gpu.log"
    result = subprocess.run([str(SCRIPT), "--dry-run", "--log", str(log), "--bench-args",
                             "--reps 2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    text = log.read_text()
    assert "tests: pytest -m gpu -v -p no:cacheprovider --timeout 300 tests" in text
    assert "bench: timeout 420 kvfleet bench replica --device cuda --reps 2" in text
    selected = {line.split("[")[0] for line in text.splitlines() if "::" in line}
    guarded = _cuda_guarded_tests()
    assert "tests/runtime/engine/test_engine.py::test_hit_equals_miss_on_cuda_with_a_pinned_t1" \
        in guarded
    # every CUDA-guarded test carries the gpu marker, so the script runs it
    assert guarded <= selected, guarded - selected


def test_unknown_argument_is_refused() -> None:
    result = subprocess.run([str(SCRIPT), "--fast"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "gpu-check: unknown argument --fast" in result.stderr
