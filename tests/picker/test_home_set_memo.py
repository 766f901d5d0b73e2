"""The router's memo of rendezvous choices (`FleetView.home_set`): the decision it feeds is the
rendezvous top k over the ready replicas, whatever is ready, and the memo follows the replicas."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet_runtime.affinity import ReplicaLoad, choose_replica, rendezvous_top_k
from kvfleet_runtime.picker import FleetView

TENANTS = [f"tenant-{i}" for i in range(300)]


def _write(path: Path, names: list[str], **extra: object) -> None:
    reps = [{"name": n, "url": f"http://127.0.0.1:{9000 + i}"} for i, n in enumerate(names)]
    path.write_text(json.dumps({"replicas": reps, **extra}))


def _decide(view: FleetView, tenant: str, ready: set[str]) -> tuple[str, ...]:
    loads = [ReplicaLoad(n, 0.1, 0.0, ready=n in ready) for n in sorted(view.replicas)]
    d = choose_replica(tenant, loads, k=view.affinity_k, occupancy_threshold=0.85,
                       home_set=view.home_set(tenant))
    assert d is not None
    return d.homes


def test_memoized_homes_decide_as_rendezvous_over_the_ready_replicas(tmp_path: Path) -> None:
    names = [f"r{i:03d}" for i in range(60)]
    path = tmp_path / "fleet.yaml"
    _write(path, names, generation=1)
    view = FleetView(config_path=path)
    assert view.reload_config()
    for ready in (set(names), set(names[::2]), set(names[:4]), {names[7]}):
        for tenant in TENANTS:
            want = tuple(rendezvous_top_k(tenant, sorted(ready), 3))
            assert _decide(view, tenant, ready) == want
    # Every tenant whose first choices are all down still gets the next ready ones.
    down = set(view.home_set("tenant-1") or ())
    ready = set(names) - down
    assert _decide(view, "tenant-1", ready) == tuple(rendezvous_top_k("tenant-1", sorted(ready), 3))


def test_memo_follows_the_replica_list_and_k(tmp_path: Path) -> None:
    names = [f"r{i:03d}" for i in range(20)]
    path = tmp_path / "fleet.yaml"
    _write(path, names, generation=1)
    view = FleetView(config_path=path)
    assert view.reload_config()
    before = {t: view.home_set(t) for t in TENANTS}
    assert all(h is not None and len(h) == 6 for h in before.values())
    _write(path, names[:-1], generation=2)
    assert view.reload_config()
    for tenant in TENANTS:
        assert view.home_set(tenant) == tuple(rendezvous_top_k(tenant, names[:-1], 6))
    _write(path, names, generation=3, affinity={"k": 2})
    assert view.reload_config()
    assert view.home_set("tenant-0") == tuple(rendezvous_top_k("tenant-0", names, 4))
    # A pin in the config is used as written.
    _write(path, names, generation=4, home_sets={"tenant-0": ["r005"]})
    assert view.reload_config()
    assert view.home_set("tenant-0") == ("r005",)
