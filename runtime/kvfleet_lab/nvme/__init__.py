"""Measurements of the T3 (NVMe) store: `kvfleet bench nvme`."""

from kvfleet_lab.nvme.bench import NvmeBenchReport, run_nvme_bench

__all__ = ["NvmeBenchReport", "run_nvme_bench"]
