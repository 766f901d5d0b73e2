"""A FAULT for scenario B of test_user_path.py: the real replica, with a cache key that never holds
still. For pods of the image kubelet.UNSTABLE_KEY_IMAGE the kubelet shim runs this, bind-mounted
read-only into the built runtime image, with the image's own python in place of the image's
ENTRYPOINT; every other pod runs the `kvfleet` entry point as it is.

What it stands for: a new version that unintentionally changed a cache-key component, one that
keeps changing (seed: "hit rate did not recover within 30 minutes usually means a key component
changed that you did not intend to change"). A real, *stable* key change (another attention
implementation id) is not that: the canary starts cold under its new key and warms as fast as
one with new weights, so its gate passes. The real replica cannot produce a key that differs per
request, so this wrapper injects it: `CacheKeyFields.key` (the engine derives each request's
CacheKey from it; kvfleet_runtime/engine/_engine.py) gets a per-request nonce in `attn_impl_id`,
then the unchanged `kvfleet` CLI runs with the pod's args. Nothing the replica reports changes
(its load report and /readyz show the model's real key fields): the fault shows only as a hit
rate that stays at zero, as it would in production.

Run as a file (`python /opt/kvfleet-e2e/unstable_key.py replica ...` inside the image): it imports
nothing from tests/, only the image's kvfleet.
"""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet_runtime.cache import CacheKey
    from kvfleet_runtime.engine import CacheKeyFields

MARKER = "kvfleet-e2e FAULT: unstable cache key (attn_impl_id gets a per-request nonce)"


def install() -> None:
    from kvfleet_runtime.engine import CacheKeyFields

    original = CacheKeyFields.key
    nonces = itertools.count()

    def unstable_key(self: CacheKeyFields, tenant_id: str) -> CacheKey:
        key = original(self, tenant_id)
        return key._replace(attn_impl_id=f"{key.attn_impl_id}+nonce{next(nonces)}")

    CacheKeyFields.key = unstable_key  # type: ignore[method-assign]
    print(MARKER, file=sys.stderr, flush=True)


def main() -> None:
    install()
    from kvfleet_runtime.cli import main as kvfleet

    sys.argv[0] = "kvfleet"
    kvfleet()


if __name__ == "__main__":
    main()
