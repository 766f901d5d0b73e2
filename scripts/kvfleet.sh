#!/usr/bin/env bash
# Runs the `kvfleet` command of this checkout's environment.
set -euo pipefail
source "$(dirname "$0")/env.sh"
exec "$KVFLEET_VENV/bin/kvfleet" "$@"
