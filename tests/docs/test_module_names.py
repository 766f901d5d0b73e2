"""The docs name today's modules: every module, file or folder of kvfleet's packages that a doc (or
a package's own docstring) names exists in the tree, so a rename that leaves a doc behind fails
here rather than misleading its next reader.

What counts as naming a module:

- a path into a package, `kvfleet_runtime/fleet/t2_source.py` or `kvfleet_vllm/` (with or without
  `runtime/` in front), and a dotted name, `kvfleet_runtime.fleet.peer_tier.PeerTier`: each step
  is a subpackage, a module, or (after a package) a name its `__init__` exports;
- a Python file's name, `fleet/t2_protocol.py`, `_block_index.py` or `test_probe.py` (quoted,
  in prose or in a tree of a code block): some tracked file's path ends with it;
- a quoted `module.Name` (`picker.Tenancy`, `_options.ConnectorOptions`), or `package._module`:
  the dotted path ends some module of the tree (or is an importable library) and defines Name;
- a quoted private name, `_admission` or `_flat`: a module of that name or a name some source
  defines;
- a file or folder of the repository by its path, `tests/picker/test_kv_events.py` or
  `tests/runtime/affinity/`, quoted or not: it is there.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kvfleet_runtime": ROOT / "runtime" / "kvfleet_runtime",
    "kvfleet_lab": ROOT / "runtime" / "kvfleet_lab",
    "kvfleet_vllm": ROOT / "runtime" / "kvfleet_vllm",
    "kvfleet_operator": ROOT / "operator" / "kvfleet_operator",
}
_PKG = "|".join(PACKAGES)
PATH_RE = re.compile(rf"\b({_PKG})((?:/[\w.-]*\w)*)/?")
DOTTED_RE = re.compile(rf"\b({_PKG})((?:\.\w+)*)")
QUOTED_RE = re.compile(r"`([^`\s]+)`")
FILE_RE = re.compile(r"^[\w./-]*\w\.py$")
FILE_NAME_RE = re.compile(r"(?<![\w/.-])(\w[\w/-]*\.py)\b")
MODULE_NAME_RE = re.compile(r"^((?:[a-z_][a-z0-9_]*\.)+)([A-Z][A-Za-z0-9_]+)")
PRIVATE_MODULE_RE = re.compile(r"^((?:[a-z][a-z0-9_]*\.)+_[a-z][a-z0-9_]*)$")
PRIVATE_NAME_RE = re.compile(r"^_[a-z][a-z0-9_]*$")
REPO_PATH_RE = re.compile(
    r"(?<![\w/.-])((?:tests|runtime|operator|scripts|charts|docker|crds|docs|examples)"
    r"/[\w/.-]*(?:\.[a-z]+\b|/(?![\w-])))")
TABLE_ROW_RE = re.compile(r"^ *(_[a-z][a-z0-9_]*) +\S", re.MULTILINE)
# Named in the docs as the anchors' own modules; not installed in kvfleet's environment.
OTHER_PROJECTS = ("vllm", "sglang", "lmcache")
# Private names of other projects that the docs quote.
THEIRS = {
    "_write_ready": "asyncio's selector transport (a profile of the T2 server)",
    "_release_step": "vLLM 0.33's scheduler (the connector bench reads it with getattr)",
}


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.split()


@cache
def _files() -> tuple[str, ...]:
    return tuple(n for n in _tracked() if (ROOT / n).is_file())


@cache
def _modules() -> dict[str, Path]:
    """Every module of the four packages by dotted name (packages by their `__init__.py`)."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


