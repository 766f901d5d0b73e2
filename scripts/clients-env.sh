#!/usr/bin/env bash
# The load clients' environment (guidellm) for tests/router/test_load_clients.py: a client with
# its own pins (torch, transformers, datasets) lives beside the main venv, never in it. Built
# from requirements-clients.lock under $KVFLEET_HOME/clients-envs/<lock digest>, reused while
# the lock is unchanged. Prints its bin folder.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
lock="$KVFLEET_ROOT/requirements-clients.lock"
digest=$(sha256sum "$lock" | cut -c1-12)
env_dir="$KVFLEET_HOME/clients-envs/$digest"
uv="$KVFLEET_HOME/tools/bin/uv"
if [ ! -x "$uv" ]; then
    "$KVFLEET_ROOT/scripts/bootstrap.sh" >&2  # installs uv (and the main venv) first
fi
if [ ! -f "$env_dir/.complete" ]; then
    start=$(date +%s)
    mkdir -p "$KVFLEET_HOME/clients-envs"
    exec 9>"$KVFLEET_HOME/clients-envs/.lock"
    flock 9
    if [ ! -f "$env_dir/.complete" ]; then
        rm -rf "$env_dir"
        "$uv" venv -q --python 3.11 "$env_dir" >&2
        "$uv" pip sync -q --python "$env_dir/bin/python" "$lock" >&2
        touch "$env_dir/.complete"
        echo "clients env: built $env_dir in $(( $(date +%s) - start )) s" >&2
    fi
fi
echo "$env_dir/bin"
