#!/usr/bin/env bash
# Makes a local stand-in for python:3.11-slim-bookworm from Debian's own packages, for machines
# that reach Debian's archive but no container registry: a minimal bookworm with python3.11 and
# its venv module, committed as a local image. The Dockerfiles take it as PYTHON_IMAGE:
#   docker/python-base.sh localhost/kvfleet-python:3.11-bookworm
#   buildah bud --build-arg PYTHON_IMAGE=localhost/kvfleet-python:3.11-bookworm ...
# scripts/images.sh names the image after this file's digest, so the base is rebuilt only when
# this recipe changes. Needs root, debootstrap and buildah.
set -euo pipefail
tag="${1:?usage: python-base.sh IMAGE-NAME}"
# An empty mirror means debootstrap's default; set KVFLEET_DEBIAN_MIRROR to use a closer one.
mirror="${KVFLEET_DEBIAN_MIRROR:-}"

rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/kvfleet-base.XXXXXX")
cleanup() { rm -rf "$rootfs"; }
trap cleanup EXIT

# minbase: dpkg, apt and the essential set (passwd's groupadd/useradd, which the Dockerfiles
# run). Python comes from apt inside the new system rather than debootstrap's --include, which
# does not resolve python3.11-venv's dependencies. python-is-python3 gives the `python` command
# the official image has; python3.11-venv carries ensurepip, so `python -m venv` makes a venv with
# pip, as in the official image.
# shellcheck disable=SC2086
debootstrap --variant=minbase bookworm "$rootfs" $mirror >&2
chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
  sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends \
           python3.11 python3.11-venv python-is-python3 && apt-get clean' >&2
# What the official slim image leaves out too: package lists and the apt cache.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
       "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log

ctr=$(buildah from scratch)
# tar, not `buildah copy`: owners, modes and setuid bits stay as dpkg set them.
mnt=$(buildah mount "$ctr")
tar -C "$rootfs" -c . | tar -C "$mnt" -x --preserve-permissions --numeric-owner
buildah umount "$ctr" >/dev/null
# The official image's environment and default command.
buildah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd python3 \
  --label org.opencontainers.image.description="Debian bookworm with python3.11 (debootstrap)" \
  "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
