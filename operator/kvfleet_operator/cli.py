"""`kvfleet-operator`: run the operator or regenerate the manifests.

    kvfleet-operator run [--namespace NS ...] [--standalone] [--priority N] [--verbose]
    kvfleet-operator manifests [--check]      # crds/*.yaml and operator/rbac/clusterrole.yaml

The planners' benchmarks are `kvfleet bench operator`: they live in the lab package, which the
operator may not import.
"""

from __future__ import annotations

import argparse
import logging
import random

__all__ = ["main"]


def _run(args: argparse.Namespace) -> int:
    import kopf

    from kvfleet_operator import main as operator_main

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # A distinct priority per replica: with kopf peering, the highest live one acts, the rest
    # wait. Equal priorities would make every replica pause.
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        standalone=args.standalone,
        priority=priority,
        peering_name=None if args.standalone else operator_main.PEERING_NAME,
        liveness_endpoint=args.liveness,
    )
    return 0


def _manifests(args: argparse.Namespace) -> int:
    from kvfleet_operator.crdgen import main as generate

    return generate(["--check"] if args.check else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet-operator", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf)")
    run.add_argument("--namespace", "-n", action="append", help="watch only these namespaces")
    run.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    run.add_argument("--priority", type=int, default=None, help="peering priority")
    run.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--verbose", "-v", action="store_true")
    run.set_defaults(func=_run)
    manifests = sub.add_parser("manifests", help="regenerate crds/ and the ClusterRole")
    manifests.add_argument("--check", action="store_true", help="exit 1 when stale")
    manifests.set_defaults(func=_manifests)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
