"""The operator's console script and its kopf module import one way: cli -> main (to register
the handlers), never main -> cli (the console script used to be `main.run`, which re-imported
cli, and cli read PEERING_NAME from main)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvfleet_operator

PACKAGE = Path(kvfleet_operator.__file__).parent


def _imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_main_never_imports_cli() -> None:
    assert not {n for n in _imports("main") if n.startswith("kvfleet_operator.cli")}


def test_the_console_script_is_cli() -> None:
    import tomllib

    project = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kvfleet-operator"] == "kvfleet_operator.cli:run"
    assert "kvfleet_operator.main" in _imports("cli")  # registers the handlers
