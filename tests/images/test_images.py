"""Smoke tests on the built images (scripts/images.sh), run as the image's own user on a read-only
root: the runtime image serves a completion from a generated checkpoint through `kvfleet router`
with the official `openai` client, carries exactly the lock's versions and its CUDA torch; the
operator image runs `kvfleet-operator --help` and carries no torch and no matplotlib. What chroot
isolation does not check is listed in buildah.py."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from tests.images.conftest import ROOT, VERSION, Container, stop
from tests.support import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow]

UID = "10001:10001"  # the chart's runAsUser / runAsGroup
LOCK = (ROOT / "requirements.lock").read_text()
HEAVY = ("torch", "matplotlib", "triton", "safetensors")
FIND_SPECS = (
    "import importlib.util, json, sys;"
    "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m)]))"
)
FREEZE = (
    "import importlib.metadata as m, json;"
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[_canon(m.group(1))] = m.group(2)
    return pins


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300  # a cold import of torch on a loaded 2-core box
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{url} not ready:\n{log.read_text()}"
        time.sleep(0.5)


@pytest.mark.parametrize("image", ["runtime_image", "operator_image"])
def test_runs_as_uid_10001_on_a_read_only_root(image: str, request: pytest.FixtureRequest) -> None:
    ctr: Container = request.getfixturevalue(image)
    assert ctr.config["User"] == UID
    probe = (
        "import errno, os;"
        "print(os.getuid(), os.getgid());"
        "open('/tmp/probe', 'w').write('ok');"
        "exec(\"try:\\n open('/opt/kvfleet/probe', 'w')\\nexcept OSError as e:"
        "\\n print(errno.errorcode[e.errno])\")"
    )
    result = ctr.run(["/opt/kvfleet/bin/python", "-c", probe])
    assert result.returncode == 0, result.stderr
    # EROFS, not EACCES: the mount is read-only, whoever writes (root included).
    assert result.stdout.split() == ["10001", "10001", "EROFS"]


def test_operator_image_runs_its_help_and_carries_no_torch(operator_image: Container) -> None:
    assert operator_image.entrypoint() == ["kvfleet-operator"]
    result = operator_image.run([*operator_image.entrypoint(), "--help"])
    assert result.returncode == 0, result.stderr
    assert "run" in result.stdout.split()
    found = operator_image.run(["/opt/kvfleet/bin/python", "-c", FIND_SPECS, *HEAVY, "kopf"])
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == ["kopf"]


@pytest.mark.parametrize("image", ["runtime_image", "operator_image"])
def test_every_installed_distribution_is_at_the_locked_version(
    image: str, request: pytest.FixtureRequest
) -> None:
    ctr: Container = request.getfixturevalue(image)
    result = ctr.run(["/opt/kvfleet/bin/python", "-c", FREEZE])
    assert result.returncode == 0, result.stderr
    installed = {_canon(k): v for k, v in json.loads(result.stdout).items()}
    # pip (and its setuptools) come with the venv; kvfleet is this checkout's wheel.
    unlocked = {"pip", "setuptools", "kvfleet"}
    pins = _locked()
    wrong = {n: (v, pins.get(n)) for n, v in installed.items()
             if n not in unlocked and pins.get(n) != v}
    assert wrong == {}, f"installed version vs the lock's: {wrong}"
    assert installed["kvfleet"] == VERSION
    if image == "runtime_image":
        assert installed["torch"] == pins["torch"]
        assert any(n.startswith("nvidia-cuda-runtime") for n in installed), "no CUDA runtime"
    else:
        assert not {"torch", "matplotlib"} & installed.keys()


def test_runtime_image_serves_a_completion_through_the_router(
    runtime_image: Container, tmp_path: Path
) -> None:
    model_dir = tmp_path / "tiny"
    digest = generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    replica_port, router_port = free_port(), free_port()
    replica_url = f"http://127.0.0.1:{replica_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    # The chart's mounts: the model volume, the replica's config, the fleet config, the peer
    # secret, the router's keys and secret, the operator's token, all read-only.
    etc = tmp_path / "etc"
    subs = ("replica", "fleet", "peer", "router", "router-secret", "operator-token")
    for sub in subs:
        (etc / sub).mkdir(parents=True)
        (etc / sub).chmod(0o755)
    (etc / "replica" / "replica.yaml").write_text("cpu_threads: 1\nlimits: {max_tokens: 8}\n")
    (etc / "fleet" / "fleet.yaml").write_text(
        json.dumps({"replicas": [{"name": "r0", "url": replica_url}]})
    )
    (etc / "peer" / "token").write_text("image-test-secret")
    (etc / "router" / "keys.yaml").write_text(json.dumps({"tenants": {"acme": ["sk-acme"]}}))
    (etc / "router-secret" / "secret").write_text("image-test-router-secret")
    (etc / "operator-token" / "token").write_text("image-test-operator-token")
    for path in [model_dir, *model_dir.rglob("*"), *etc.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    volumes = [f"{model_dir}:/models/tiny:ro"] + [
        f"{etc / sub}:/etc/kvfleet/{sub}:ro" for sub in subs
    ]
    secret = {"KVFLEET_ROUTER_SECRET_FILE": "/etc/kvfleet/router-secret/secret"}
    entry = runtime_image.entrypoint()
    assert entry == ["kvfleet"]
    replica = runtime_image.start(
        [*entry, "replica", "--model-dir", "/models/tiny", "--model-id", "tiny",
         "--host", "127.0.0.1", "--port", str(replica_port),
         "--config", "/etc/kvfleet/replica/replica.yaml", "--log-level", "WARNING"],
        tmp_path / "replica.log", volumes=volumes,
        env={"KVFLEET_WEIGHTS_DIGEST": digest, "POD_NAME": "r0", "POD_IP": "127.0.0.1",
             "KVFLEET_PEER_SECRET_FILE": "/etc/kvfleet/peer/token",
             "KVFLEET_OPERATOR_TOKEN_FILE": "/etc/kvfleet/operator-token/token",
             "KVFLEET_FLEET_CONFIG": "/etc/kvfleet/fleet/fleet.yaml", **secret},
    )
    router = runtime_image.start(
        [*entry, "router", "--host", "127.0.0.1", "--port", str(router_port),
         "--keys", "/etc/kvfleet/router/keys.yaml",
         "--fleet-config", "/etc/kvfleet/fleet/fleet.yaml", "--log-level", "WARNING"],
        tmp_path / "router.log", volumes=volumes, env=secret,
    )
    try:
        _wait_ready(replica_url, replica, tmp_path / "replica.log")
        _wait_ready(router_url, router, tmp_path / "router.log")
        client = openai.OpenAI(base_url=router_url + "/v1", api_key="sk-acme", max_retries=0,
                               timeout=120)
        completion = client.completions.create(model="tiny", prompt="hello image",
                                               max_tokens=4, temperature=0.0)
        assert completion.model == "tiny"
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        # A wrong key is the router's 401 in OpenAI's envelope, from inside the image too.
        bad = openai.OpenAI(base_url=router_url + "/v1", api_key="sk-nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    finally:
        stop(router)
        stop(replica)
