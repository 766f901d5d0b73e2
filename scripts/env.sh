# Sourced by the other scripts: where kvfleet's environment for THIS checkout lives.
# Heavy things live outside the clone, under KVFLEET_HOME; each checkout gets its own virtual
# environment there (uv hard-links packages from its cache, so a second one costs seconds), so
# that two clones on one machine never re-point each other's editable install.
KVFLEET_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
export KVFLEET_HOME="${KVFLEET_HOME:-$HOME/.cache/kvfleet}"
_checkout_id=$(printf '%s' "$KVFLEET_ROOT" | sha256sum | cut -c1-12)
export KVFLEET_VENV="${KVFLEET_VENV:-$KVFLEET_HOME/venvs/$_checkout_id}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$KVFLEET_HOME/uv}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$KVFLEET_HOME/pip}"
