"""Connection-pool caps of the router and the hint index: their one home, stdlib only, so the
CLI shows them as defaults without importing the servers.

Each process's pools are bounded so that a burst costs waiting or a skipped hint, never an
unbounded number of sockets and their buffers (issue 29: uncapped, an overloaded router opened
~1,000 upstream connections to four replicas and ~470 to one Redis).
"""

from __future__ import annotations

__all__ = [
    "REDIS_MAX_CONNECTIONS",
    "UPSTREAM_MAX_CONNECTIONS",
    "UPSTREAM_MAX_CONNECTIONS_PER_REPLICA",
]

REDIS_MAX_CONNECTIONS = 32
"""Connections one process keeps to one Redis (to each master of a cluster), which is also how
many of its index calls are in flight at once. A lookup that finds them all busy is not made (the
request routes without hints: recompute rather than queue); a publish or withdraw waits for one
within its timeout. 32 lookups in flight at ~0.5 ms each is ~60,000 lookups/s, past what one
router process serves."""

UPSTREAM_MAX_CONNECTIONS_PER_REPLICA = 256
"""Connections one router keeps open to one replica: requests beyond wait for one (within their
timeout). A request holds its connection for the whole generation, so this is also the most
requests one router has in flight at one replica; a replica batches far fewer."""

UPSTREAM_MAX_CONNECTIONS = 2048
"""Connections one router keeps open to all replicas together (the memory bound)."""
