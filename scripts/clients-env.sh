#!/usr/bin/env bash
# The load clients' environment (guidellm) for tests/router/test_load_clients.py: a client with
# its own pins (torch, transformers, datasets) lives beside the main venv, never in it. Built
# from requirements-clients.lock under $KVFLEET_HOME/clients-envs/<lock digest>, reused while
# the lock is unchanged. Prints its bin folder.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/locked-env.sh"
lock="$KVFLEET_ROOT/requirements-clients.lock"
digest=$(sha256sum "$lock" | cut -c1-12)
env_dir="$KVFLEET_HOME/clients-envs/$digest"
locked_env "$env_dir" "$lock"
echo "$env_dir/bin"
