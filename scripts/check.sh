#!/usr/bin/env bash
# Lint, type checks and the test suite, in the project's environment.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$KVFLEET_ROOT"
export PATH="$KVFLEET_VENV/bin:$PATH"

echo "== ruff"
ruff check runtime operator tests
echo "== mypy (strict on kvfleet_runtime, kvfleet_lab and kvfleet_operator)"
mypy runtime/kvfleet_runtime runtime/kvfleet_lab operator/kvfleet_operator
echo "== pytest"
pytest "$@"
