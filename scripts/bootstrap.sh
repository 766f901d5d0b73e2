#!/usr/bin/env bash
# Creates (once per machine) the Python environment kvfleet runs in, outside the clone, and
# installs this checkout into it. Heavy wheels (torch) are cached under ~/.cache/kvfleet.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$KVFLEET_ROOT"
VENV="$KVFLEET_VENV"
UV_VERSION=0.13.8

python=""
for candidate in python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 \
     && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    python="$candidate"; break
  fi
done
if [ -z "$python" ]; then
  echo "bootstrap: kvfleet needs Python >= 3.11 (none found on PATH)" >&2
  exit 1
fi

# uv lives in its own small environment: `uv pip sync` removes whatever the lock does not name.
TOOLS="$KVFLEET_HOME/tools"
UV="$TOOLS/bin/uv"
if ! "$UV" --version 2>/dev/null | grep -q "$UV_VERSION"; then
  mkdir -p "$KVFLEET_HOME"
  "$python" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$UV" venv -q --python "$python" "$VENV"
fi

# The lock pins every transitive dependency; sync only when it changed.
stamp="$VENV/.kvfleet-lock.sha256"
want=$(sha256sum requirements.lock | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing the locked dependencies (first run downloads torch; later runs reuse it)"
  VIRTUAL_ENV="$VENV" "$UV" pip sync -q --python "$VENV/bin/python" requirements.lock
  echo "$want" > "$stamp"
fi
# Always re-point the editable installs at this checkout: CI clones into another folder. Two
# distributions: the product (.) and the lab (lab/: its `kvfleet bench`, `demo` and `simulate`).
VIRTUAL_ENV="$VENV" "$UV" pip install -q --python "$VENV/bin/python" --no-deps -e . -e ./lab