@cache
def _defined(path: Path) -> frozenset[str]:
    """The names a module binds or uses at any depth: classes, functions, variables, arguments,
    attributes, imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Name | ast.arg):
            names.add(node.id if isinstance(node, ast.Name) else node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return frozenset(names)


@cache
def _all_defined() -> frozenset[str]:
    names: set[str] = set()
    for name in _files():
        if name.endswith(".py"):
            names |= _defined(ROOT / name)
    return frozenset(names)


def _defines(path: Path, name: str) -> bool:
    if name.endswith("_"):  # `MAX_CONFIG_*`: a family of names
        return any(n.startswith(name) for n in _defined(path))
    return name in _defined(path)


def _path_exists(package: str, rest: str) -> bool:
    target = PACKAGES[package] / rest.strip("/")
    return target.exists() or target.with_name(target.name + ".py").is_file()


def _dotted_exists(package: str, rest: str) -> bool:
    module, parts = package, [p for p in rest.split(".") if p]
    for part in parts:
        if f"{module}.{part}" in _modules():
            module = f"{module}.{part}"
            if _modules()[module].name != "__init__.py":
                return True  # a module: what follows is its own attributes
            continue
        return part in _defined(_modules()[module])
    return True


def _module_by_suffix(dotted: str) -> list[Path]:
    return [p for name, p in _modules().items() if name == dotted or name.endswith("." + dotted)]


def _library(head: str) -> bool:
    if head in OTHER_PROJECTS:
        return True
    try:
        return importlib.util.find_spec(head) is not None
    except (ImportError, ValueError):
        return False


def _stale_names(text: str, scope: tuple[Path, ...] = ()) -> list[str]:
    """What `text` names that is not in the tree; `scope`, when given, is where a bare private
    name (`_cache`) must be: the modules of the package whose docstring `text` is."""
    stale: list[str] = []
    if scope:  # a package's table of its modules: `    _body     JSON request bodies ...`
        stale += [m.group(1) for m in TABLE_ROW_RE.finditer(text)
                  if not any(p.stem == m.group(1) for p in scope)]
    for m in REPO_PATH_RE.finditer(text):
        path = m.group(1)
        if not ((path.endswith("/") and (ROOT / path).is_dir()) or path in _files()):
            stale.append(path)
    for m in FILE_NAME_RE.finditer(text):
        name = m.group(1)
        if name.split("/")[0] in OTHER_PROJECTS:
            continue
        if not any(n == name or n.endswith("/" + name) for n in _files()):
            stale.append(name)
    for m in PATH_RE.finditer(text):
        if m.group(2) and not _path_exists(m.group(1), m.group(2)):
            stale.append(m.group(0))
    for m in DOTTED_RE.finditer(text):
        if not _dotted_exists(m.group(1), m.group(2)):
            stale.append(m.group(0))
    for m in QUOTED_RE.finditer(text):
        token = m.group(1).rstrip(".,:;)*")
        if token.startswith(tuple(PACKAGES)) or "://" in token:
            continue  # the two rules above
        if FILE_RE.match(token):
            continue  # the file rule below
        if named := MODULE_NAME_RE.match(token):
            module, name = named.group(1).rstrip("."), named.group(2)
            homes = _module_by_suffix(module)
            if not homes and _library(module.split(".")[0]):
                continue
            if not any(_defines(p, name) for p in homes):
                stale.append(token)
        elif PRIVATE_MODULE_RE.match(token):
            head, name = token.rsplit(".", 1)
            packages = [p for p in _module_by_suffix(head) if p.name == "__init__.py"]
            if _module_by_suffix(token):
                continue
            if packages:  # `cache._keys`: a module of that package, or a name it defines
                if not any(name in _defined(m) for pkg in packages
                           for m in pkg.parent.rglob("*.py")):
                    stale.append(token)
            elif name not in _all_defined():
                stale.append(token)
        elif PRIVATE_NAME_RE.match(token) and token not in THEIRS:
            if scope:
                if not any(p.stem == token or token in _defined(p) for p in scope):
                    stale.append(token)
            elif not _module_by_suffix(token) and token not in _all_defined():
                stale.append(token)
    return stale


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "charts" / "kvfleet" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def _package_docstrings() -> list[Path]:
    return sorted(p for p in _modules().values() if p.name == "__init__.py")


@pytest.mark.parametrize("doc", [*_docs(), *_package_docstrings()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_modules_that_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    scope: tuple[Path, ...] = ()
    if doc.suffix == ".py":
        text = ast.get_docstring(ast.parse(text)) or ""
        scope = tuple(doc.parent.rglob("*.py"))
    stale = sorted(set(_stale_names(text, scope)))
    assert stale == [], f"{doc.relative_to(ROOT)} names what is not in the tree: {stale}"


@pytest.mark.parametrize("old", [
    "`kvfleet_runtime.fleet.wiring`", "kvfleet_runtime/fleet/replica.py", "`cache/_index.py`",
    "`transfer.DEFAULT_PEER_BODY_BYTES`", "`cache._policy`", "`_ranking`",
    "kvfleet_runtime.affinity.tenants", "`_plan.ConnectorIndex`",
    "tests/router/test_kv_subscriber.py", "tests/runtime/tiers/", "cli/replica.py",
])
def test_a_removed_module_is_caught(old: str) -> None:
    assert set(_stale_names(old)) == {old.strip("`")}


@pytest.mark.parametrize("today", [
    "`kvfleet_runtime.fleet.fleet_tier`", "runtime/kvfleet_runtime/fleet/t2_source.py",
    "`_block_index.py`", "`fleet.t2_protocol.WireOrder`", "`asyncio.BufferedProtocol`",
    "kvfleet_runtime.affinity.choose_replica", "`_connector_index.ConnectorIndex`", "`_flat`",
    "tests/picker/test_kv_subscriber.py (a real ZMQ PUB)", "tests/runtime/affinity/.",
])
def test_a_module_of_today_passes(today: str) -> None:
    assert _stale_names(today) == []
