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
import sys

from kvfleet_operator.constants import PEERING_NAME

__all__ = ["main", "run"]


_log = logging.getLogger("kvfleet_operator")


def _namespace_peerings(namespaces: list[str], name: str) -> str | None:
    """Make sure each watched namespace has the KopfPeering kopf waits for (without it, kopf waits
    forever and says so only at DEBUG). None when they all exist; else the one-line error."""
    from kvfleet_operator.kube import Kube, KubeError

    try:
        kube = Kube.from_environment()
    except Exception as exc:  # the client's config loaders raise several types
        return f"no Kubernetes credentials ({exc}): set KUBECONFIG or run in a pod"
    for namespace in namespaces:
        try:
            created = kube.ensure_namespace_peering(namespace, name)
        except KubeError as exc:
            if exc.status == 404:
                return (
                    f"namespace {namespace!r} does not exist, or the KopfPeering CRD is not "
                    f"installed: create the namespace, `kubectl apply -f crds/`, or run with "
                    f"--standalone"
                )
            return (
                f"cannot create KopfPeering {name!r} in namespace {namespace!r} ({exc.status}): "
                f"grant `create` on kopfpeerings.kopf.dev (operator/rbac/clusterrole.yaml), "
                f"create it (`kubectl apply -n {namespace} -f -` with kind KopfPeering, name "
                f"{name}), or run with --standalone"
            )
        except OSError as exc:
            return f"cannot reach the Kubernetes API: {exc}"
        state = "created" if created else "exists"
        _log.info("peering: KopfPeering %s/%s %s", namespace, name, state)
    return None


def _run(args: argparse.Namespace) -> int:
    import kopf

    import kvfleet_operator.main  # noqa: F401  (registers the handlers with kopf)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    namespaces: list[str] = args.namespace or []
    if namespaces and not args.standalone:
        error = _namespace_peerings(namespaces, PEERING_NAME)
        if error is not None:
            sys.stderr.write(f"kvfleet-operator: {error}\n")
            return 2
    # A distinct priority per replica: with kopf peering, the highest live one acts, the rest
    # wait. Equal priorities would make every replica pause.
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    where = f"namespaces {', '.join(namespaces)}" if namespaces else "all namespaces"
    peering = (
        "no peering (--standalone)"
        if args.standalone
        else f"peering {PEERING_NAME!r} at priority {priority} (only the "
        f"highest-priority live operator acts; the others wait for it to go)"
    )
    _log.info("watching %s; %s", where, peering)
    settings = kopf.OperatorSettings()
    # Given literal namespaces, kopf would still list every Namespace to match them as patterns
    # (a right the operator does not have: least privilege), logging a 403 every few seconds.
    settings.scanning.disabled = bool(namespaces)
    kopf.run(
        settings=settings,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        priority=priority,
        peering_name=None if args.standalone else PEERING_NAME,
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


def run() -> None:
    """The `kvfleet-operator` console script."""
    raise SystemExit(main())
