"""`kvfleet-operator`: run the operator, regenerate the manifests, or benchmark the planners.

    kvfleet-operator run [--namespace NS ...] [--standalone] [--priority N] [--verbose]
    kvfleet-operator manifests [--check]      # crds/*.yaml and operator/rbac/clusterrole.yaml
    kvfleet-operator bench [--json]           # the planners' benchmarks (issue 7)

The benchmarks live here rather than under `kvfleet bench` because the runtime must never import
the operator package; the operator depends on the runtime, not the other way round.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys

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


def _bench(args: argparse.Namespace) -> int:
    from kvfleet_operator.bench import run_all

    results = run_all(quick=args.quick)
    if args.json:
        sys.stdout.write(json.dumps(results, indent=2) + "\n")
    else:
        for name, figures in results.items():
            sys.stdout.write(f"{name}: {figures}\n")
    return 0


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
    bench = sub.add_parser("bench", help="benchmark the planners")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
