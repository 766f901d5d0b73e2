"""One home for the wire: every constant processes agree on is defined in kvfleet_runtime.wire."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvfleet_runtime import wire
from kvfleet_runtime.cache import CacheKey

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [ROOT / "runtime" / "kvfleet_runtime", ROOT / "operator" / "kvfleet_operator"]
WIRE = ROOT / "runtime" / "kvfleet_runtime" / "wire.py"
CONSTANTS = ["BLOCK_SIZE", "PLATFORM_TENANT", "TENANT_HEADER", "LOAD_PATH", "T2_PATH", "HELD_PATH"]


def _product_sources() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted(folder.rglob("*.py")) if p != WIRE]


def _module_assignments(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _string_literals(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_the_sources_are_read() -> None:
    assert len(_product_sources()) > 50
    assert "BLOCK_SIZE" in _module_assignments(WIRE)


@pytest.mark.parametrize("name", CONSTANTS)
def test_each_wire_constant_is_defined_once(name: str) -> None:
    others = [
        str(p.relative_to(ROOT)) for p in _product_sources() if name in _module_assignments(p)
    ]
    assert others == [], f"{name} is defined outside kvfleet_runtime/wire.py: {others}"


@pytest.mark.parametrize("name", ["PLATFORM_TENANT", "TENANT_HEADER", "LOAD_PATH", "T2_PATH",
                                  "HELD_PATH", "BYTE_TOKENIZER_ID"])
def test_no_product_module_spells_a_wire_value(name: str) -> None:
    value = getattr(wire, name)
    spelled = [str(p.relative_to(ROOT)) for p in _product_sources() if value in _string_literals(p)]
    assert spelled == [], f"{value!r} is spelled outside the wire module: {spelled}"


def test_what_the_packages_re_export_is_the_wire_itself() -> None:
    from kvfleet_runtime import cache, tokenizer

    assert cache.BLOCK_SIZE is wire.BLOCK_SIZE and cache.PLATFORM_TENANT is wire.PLATFORM_TENANT
    assert tokenizer.BOS_ID == wire.BYTE_BOS_ID
    assert tokenizer.ByteTokenizer().encode("A") == [wire.BYTE_BOS_ID, ord("A")]


def test_a_load_report_survives_its_own_schema() -> None:
    report = wire.LoadReport(
        ready=True, kv_occupancy=0.5, kv_capacity_tokens=4096, num_waiting=2, num_running=3,
        queue_delay_s=0.1, cache_key=("m", "sha256:" + "a" * 64, "fp16", "rope-1", "sdpa-v1"),
        tokenizer=wire.BYTE_TOKENIZER_ID,
    )
    data = report.to_dict()
    assert data["cache_key"] == {
        "model_id": "m", "weights_digest": "sha256:" + "a" * 64, "kv_dtype": "fp16",
        "rope_config_hash": "rope-1", "attn_impl_id": "sdpa-v1",
    }
    assert wire.parse_load_report(data | {"name": "r0", "t2": {}}) == report
    assert report.cache_key is not None
    key = CacheKey("acme", *report.cache_key)
    assert key.tenant_id == "acme" and key.kv_dtype == "fp16"


@pytest.mark.parametrize("bad", [[], {"kv_occupancy": 2.0}, {"kv_occupancy": -0.1}])
def test_a_malformed_load_report_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"load report must be an object|kv_occupancy"):
        wire.parse_load_report(bad)
