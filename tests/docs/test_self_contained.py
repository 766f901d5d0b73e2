"""The repository carries its own rationale: no file names a design document or notes that are
not in it (docs/design.md is where the rationale lives)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so this file does not match itself.
OUTSIDE = re.compile("|".join(["DESIGN" + r"\.md", "the " + r"seed\b", "seed" + " §",
                               "design" + " brief"]))


def test_no_file_cites_a_document_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".safetensors", ".gz", ".jsonl"):
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}:{i}: {line.strip()[:120]}" for i, line in
                 enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "cite docs/design.md instead:\n" + "\n".join(hits)
