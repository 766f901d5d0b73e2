"""The two Dockerfiles, kept correct without a Docker engine: every path they copy exists and is in
the build context, every entry point they run is one pyproject.toml installs, they run as a
non-root user, the operator image carries what the operator imports and no torch, and the runtime
image installs the lock's CUDA torch."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.chart.conftest import ROOT

DOCKER = ROOT / "docker"
OPERATOR = DOCKER / "operator.Dockerfile"
RUNTIME = DOCKER / "runtime.Dockerfile"
DOCKERFILES = [OPERATOR, RUNTIME]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = (ROOT / "requirements.lock").read_text()
# kvfleet itself, from the wheel the build stage made: no dependency resolved a second time.
WHEEL = ["--no-deps", "--no-index", "/opt/kvfleet-wheel/kvfleet-*.whl"]


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (no heredocs used)."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage))
    assert not pending, f"{path}: dangling line continuation"
    return out


def _final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def _copy_sources(instructions: list[Instruction]) -> list[str]:
    sources = []
    for ins in instructions:
        if ins.keyword not in {"COPY", "ADD"}:
            continue
        words = shlex.split(ins.args)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage, not from the context
        words = [w for w in words if not w.startswith("--")]
        assert len(words) >= 2, f"COPY needs a source and a destination: {ins.args}"
        sources += words[:-1]
    return sources


def _dockerignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        patterns.append((negated, line.lstrip("!").rstrip("/")))
    return patterns


def in_build_context(relative: str) -> bool:
    """Docker's rule: the last matching pattern decides; a path is out when a parent is out and
    no later pattern brings it back."""
    relative = relative.rstrip("/")
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, pattern in _dockerignore_patterns():
        regex = fnmatch.translate(pattern.replace("**/", "*/"))
        if any(re.match(regex, c) or fnmatch.fnmatch(c, pattern) for c in candidates):
            excluded = not negated
    return not excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_is_in_the_context(dockerfile: Path) -> None:
    sources = _copy_sources(parse_dockerfile(dockerfile))
    assert sources, f"{dockerfile.name} copies nothing"
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
        assert in_build_context(source), (
            f"{dockerfile.name}: COPY {source}: excluded by .dockerignore"
        )


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".git", "tests", "charts", "docs", ".mypy_cache", "runtime/x/__pycache__"):
        assert not in_build_context(path), f"{path} would be sent to the Docker daemon"


def _entrypoint(instructions: list[Instruction]) -> list[str]:
    final = _final_stage(instructions)
    entry = [i for i in final if i.keyword == "ENTRYPOINT"]
    assert entry, "no ENTRYPOINT in the final stage"
    argv = json.loads(entry[-1].args)  # exec form only: a shell form would hide signals
    assert isinstance(argv, list) and argv, entry[-1].args
    return argv


@pytest.mark.parametrize(
    ("dockerfile", "script"),
    [(OPERATOR, "kvfleet-operator"), (RUNTIME, "kvfleet")],
    ids=["operator", "runtime"],
)
def test_entry_point_is_installed_by_pyproject(dockerfile: Path, script: str) -> None:
    argv = _entrypoint(parse_dockerfile(dockerfile))
    scripts = PYPROJECT["project"]["scripts"]
    assert argv[0] == script
    assert argv[0] in scripts, (
        f"{dockerfile.name} runs {argv[0]}, which [project.scripts] does not install: {scripts}"
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user(dockerfile: Path) -> None:
    final = _final_stage(parse_dockerfile(dockerfile))
    users = [i.args for i in final if i.keyword == "USER"]
    assert users, f"{dockerfile.name}: no USER in the final stage (it would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"{dockerfile.name}: USER {users[-1]} must be a numeric non-root uid "
        "(so runAsNonRoot can verify it)"
    )
    assert final.index(next(i for i in final if i.keyword == "USER")) > max(
        n for n, i in enumerate(final) if i.keyword in {"RUN", "COPY"}
    ), "USER must come after the last RUN/COPY"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_small_multi_stage_on_the_project_python(dockerfile: Path) -> None:
    instructions = parse_dockerfile(dockerfile)
    assert max(i.stage for i in instructions) >= 1, "build tools stay in a build stage"
    args = {
        i.args.split("=", 1)[0]: i.args.split("=", 1)[1]
        for i in instructions
        if i.keyword == "ARG" and "=" in i.args
    }
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11-slim(-[a-z]+)?", base), base
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert "--python-version 3.11" in LOCK.splitlines()[1], "the lock is compiled for 3.11"


def _pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN lines (a RUN's options such as --mount
    dropped, its commands split at `&&` and `;` outside quotes)."""
    out = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        command: list[str] = []
        for word in [*shlex.split(ins.args), "&&"]:
            if word in {"&&", ";"}:
                if len(command) >= 2 and command[0].endswith("pip") and command[1] == "install":
                    out.append(command[2:])
                command = []
            elif command or not word.startswith("--"):
                command.append(word)
    return out


