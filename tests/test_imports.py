"""The import contract, read from the source (every `import`, at module level or inside a function).

Dependencies point one way: the lab imports the product, the operator imports only the runtime's
pure core, nothing in the product imports or names the lab (its CLI included: the lab's commands
join `kvfleet` through an entry point), and the router, the operator and the pure cache core never
load torch. No import circle in the product, even one closed only by a
lazy or a type-only import.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvfleet_runtime": ROOT / "runtime" / "kvfleet_runtime",
    "kvfleet_lab": ROOT / "runtime" / "kvfleet_lab",
    "kvfleet_operator": ROOT / "operator" / "kvfleet_operator",
    # The vLLM connector: a second facade over the cache manager (as PrefixCache is), run inside
    # vLLM's own environment; nothing else may depend on it.
    "kvfleet_vllm": ROOT / "runtime" / "kvfleet_vllm",
}
PURE_CACHE_CORE = [
    "kvfleet_runtime.cache._keys",
    "kvfleet_runtime.cache._block_index",
    "kvfleet_runtime.cache._tier_slots",
    "kvfleet_runtime.cache._index_audit",
    "kvfleet_runtime.cache._tier_drains",
    "kvfleet_runtime.cache._moves",
    "kvfleet_runtime.cache._eviction",
    "kvfleet_runtime.cache._sketch",
    "kvfleet_runtime.cache._ghosts",
    "kvfleet_runtime.cache._admission",
    "kvfleet_runtime.cache._store_queue",
    "kvfleet_runtime.cache._stats",
    "kvfleet_runtime.cache._manager",
    "kvfleet_runtime.cache._metrics",
    "kvfleet_runtime.cache._allocator",
    "kvfleet_runtime.cache._config",
    "kvfleet_runtime.cache._lower",
]


def _module_name(package: str, path: Path) -> str:
    parts = path.relative_to(PACKAGES[package]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


@cache
def _sources() -> dict[str, Path]:
    return {
        _module_name(package, path): path
        for package, folder in PACKAGES.items()
        for path in sorted(folder.rglob("*.py"))
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def _imports(module: str, top_level_only: bool, type_checking: bool = False) -> frozenset[str]:
    """Modules `module` imports (absolute names; `from a import b` counts a and a.b when a.b is a
    module). Imports under `if TYPE_CHECKING:` never run and are left out, unless `type_checking`
    (a circle through them still ties the modules into one)."""
    return _imports_of(_sources()[module], module, top_level_only, type_checking)


def _imports_of(path: Path, module: str, top_level_only: bool,
                type_checking: bool) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for other in child.orelse:
                    visit_one(other, nested)
                continue
            visit_one(child, nested)

    def visit_one(child: ast.AST, nested: bool) -> None:
        if isinstance(child, ast.Import):
            if not (nested and top_level_only):
                found.update(alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            if not (nested and top_level_only):
                base = child.module or ""
                if child.level:
                    anchor = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
        else:
            inner = nested or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            visit(child, inner)

    visit(tree, nested=False)
    return frozenset(found)


def _ours(name: str) -> str | None:
    """The module of ours that importing `name` loads (a name imported from a module is that
    module), None for third-party and stdlib names."""
    sources = _sources()
    while name:
        if name in sources:
            return name
        name = name.rpartition(".")[0]
    return None


def _import_graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports: at module level, inside functions (lazily)
    and under TYPE_CHECKING alike. `from pkg import name` is an edge to `pkg.name` when that is a
    module, else to `pkg` (its __init__ runs). A module's parent packages are not edges of their
    own: Python has begun running them before the module itself."""

    def ours(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        targets = {ours(name) for name in _imports_of(path, module, False, True)}
        parents = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        graph[module] = {t for t in targets if t is not None and t != module} - parents
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _closure(start: str, top_level_only: bool) -> set[str]:
    """Every name `start` imports, directly or through our modules (their packages' __init__
    included, as Python runs them)."""
    seen: set[str] = set()
    names: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i])]
        for name in _imports(module, top_level_only):
            names.add(name)
            ours = _ours(name)
            if ours is not None:
                todo.append(ours)
    return names | seen


def _product_modules() -> list[str]:
    return [
        m for m in _sources()
        if m.split(".")[0] in {"kvfleet_runtime", "kvfleet_operator", "kvfleet_vllm"}
    ]


