# Sourced by the scripts that build an environment beside the main venv (a tool that pins its own
# torch never goes into it): `locked_env DIR LOCK [ENTRY]` builds DIR from the pinned LOCK once
# (under a file lock beside DIR, so two checkouts share the build), writes ENTRY (a Python file)
# as DIR/bin/vllm when given, and stamps DIR/.complete; later calls reuse it.
locked_env() {
    local env_dir=$1 lock=$2 entry=${3:-} uv="$KVFLEET_HOME/tools/bin/uv" start
    if [ ! -x "$uv" ]; then
        "$KVFLEET_ROOT/scripts/bootstrap.sh" >&2  # installs uv (and the main venv) first
    fi
    [ -f "$env_dir/.complete" ] && return 0
    start=$(date +%s)
    mkdir -p "$(dirname "$env_dir")"
    exec 9>"$(dirname "$env_dir")/.lock"
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
        echo "env: built $env_dir in $(( $(date +%s) - start )) s" >&2
    fi
    exec 9>&-
}
