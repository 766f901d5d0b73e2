#!/usr/bin/env bash
# vLLM's own environment for the kvfleet connector's tests (tests/vllm): vllm pins its own torch,
# so it lives beside the main venv, never in it. Built from requirements-vllm.lock (pinned) under
# $KVFLEET_HOME/vllm-envs/<lock digest>, reused while the lock is unchanged. Prints its python.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
lock="$KVFLEET_ROOT/requirements-vllm.lock"
digest=$(sha256sum "$lock" | cut -c1-12)
env_dir="$KVFLEET_HOME/vllm-envs/$digest"
uv="$KVFLEET_HOME/tools/bin/uv"
if [ ! -x "$uv" ]; then
    "$KVFLEET_ROOT/scripts/bootstrap.sh" >&2  # installs uv (and the main venv) first
fi
if [ ! -f "$env_dir/.complete" ]; then
    start=$(date +%s)
    rm -rf "$env_dir"
    mkdir -p "$KVFLEET_HOME/vllm-envs"
    exec 9>"$KVFLEET_HOME/vllm-envs/.lock"
    flock 9
    if [ ! -f "$env_dir/.complete" ]; then
        "$uv" venv -q --python 3.11 "$env_dir" >&2
        "$uv" pip sync -q --python "$env_dir/bin/python" "$lock" >&2
        touch "$env_dir/.complete"
        echo "vllm env: built $env_dir in $(( $(date +%s) - start )) s" >&2
    fi
fi
echo "$env_dir/bin/python"
