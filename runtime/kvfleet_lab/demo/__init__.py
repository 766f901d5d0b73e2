"""`kvfleet demo`: a cache-aware fleet on one machine, driven and measured.

    workload = builtin_workload("mixed", WorkloadSpec())        # or trace_workload(path, ...)
    report = run_demo(workload, DemoOptions(out=Path("out")), progress)

Layers: `_workload` (pure, seeded request lists; Mooncake trace parsing), `_fleet` (the real
`kvfleet replica` / `kvfleet router` processes, in process groups), `_driver` (the closed-loop
client), `_report` (pure arithmetic and text), `_plots` (PNGs), `_run` (the sequence).
Torch-free: the model runs in the replica processes.
"""

from kvfleet_lab.demo._driver import RequestResult, drive
from kvfleet_lab.demo._fleet import FleetError, FleetOptions, LocalFleet, ensure_model
from kvfleet_lab.demo._report import REFERENCE_PROFILE, build_report, percentile, render_report
from kvfleet_lab.demo._run import DemoOptions, DemoProgress, default_cache_dir, run_demo
from kvfleet_lab.demo._workload import (
    POPULATIONS,
    TENANT_NAMES,
    WORKLOADS,
    DemoRequest,
    TraceRecord,
    Workload,
    WorkloadSpec,
    builtin_workload,
    parse_trace,
    tenant_names,
    trace_workload,
)

__all__ = [
    "POPULATIONS",
    "REFERENCE_PROFILE",
    "TENANT_NAMES",
    "WORKLOADS",
    "DemoOptions",
    "DemoProgress",
    "DemoRequest",
    "FleetError",
    "FleetOptions",
    "LocalFleet",
    "RequestResult",
    "TraceRecord",
    "Workload",
    "WorkloadSpec",
    "build_report",
    "builtin_workload",
    "default_cache_dir",
    "drive",
    "ensure_model",
    "parse_trace",
    "percentile",
    "render_report",
    "run_demo",
    "tenant_names",
    "trace_workload",
]
