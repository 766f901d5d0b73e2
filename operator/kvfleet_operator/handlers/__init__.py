"""Handler bodies: read the object and the world -> call a pure planner -> apply -> write status.

`main.py` holds the kopf decorators; each calls one function here: `policy.reconcile_policy`
(KVCachePolicy) or `rollout.reconcile_rollout` (ModelRollout), both built on `_shell`. Each of
those is a shell: `_reconciled` (the one wrapper of a reconcile: conflicts, a namespace going
away, API errors) around a read, pure helpers that turn what was read into a status
(`policy_spec`, `policy_status`, `observations`, `refused_status`: tested without a cluster),
and the writes.

Every function is level-triggered: it re-reads the object (never trusts a cached body), so
running it twice, or after a restart, does the same thing; the status is written with the
resourceVersion that was read, so a concurrent change (409) makes it start over from a fresh
read: at once a few times, then through kopf (`TemporaryError(delay=...)`), never by sleeping in
the handler.

An object the operator cannot act on (a spec the models refuse, a target without the named
container) gets a `Ready=False` condition saying why (`_refuse`, for either kind), written once
(an unchanged status is never re-written), and a `kopf.PermanentError`: `schedule.run_scheduled`
then stops ticking it until the object changes.
"""

from kvfleet_operator.handlers._shell import (
    CONFLICT_DELAY_S,
    PostEvent,
    engine_of,
    peer_port_of,
    pod_to_replica,
    refused_status,
    workload_of,
)
from kvfleet_operator.handlers.policy import (
    MAX_HOME_SET_PLANS,
    HomeSetPlans,
    Published,
    policy_spec,
    policy_status,
    reconcile_policy,
)
from kvfleet_operator.handlers.rollout import observations, reconcile_rollout

__all__ = [
    "CONFLICT_DELAY_S",
    "MAX_HOME_SET_PLANS",
    "HomeSetPlans",
    "PostEvent",
    "Published",
    "engine_of",
    "observations",
    "peer_port_of",
    "pod_to_replica",
    "policy_spec",
    "policy_status",
    "reconcile_policy",
    "reconcile_rollout",
    "refused_status",
    "workload_of",
]
