"""The request traces vendored with kvfleet (see README.md and LICENSE in this folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_TRACE",
    "DEFAULT_TRACE_NAME",
    "TRACES",
    "TRACES_DIR",
    "TRACE_NAME",
    "VendoredTrace",
    "resolve_trace",
    "trace_label",
]

TRACES_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class VendoredTrace:
    name: str
    """What `--trace` takes for it."""
    file: str
    label: str
    """How reports name it."""

    @property
    def path(self) -> Path:
        return TRACES_DIR / self.file


TRACES: dict[str, VendoredTrace] = {
    t.name: t
    for t in (
        VendoredTrace("synthetic", "mooncake_synthetic_trace.jsonl", "Mooncake synthetic trace"),
        # A real hour of production traffic beside the synthetic one (Poisson arrivals over public
        # datasets), so that no policy figure rests on one trace's shape alone.
        VendoredTrace(
            "conversation", "mooncake_conversation_trace.jsonl.gz", "Mooncake conversation trace"
        ),
    )
}
DEFAULT_TRACE_NAME = "synthetic"
# The default of every `--trace`, shipped in the package so that a fresh clone or an installed
# wheel runs every benchmark without anything beside it.
TRACE_NAME = TRACES[DEFAULT_TRACE_NAME].file
DEFAULT_TRACE = TRACES[DEFAULT_TRACE_NAME].path


def resolve_trace(name_or_path: str | Path) -> Path:
    """A vendored trace's file by its name, else `name_or_path` as a file (ValueError if none)."""
    vendored = TRACES.get(str(name_or_path))
    if vendored is not None:
        return vendored.path
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"trace not found: {str(name_or_path)!r} is neither a vendored trace "
            f"({', '.join(TRACES)}) nor a file"
        )
    return path


def trace_label(path: Path) -> str:
    """How a report names the trace at `path`: a vendored one by its label, any other by format."""
    for vendored in TRACES.values():
        if path.resolve() == vendored.path:
            return vendored.label
    return "Mooncake-format trace"
