"""The design's fleet figures (docs/design.md §1), exactly, from the break-even profiles."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_lab.simulate import FleetFigures, GiB, TiB, fleet_figures, fleet_profile
from kvfleet_runtime.breakeven import KVDtype

REF = fleet_profile()


def figures(**overrides: float) -> FleetFigures:
    args: dict[str, Any] = {
        "num_tenants": 2000,
        "templates_per_tenant": 5,
        "prefix_tokens": 1500,
        "num_replicas": 44,
        "k": 3,
        "cache_bytes": 500 * GiB,
        "rps": 83.0,
        "hit_rate": 0.6,
    }
    args.update(overrides)
    return fleet_figures(REF, **args)


def test_profile_comes_from_the_breakeven_planner() -> None:
    assert REF.kv_bytes_per_token == 327_680
    assert REF.recompute_s_per_token * 1e6 == pytest.approx(35.37, abs=0.01)
    assert REF.dram_bytes_per_s == 64e9 and REF.nvme_bytes_per_s == 7e9
    assert round(REF.break_even_bytes_per_s / 1e9, 2) == 9.26
    assert round(REF.prefill_tokens_per_s) == 28_271  # the design's "28,000 tok/s each"


def test_working_set_is_4_47_tib_and_one_host_covers_11_percent() -> None:
    f = figures()
    assert f.working_set_bytes == 2000 * 5 * 1500 * 327_680
    assert round(f.working_set_bytes / TiB, 2) == 4.47
    assert round(f.host_coverage, 3) == 0.109


def test_affinity_slice_is_136_tenants_and_312_gib_which_fits() -> None:
    f = figures()
    assert round(f.tenants_per_replica, 1) == 136.4
    assert round(f.home_slice_bytes / GiB) == 312
    assert f.home_slice_fits


def test_sixty_percent_hits_save_74700_tokens_per_s_or_2_6_replicas() -> None:
    f = figures()
    assert f.saved_tokens_per_s == pytest.approx(74_700)
    # 74,700 / 28,271 = 2.64 (the design divides by the rounded 28,000: 2.67, "~2.7")
    assert f.replicas_saved == pytest.approx(2.64, abs=0.005)


def test_fp8_halves_the_working_set() -> None:
    fp8 = fleet_profile(kv_dtype=KVDtype.FP8)
    assert fp8.kv_bytes_per_token * 2 == REF.kv_bytes_per_token
    assert round(fp8.break_even_bytes_per_s / 1e9, 2) == 4.63
