"""T2's data path on NIXL: one agent per replica process, its pools registered once, one-sided
READs of a peer's leased blocks straight into this replica's own blocks.

    agent = NixlAgent.start(name, cache.pools())    # None without NIXL (said once, at start)
    agent.geometries                                # where this replica's blocks lie
    remote = agent.add_remote(metadata)             # a peer's agent, from the control answer
    ok = agent.read(descriptors, remote, timeout_s) # blocking: run it in a worker thread

NIXL (the `nixl-cu12` wheel, module `nixl_cu12`; `nixl_cu13` or `nixl` too) with its UCX backend
picks the transport by what the hardware has: RDMA (GPUDirect from a GPU's memory), NVLink, shared
memory between processes of one host, or TCP. Everything else of T2 (the authenticated control
request, the chain recomputed by the server, the lease, the checks of dtype, layout and hashes)
is the fleet's own: `fleet.t2_serve.lease_routes`, `fleet.t2_fetch.PeerFetcher.read_leased`,
`fleet.t2_lease`. The import is lazy: a replica without NIXL (or whose agent fails to start)
serves and fetches T2 over its HTTP path.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfleet_runtime.fleet.t2_lease import Descriptors, PoolGeometry
from kvfleet_runtime.fleet.t2_serve import NixlServing

__all__ = ["NIXL_MODULES", "PROGRESS_POLL_S", "NixlAgent", "load_nixl", "pool_geometry"]

log = logging.getLogger(__name__)

NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
"""Where NIXL's Python API may be installed from (the CUDA 12 wheel, the CUDA 13 one, the meta
package), tried in this order."""

PROGRESS_POLL_S = 200e-6
"""How often a serving agent is progressed while a lease on it is live (UCX's connection setup,
and reads over transports that need the target's CPU: TCP)."""

SETTLE_S = 30.0
"""How long a read NIXL could not cancel (past its deadline, or after an error) is waited for to
end: until then its destination blocks may still change, so the read does not return."""
STUCK_EXIT_CODE = 70
"""A read NIXL can neither cancel nor see end within `SETTLE_S` stops the replica with this exit
code: its destination is the engine's blocks, and bytes landing in them after the engine took them
back (to recompute, or for another request) would be wrong KV served as a hit."""

_MAX_REMOTES = 256
"""Peer agents kept loaded; a peer that restarts is a new agent (its name holds a fresh token)."""

_loaded: list[Any] = []
_load_lock = threading.Lock()


def load_nixl() -> Any | None:
    """NIXL's Python module, or None (logged once) when none of `NIXL_MODULES` imports."""
    with _load_lock:
        if _loaded:
            return _loaded[0]
        module: Any | None = None
        errors: list[str] = []
        for name in NIXL_MODULES:
            try:
                module = importlib.import_module(name)
            except Exception as exc:  # an ImportError, or a wheel whose libraries fail to load
                errors.append(f"{name}: {exc}")
                continue
            if hasattr(module, "nixl_agent"):
                _own_nixl_logging()
                break
            module = None
        if module is None:
            log.warning("T2: NIXL is not installed (%s); T2 runs over HTTP only",
                        "; ".join(errors) or "no module")
        _loaded.append(module)
        return module


def _own_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines on stdout (its own handler): a replica's stdout is
    its own (`kvfleet bench --json`, readiness lines), so NIXL's records go through the
    process's logging instead, warnings and up unless `NIXL_LOG_LEVEL` says otherwise."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


def pool_geometry(k: torch.Tensor, v: torch.Tensor) -> PoolGeometry:
    """The geometry of a pool's K and V (`[layers, blocks, kv_heads, 16, head_dim]`, each block
    of a layer contiguous)."""
    if k.shape != v.shape or k.stride() != v.stride() or k.dim() != 5:
        raise ValueError("K and V of a pool must be alike, [layers, blocks, heads, 16, head_dim]")
    size = k.element_size()
    layers, blocks, heads, tokens, head_dim = k.shape
    inner = heads * tokens * head_dim
    if k.stride()[2:] != (tokens * head_dim, head_dim, 1):
        raise ValueError("a block of a layer must be contiguous")
    return PoolGeometry(
        k_addr=k.data_ptr(), v_addr=v.data_ptr(), layer_stride=k.stride(0) * size,
        block_stride=k.stride(1) * size, piece_bytes=inner * size, num_layers=layers,
        num_blocks=blocks, mem="VRAM" if k.device.type == "cuda" else "DRAM",
        dev_id=(k.device.index or 0) if k.device.type == "cuda" else 0)


def _regions(k: torch.Tensor, v: torch.Tensor) -> list[tuple[int, int, int, str]]:
    """What to register for a pool, `(address, bytes, device id, NIXL memory type)`: its one
    K|V allocation when K and V share it (a pool's usual layout), else each."""
    geometry = pool_geometry(k, v)
    out = []
    for t in (k, v):
        storage = t.untyped_storage()
        region = (storage.data_ptr(), storage.nbytes(), geometry.dev_id, geometry.mem)
        if region not in out:
            out.append(region)
    return out


class NixlAgent:
    """This replica's NIXL agent: its pools registered, the peers' agents it has met, reads."""

    def __init__(self, nixl: Any, name: str, pools: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        # No NIXL progress thread: it spins (a quarter of a core per idle replica here, and
        # starved the replica's own event loop: control requests 5x slower on a loaded box).
        # A read's initiator progresses it while polling (`read`); a serving agent is
        # progressed by `hold_progress` while a peer holds a lease on it.
        config = nixl.nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
        sync = getattr(nixl, "nixl_thread_sync_t", None)
        if sync is not None:  # reads run in worker threads, several at once
            config.sync_mode = sync.NIXL_THREAD_SYNC_STRICT
        self.name = name
        self._agent = nixl.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        self.geometries = tuple(pool_geometry(k, v) for k, v in pools)
        self._registered = [
            self._agent.register_memory([(addr, size, dev, "")], mem)
            for k, v in pools for addr, size, dev, mem in _regions(k, v)]
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._remotes: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._holds = 0
        self._ticking = False
        self._closed = False

    @classmethod
    def start(cls, replica: str,
              pools: Sequence[tuple[torch.Tensor, torch.Tensor] | Any | None]) -> NixlAgent | None:
        """The agent of this process, its pools registered (`PrefixCache.pools()`: objects with
        `k` and `v`, or None for a tier without a pool), or None (said once) when NIXL is
        missing or fails to start. The name holds the process and a fresh token, so a restarted
        replica is a new agent and descriptors of its predecessor never resolve."""
        nixl = load_nixl()
        if nixl is None:
            return None
        halves = [(p.k, p.v) if not isinstance(p, tuple) else p for p in pools if p is not None]
        name = f"{replica}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            agent = cls(nixl, name, halves)
        except Exception:
            log.exception("T2: NIXL agent failed to start; T2 runs over HTTP only")
            return None
        log.info("T2: NIXL agent %s registered %d pool(s), %.1f MiB", name, len(halves),
                 sum(k.nbytes + v.nbytes for k, v in halves) / (1 << 20))
        return agent

    def serving(self) -> NixlServing:
        """What the lease routes answer of this agent (`fleet.t2_serve.lease_routes`)."""
        return NixlServing(self.name, self.metadata, self.geometries, self.hold_progress)

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent from its metadata (from the authenticated control answer); its
        name. Loading the same metadata again is free."""
        with self._lock:
            known = [n for n, m in self._remotes.items() if m == metadata]
            if known:
                return known[0]
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] = metadata
            while len(self._remotes) > _MAX_REMOTES:
                oldest = next(iter(self._remotes))
                del self._remotes[oldest]
                self._forget(oldest)
            return name

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._remotes

    def forget(self, name: str) -> None:
        """Drop a peer's agent (after a failed read: it may have restarted or gone)."""
        with self._lock:
            if self._remotes.pop(name, None) is not None:
                self._forget(name)

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            log.debug("T2: NIXL could not drop agent %s", name, exc_info=True)

    def read(self, descriptors: Sequence[Descriptors], remote: str, timeout_s: float) -> bool:
        """Blocking: READ every descriptor pair from agent `remote` into this agent's memory,
        True once all completed within `timeout_s`; False on any error or the deadline (the
        bytes landed are then not to be used). Polls with a short sleep, not a spin."""
        deadline = time.monotonic() + timeout_s
        handles: list[Any] = []
        try:
            for d in descriptors:
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(d.local, d.local_mem),
                    self._agent.get_xfer_descs(d.remote, d.remote_mem), remote)
                handles.append(handle)
                if self._agent.transfer(handle) == "ERR":
                    return False
            pause = 20e-6
            pending = list(handles)
            while pending:
                states = [self._agent.check_xfer_state(h) for h in pending]
                if "ERR" in states:
                    return False
                pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
                if pending:
                    if time.monotonic() > deadline:
                        log.info("T2: NIXL read from %s past its %.2f s deadline", remote,
                                 timeout_s)
                        return False
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
            return True
        except Exception as exc:  # NIXL raises on unknown agents, descriptors, dead peers
            log.info("T2: NIXL read from %s failed: %r", remote, exc)
            return False
        finally:
            self._settle(handles, remote)

    def _settle(self, handles: Sequence[Any], remote: str) -> None:
        """Release every handle, which cancels a transfer still in flight. One NIXL cannot
        cancel is still writing into this replica's blocks: wait until its transfer ends (DONE
        or ERR: its bytes change no more), then release it; at most `SETTLE_S`, then stop the
        process (`STUCK_EXIT_CODE`) rather than hand the blocks back while they may change."""
        stuck: list[Any] = []
        for handle in handles:
            try:
                handle.release()
            except Exception:
                stuck.append(handle)
        if not stuck:
            return
        log.warning("T2: NIXL could not cancel %d read(s) from %s; waiting for them to end",
                    len(stuck), remote)
        deadline = time.monotonic() + SETTLE_S
        while stuck:
            pending = []
            for handle in stuck:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:
                    state = "ERR"
                if state == "PROC":
                    pending.append(handle)
                    continue
                try:
                    handle.release()
                except Exception:  # over: its bytes change no more, whatever NIXL frees
                    log.debug("T2: NIXL handle not released after its end", exc_info=True)
            stuck = pending
            if stuck and time.monotonic() > deadline:
                log.critical("T2: %d NIXL read(s) from %s neither cancelled nor ended in %g s: "
                             "stopping, their destination blocks could still change",
                             len(stuck), remote, SETTLE_S)
                logging.shutdown()
                os._exit(STUCK_EXIT_CODE)
            if stuck:
                time.sleep(1e-3)

    def hold_progress(self) -> Callable[[], None]:
        """Keep this agent progressed (its peers' reads served) until the callable returned is
        called (once; later calls do nothing): a lease on this replica's blocks holds one. Call
        it on the replica's event loop: the agent is progressed there, every `PROGRESS_POLL_S`
        while a hold lasts (a thread of its own would take the GIL from the loop thousands of
        times a second, and cost the loop milliseconds each time)."""
        loop = asyncio.get_running_loop()
        self._holds += 1
        if not self._ticking:
            self._ticking = True
            loop.call_soon(self._tick, loop)
        let_go = [False]

        def release() -> None:
            if not let_go[0]:
                let_go[0] = True
                self._holds -= 1

        return release

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._holds or self._closed:
            self._ticking = False
            return
        try:
            self._agent.get_new_notifs()  # progresses the backend's worker
        except Exception:
            log.debug("T2: NIXL progress failed", exc_info=True)
        loop.call_later(PROGRESS_POLL_S, self._tick, loop)

    def close(self) -> None:
        """Stop progressing and deregister the pools (at the replica's shutdown)."""
        self._closed = True
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                log.debug("T2: NIXL deregister failed", exc_info=True)
        self._registered.clear()
