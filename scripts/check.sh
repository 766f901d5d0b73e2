#!/usr/bin/env bash
# Lint, type checks and the test suite, in the project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVFLEET_VENV:-${KVFLEET_HOME:-$HOME/.cache/kvfleet}/venv}"
export PATH="$VENV/bin:$PATH"

echo "== ruff"
ruff check runtime operator tests
echo "== mypy (strict on kvfleet_runtime and kvfleet_operator)"
mypy runtime/kvfleet_runtime operator/kvfleet_operator
echo "== pytest"
pytest "$@"
