#!/usr/bin/env bash
# The peer routers `kvfleet bench fronts` compares kvfleet's router with, each in an environment of
# its own beside the main venv (they pin their own web stacks): built from
# requirements-front-NAME.lock under $KVFLEET_HOME/fronts-envs/NAME-<lock digest>, reused while the
# lock is unchanged. Prints the env's bin folder.
#   scripts/fronts-env.sh vllm-router     the production-stack's vllm-router (PyPI 0.1.17)
#   scripts/fronts-env.sh sglang-router   sglang's router (PyPI 0.3.2)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/locked-env.sh"
case "${1:-}" in
    vllm-router|sglang-router) name=$1 ;;
    *) echo "usage: scripts/fronts-env.sh vllm-router|sglang-router" >&2; exit 2 ;;
esac
lock="$KVFLEET_ROOT/requirements-front-$name.lock"
digest=$(sha256sum "$lock" | cut -c1-12)
env_dir="$KVFLEET_HOME/fronts-envs/$name-$digest"
locked_env "$env_dir" "$lock"
echo "$env_dir/bin"
