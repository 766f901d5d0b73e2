"""The lab's wheel holds ../runtime/kvfleet_lab whole; its editable install holds no copy of it.

Hatch's `force-include` setting would do the first but copies the folder into the editable wheel
too, and a copy in site-packages shadows the checkout that dev-mode-dirs puts on sys.path (after
site-packages). A hook adds it to the regular wheel only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = "kvfleet_lab"


class LabPackage(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            source = Path(self.root).parent / "runtime" / PACKAGE
            build_data["force_include"][str(source)] = PACKAGE
