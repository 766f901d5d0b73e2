"""The request traces vendored with kvfleet (see README.md and LICENSE in this folder)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_TRACE", "TRACES_DIR", "TRACE_NAME"]

TRACES_DIR = Path(__file__).resolve().parent
TRACE_NAME = "mooncake_synthetic_trace.jsonl"
# The default of every `--trace`: the Mooncake synthetic trace (Apache-2.0), shipped in the package
# so that a fresh clone or an installed wheel runs every benchmark without anything beside it.
DEFAULT_TRACE = TRACES_DIR / TRACE_NAME