def _locked_versions() -> dict[str, str]:
    pins = {}
    for line in LOCK.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def test_runtime_image_installs_the_locked_cuda_torch() -> None:
    installs = _pip_installs(parse_dockerfile(RUNTIME))
    # The dependencies from the lock, then kvfleet's own wheel alone (made in the build stage).
    assert installs == [["--constraint", "requirements.lock", ".[replica,gateway]"], WHEEL], (
        installs)
    pins = _locked_versions()
    assert "torch" in pins, "the lock pins no torch"
    # The lock's torch is the CUDA build for linux x86_64: it brings the CUDA runtime as wheels.
    assert any(name.startswith("nvidia-cuda-runtime") for name in pins), (
        "the lock's torch carries no CUDA runtime"
    )


def _requirement_closure(names: list[str]) -> set[str]:
    """Distributions installed by `pip install names` (from this environment's metadata)."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _operator_imports() -> set[str]:
    """Third-party distributions behind every module `kvfleet_operator` imports. A top-level
    name several distributions install under (`google`: google-auth, protobuf, xds-protos)
    counts by the distribution holding each imported subpackage; importing the bare name (an
    optional import that found nothing) counts for none of them."""
    code = (
        "import importlib, pkgutil, sys, json\n"
        "startup = set(sys.modules)\n"
        "import kvfleet_operator as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(json.dumps(sorted(set(sys.modules) - startup)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    # Modules loaded before ours (site hooks such as setuptools' _distutils_hack) are not the
    # operator's: only what importing it adds counts.
    imported = set(json.loads(proc.stdout))
    owners = metadata.packages_distributions()
    ours = {"kvfleet_runtime", "kvfleet_operator"}
    dists = set()
    for top in {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - ours:
        shared = owners.get(top, [])
        if len(set(shared)) <= 1:
            dists.update(canonicalize_name(d) for d in shared)
            continue
        for sub in {".".join(m.split(".")[:2]) for m in imported if m.startswith(top + ".")}:
            prefix = sub.replace(".", "/")
            dists.update(canonicalize_name(d) for d in set(shared) if any(
                str(f) == prefix + ".py" or str(f).startswith(prefix + "/")
                for f in metadata.files(d) or []))
    return dists


def _install_set(extras: list[str]) -> list[str]:
    """pyproject.toml's requirements for `pip install .[extras]` (self-references expanded)."""
    project = PYPROJECT["project"]
    out = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in project["optional-dependencies"][extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == canonicalize_name(project["name"]):
                todo += sorted(req.extras)
            else:
                out.append(spec)
    return [Requirement(spec).name for spec in out]


def test_operator_image_installs_the_operators_install_set() -> None:
    installs = _pip_installs(parse_dockerfile(OPERATOR))
    assert installs == [["--constraint", "requirements.lock", ".[operator]"], WHEEL], installs


@pytest.mark.parametrize("extras", [["operator"], []], ids=["operator", "base"])
def test_the_operators_install_set_pulls_no_torch_and_no_matplotlib(extras: list[str]) -> None:
    named = _install_set(extras)
    pins = _locked_versions()
    unpinned = [n for n in named if canonicalize_name(n) not in pins]
    assert not unpinned, f"not pinned by requirements.lock: {unpinned}"
    closure = _requirement_closure(named)
    assert "kopf" in closure or extras == [], "the closure reads nothing: the check would be void"
    heavy = sorted(closure & {"torch", "matplotlib", "safetensors", "triton"})
    assert heavy == [], f"pip install .[{','.join(extras)}] would install {heavy}"


def test_the_lab_install_set_is_what_the_lab_needs() -> None:
    # The guard above would be void if the heavy packages were nowhere: they sit in [lab].
    closure = _requirement_closure(_install_set(["lab"]))
    assert {"torch", "matplotlib", "kopf"} <= closure


def test_operator_image_has_what_the_operator_imports() -> None:
    closure = _requirement_closure(_install_set(["operator"]))
    missing = _operator_imports() - closure
    assert not missing, f"kvfleet_operator imports distributions the image lacks: {missing}"


def test_importing_the_operator_loads_no_torch_and_no_matplotlib() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import kvfleet_operator as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted({'torch', 'matplotlib'} & {n.split('.')[0] for n in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_operator_package_does_not_need_torch_to_import() -> None:
    # A fresh interpreter (this one may hold torch already) in which importing torch fails, as in
    # the operator image: every module of the package still imports, from the repository.
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['torch'] = None  # `import torch` now raises ImportError\n"
        "import kvfleet_operator as p\n"
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(p.__file__, len(names))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    where, walked = proc.stdout.split()
    assert Path(where).parent == ROOT / "operator" / "kvfleet_operator"
    assert int(walked) >= len(list(Path(where).parent.glob("*.py"))) - 1  # all but __init__
