#!/usr/bin/env bash
# `make demo-cluster`: the operator's path on a local control plane (scripts/demo_cluster.py).
# Needs what `make test` installs: the cluster binaries (tests/cluster/build.sh), Redis,
# Prometheus and buildah (scripts/system-deps.sh), the runtime image (scripts/images.sh).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$KVFLEET_ROOT"
exec "$KVFLEET_VENV/bin/python" scripts/demo_cluster.py "$@"