def test_the_sources_parse_into_modules() -> None:
    # Guards the contract itself: an empty source map would make every rule below pass.
    sources = _sources()
    assert "kvfleet_runtime.router._app" in sources
    assert "kvfleet_lab.cache.sim" in sources
    assert "kvfleet_operator.handlers" in sources
    assert "kvfleet_vllm.connector" in sources
    assert "kvfleet_runtime.cache.sim" not in sources  # the replays live in the lab


def test_the_contract_sees_nested_imports() -> None:
    cli = _imports("kvfleet_lab.cli.bench_policies", top_level_only=False)
    assert "kvfleet_lab.cache.compare" in cli  # imported inside the command function
    assert "kvfleet_lab.cache.compare" not in _imports(
        "kvfleet_lab.cli.bench_policies", top_level_only=True
    )


def _names_the_lab(path: Path) -> list[str]:
    """Each line of `path` that spells the lab's package: an import at any depth, and the
    strings an import could be made of (`importlib.import_module`, `-m`, an entry point)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [f"{path.name}:{n} {line.strip()}" for n, line in enumerate(lines, 1)
            if "kvfleet_lab" in line]


def test_the_cli_is_read_by_the_lab_rules() -> None:
    # The rules below cover every product module: the CLI's among them, none exempt.
    assert "kvfleet_runtime.cli" in _product_modules()
    assert "kvfleet_runtime.cli.router" in _product_modules()


@pytest.mark.parametrize("module", _product_modules())
def test_product_never_imports_the_lab(module: str) -> None:
    lab = sorted(n for n in _imports(module, top_level_only=False) if n.startswith("kvfleet_lab"))
    assert lab == [], f"{module} imports the lab: {lab}"


@pytest.mark.parametrize("module", _product_modules())
def test_product_never_names_the_lab(module: str) -> None:
    # Nor by a string: the lab's commands reach `kvfleet` through the `kvfleet.commands` entry
    # points its own distribution declares, so no product source has a reason to spell it.
    assert _names_the_lab(_sources()[module]) == []


def test_the_naming_rule_would_catch_a_lazy_or_dynamic_import(tmp_path: Path) -> None:
    source = tmp_path / "sneaky.py"
    source.write_text(
        "import importlib\n\n"
        "def run():\n"
        "    from kvfleet_lab.demo import percentile\n"
        "    return importlib.import_module('kvfleet_lab.simulate'), percentile\n"
    )
    assert _names_the_lab(source) == [
        "sneaky.py:4 from kvfleet_lab.demo import percentile",
        "sneaky.py:5 return importlib.import_module('kvfleet_lab.simulate'), percentile",
    ]
    assert "kvfleet_lab.demo" in _imports_of(source, "sneaky", False, False)


def test_the_lab_commands_import_the_lab_only_when_they_run() -> None:
    # Where the lab is installed, every `kvfleet` start (`kvfleet replica`, `kvfleet router`)
    # loads its commands' package through the entry point: the rooms they run stay out of it.
    closure = _closure("kvfleet_lab.cli", top_level_only=True)
    assert "kvfleet_lab.cli.bench_policies" in closure  # the walk reads the commands' modules
    rooms = sorted(
        n for n in closure
        if (_ours(n) or "").startswith("kvfleet_lab.")
        and not (_ours(n) or "").startswith("kvfleet_lab.cli")
    )
    assert rooms == [], f"importing kvfleet_lab.cli loads {rooms}"


@pytest.mark.parametrize(
    "module", [m for m in _sources() if m.startswith("kvfleet_runtime")]
)
def test_runtime_never_imports_the_operator(module: str) -> None:
    names = sorted(
        n for n in _imports(module, top_level_only=False) if n.startswith("kvfleet_operator")
    )
    assert names == [], f"{module} imports the operator: {names}"


def test_operator_imports_only_the_runtimes_pure_core() -> None:
    allowed = ("kvfleet_runtime.breakeven", "kvfleet_runtime.config.fleet", "kvfleet_runtime.units",
               "kvfleet_runtime.affinity", "kvfleet_runtime.wire", "kvfleet_runtime.auth")
    used = {
        n
        for m in _sources()
        if m.startswith("kvfleet_operator")
        for n in _imports(m, top_level_only=False)
        if n.startswith("kvfleet_runtime")
    }
    assert used, "the operator imports nothing of the runtime: the contract reads nothing"
    assert sorted(n for n in used if not n.startswith(allowed)) == []


# kvfleet_lab.vllm measures the connector (`kvfleet bench vllm-connector`) and runs only in
# vLLM's environment; it imports the connector and vllm inside functions, never at import time.
CONNECTOR_BENCH = "kvfleet_lab.vllm"


@pytest.mark.parametrize(
    "module",
    [m for m in _sources() if not m.startswith(("kvfleet_vllm", CONNECTOR_BENCH))],
)
def test_nothing_depends_on_the_vllm_connector(module: str) -> None:
    # vllm pins its own torch: the connector lives in vLLM's environment, and the replica, the
    # router, the operator and the lab must import and run without it.
    names = sorted(
        n for n in _imports(module, top_level_only=False) if n.startswith("kvfleet_vllm")
    )
    assert names == [], f"{module} imports the vLLM connector: {names}"


def test_only_the_connector_module_imports_vllm() -> None:
    users = sorted(
        m for m in _sources()
        if any(n.split(".")[0] == "vllm" for n in _imports(m, top_level_only=False))
    )
    # (the lab's BlockPool replay and the cache bench are the others: they run vLLM's own block
    # pool and KVCacheManager as the baselines, the bench only where vllm imports)
    assert users == ["kvfleet_lab.cache.bench", "kvfleet_lab.cache.vllm_pool",
                     "kvfleet_lab.vllm.bench", "kvfleet_vllm.connector"]


def test_the_connector_bench_imports_vllm_only_when_it_runs() -> None:
    module = f"{CONNECTOR_BENCH}.bench"
    top = sorted(n for n in _imports(module, top_level_only=True)
                 if n.split(".")[0] in ("vllm", "kvfleet_vllm", "torch"))
    assert top == []


def test_no_router_fleet_cycle() -> None:
    # The router and the picker may use the fleet tier's hint index; the fleet tier never
    # reaches either.
    fleet = [m for m in _sources() if m.startswith("kvfleet_runtime.fleet")]
    for module in fleet:
        reached = sorted(
            n for n in _closure(module, top_level_only=False)
            if n.startswith(("kvfleet_runtime.router", "kvfleet_runtime.picker"))
        )
        assert reached == [], f"{module} reaches the router: {reached}"


@pytest.mark.parametrize(
    "module",
    [
        *PURE_CACHE_CORE,
        "kvfleet_runtime.cache",
        "kvfleet_runtime.router",
        "kvfleet_runtime.picker",
        "kvfleet_runtime.affinity",
        "kvfleet_runtime.breakeven",
        "kvfleet_runtime.config.fleet",
        "kvfleet_operator",
        "kvfleet_operator.main",
        "kvfleet_operator.cli",
        "kvfleet_runtime.cli",
        "kvfleet_lab.cli",  # loaded by every `kvfleet` start where the lab is installed
    ],
)
def test_no_torch_on_import(module: str) -> None:
    heavy = sorted(
        n for n in _closure(module, top_level_only=True) if n.split(".")[0] in {"torch"}
    )
    assert heavy == [], f"importing {module} loads {heavy}"


@pytest.mark.parametrize("module", [*PURE_CACHE_CORE, "kvfleet_runtime.affinity"])
def test_pure_core_never_imports_torch_even_lazily(module: str) -> None:
    heavy = sorted(
        n for n in _closure(module, top_level_only=False) if n.split(".")[0] in {"torch"}
    )
    assert heavy == [], f"{module} imports {heavy}"


def test_the_torch_rule_would_catch_torch() -> None:
    assert any(
        n.split(".")[0] == "torch" for n in _closure("kvfleet_runtime.engine", top_level_only=True)
    )


# The cache core's micro-benchmark times the layers themselves (pool moves, commits, runs): the
# one module allowed below the cache's public surface.
_CACHE_INTERNALS_ALLOWED = {"kvfleet_lab.cache.bench"}


@pytest.mark.parametrize(
    "module",
    [
        m for m in _sources()
        if (m.startswith(("kvfleet_lab", "kvfleet_runtime.fleet", "kvfleet_runtime.router",
                          "kvfleet_runtime.picker")))
        and m not in _CACHE_INTERNALS_ALLOWED
    ],
)
def test_replays_and_the_fleet_tier_stay_above_the_cache_manager(module: str) -> None:
    below = sorted(
        n for n in _imports(module, top_level_only=False)
        if n.startswith((
            "kvfleet_runtime.cache._manager",
            "kvfleet_runtime.cache._block_index",
            "kvfleet_runtime.cache._tier_slots",
            "kvfleet_runtime.cache._tier_drains",
        ))
        or n.endswith(".StorePlan")
    )
    assert below == [], f"{module} reaches into the cache manager: {below}"


@pytest.mark.parametrize("module", [m for m in _sources() if m.startswith("kvfleet_vllm")])
def test_the_vllm_connector_uses_only_public_runtime_names(module: str) -> None:
    # The connector is a second facade over the cache manager: it codes against the names the
    # runtime's packages export (`kvfleet_runtime.cache.__all__`, `kvfleet_runtime.fleet`), so
    # the runtime may reorganise its private modules without breaking vLLM replicas.
    private = sorted(
        n for n in _imports(module, top_level_only=False)
        if n.startswith("kvfleet_runtime.")
        and any(part.startswith("_") for part in n.split(".")[1:])
    )
    assert private == [], f"{module} imports private runtime names: {private}"


# The cache package's public surface: what the facades' users and the vLLM connector use. The
# index, the sketch, admission, the pools and the store queue are the package's own.
CACHE_EXPORTS = [
    "BLOCK_SIZE",
    "PLATFORM_TENANT",
    "BlockEvent",
    "BlockHash",
    "BlockNode",
    "BlockRefs",
    "CacheTuning",
    "CacheKey",
    "CacheManager",
    "CacheStats",
    "Commit",
    "EvictedRun",
    "Hit",
    "KVLayout",
    "LoadTarget",
    "LowerTier",
    "Miss",
    "PagedBlocks",
    "Prefix",
    "PrefixCache",
    "StoreOutcome",
    "StorePlan",
    "TenantStats",
    "Tier",
    "TierQuery",
    "TierStats",
    "block_events",
    "block_hashes",
    "continue_chain",
    "key_digest",
    "paired_runs",
    "usable_tokens",
]


def test_the_cache_exports_only_its_door() -> None:
    import kvfleet_runtime.cache as cache

    assert sorted(cache.__all__) == sorted(CACHE_EXPORTS)
    for name in CACHE_EXPORTS:  # every exported name resolves (the torch ones on first use)
        assert getattr(cache, name) is not None, name


@pytest.mark.parametrize(
    "module",
    [m for m in _product_modules() if not m.startswith("kvfleet_runtime.cache")],
)
def test_product_code_enters_the_cache_by_its_package(module: str) -> None:
    private = sorted(
        n for n in _imports(module, top_level_only=False)
        if n.startswith("kvfleet_runtime.cache.") and n.split(".")[2].startswith("_")
    )
    assert private == [], f"{module} imports private cache modules: {private}"


# The cache's door: the members of its two facades that code outside the cache package uses (the
# engine, the vLLM connector, the tiers, the server and the lab). The list is the door: each
# facade's public members are exactly these, and everything else on them (the per-step calls, the
# index, the sketch, admission, the pools) is private to the package.
PREFIX_CACHE_DOOR = {
    "config", "layout", "dtype", "device", "device_kv",
    "prepare", "fill", "finish",  # the engine's request path
    "block_hashes", "lookup", "release", "num_held", "read_blocks",  # the fleet tier (T2)
    "pin", "unpin", "pools",  # T2 over NIXL: runs held where they lie, the memory registered
    "add_listener", "add_hit_listener", "set_eviction_sink",  # hint index, T3
    "store", "drain_store_queue", "materialize",  # tensors in and out (the lab, the engine)
    "invalidate", "stats", "t0_enabled", "set_t0_enabled", "t1_enabled", "set_t1_enabled",
}
CACHE_MANAGER_DOOR = {
    "hashes", "lookup", "release", "match", "acquire", "num_referenced_blocks",  # the connector
    "plan_store", "plan_import", "commit", "finish_commit", "drain_events", "stats",
    "replay", "num_cached_blocks",  # the lab's replays
}
_FACADES = {
    "PrefixCache": (ROOT / "runtime/kvfleet_runtime/cache/_cache.py", PREFIX_CACHE_DOOR),
    "CacheManager": (ROOT / "runtime/kvfleet_runtime/cache/_manager.py", CACHE_MANAGER_DOOR),
}
# The lab's cache bench measures the index and the pools themselves (lookup latency, metadata
# bytes, the move path): the one reader of the facades' insides outside the package.
_DOOR_EXEMPT = {"kvfleet_lab.cache.bench"}


def _members(path: Path, cls: str) -> set[str]:
    """Every member of class `cls`: its methods and properties, and what its methods assign on
    `self` (private ones included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    names = {n.name for n in body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names - {"__init__"}


def _off_the_door() -> dict[str, str]:
    """Member name -> its facade, for every member of either facade that is not on its door."""
    off: dict[str, str] = {}
    for cls, (path, door) in _FACADES.items():
        for name in _members(path, cls) - door:
            off.setdefault(name, cls)
    return off


def _door_breaches(path: Path, off: dict[str, str]) -> list[str]:
    """Attribute reads of a facade member off its door, on anything but the reader's own `self`
    (or `cls`), whatever the variable is called: `engine.cache._copy_into`, `m._index`,
    `prefix_cache.share_prefix` alike."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and node.attr in off
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})):
            found.append(f"{path.name}:{node.lineno} .{node.attr} ({off[node.attr]})")
    return found


def _outside_the_cache() -> list[str]:
    return [m for m in _sources() if not m.startswith("kvfleet_runtime.cache")]


@pytest.mark.parametrize("cls", sorted(_FACADES))
def test_the_door_list_is_each_facades_public_surface(cls: str) -> None:
    path, door = _FACADES[cls]
    public = {n for n in _members(path, cls) if not n.startswith("_")}
    assert public == door, f"{cls}: public but off the door {sorted(public - door)}, " \
        f"on the door but not public {sorted(door - public)}"


def test_every_door_name_is_used_outside_the_cache() -> None:
    # The door is what the users call: a name none of them reads belongs inside the package.
    read = {
        node.attr
        for m in _outside_the_cache()
        for node in ast.walk(ast.parse(_sources()[m].read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
    }
    assert sorted((PREFIX_CACHE_DOOR | CACHE_MANAGER_DOOR) - read) == []


@pytest.mark.parametrize("module", [m for m in _outside_the_cache() if m not in _DOOR_EXEMPT])
def test_the_cache_is_entered_only_by_its_door(module: str) -> None:
    assert _door_breaches(_sources()[module], _off_the_door()) == []


def test_the_door_rule_would_catch_a_private_or_off_door_call(tmp_path: Path) -> None:
    off = _off_the_door()
    assert {"_copy_into", "_manager", "_index", "_reclaim"} <= off.keys()
    engine = tmp_path / "engine.py"
    engine.write_text(
        "def step(self, pc, kv):\n"
        "    pc._copy_into(None, kv, [], 0, 0)\n"
        "    return self.engine_cache._manager._index.match([])\n"
    )
    assert _door_breaches(engine, off) == [
        "engine.py:2 ._copy_into (PrefixCache)",
        "engine.py:3 ._index (CacheManager)",
        "engine.py:3 ._manager (PrefixCache)",
    ]


# The packages that run in a pod. The lab sits above them and imports downwards.
_NO_CIRCLES_IN = ("kvfleet_runtime", "kvfleet_vllm", "kvfleet_operator")


def test_the_product_has_no_import_circle() -> None:
    # A circle (even a lazy or type-only one) means two modules that cannot be read, tested or
    # moved apart: the shared part belongs in a third module both import. Nothing is allowlisted.
    sources = {m: p for m, p in _sources().items() if m.startswith(_NO_CIRCLES_IN)}
    graph = _import_graph(sources)
    assert sum(map(len, graph.values())) > 200, "the graph reads no imports: the rule reads nothing"
    assert _circles(graph) == []


def test_the_circle_rule_would_catch_a_lazy_or_type_only_circle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (tmp_path / "d.py").write_text("import pkg.a\n")  # on the way in, not on the circle
    sources = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    assert _circles(_import_graph(sources)) == [["pkg.a", "pkg.b", "pkg.c"]]
