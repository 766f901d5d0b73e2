#!/usr/bin/env bash
# Debian packages the test suite talks to for real: Redis and Prometheus servers.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# redis-cli joins the Redis Cluster the hint-index tests start (`redis-cli --cluster create`).
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  echo "system-deps: installing ${need[*]}"
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
fi
