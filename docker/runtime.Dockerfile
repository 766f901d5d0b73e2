# syntax=docker/dockerfile:1
# The runtime image: `kvfleet replica` (the GPU pods with the prefix-KV cache) and `kvfleet router`.
# Build from the repository root (the context is the repository; .dockerignore keeps it small):
#   docker build -f docker/runtime.Dockerfile -t kvfleet/kvfleet-runtime:0.1.0 .
# Without a registry, PYTHON_IMAGE names a local base (docker/python-base.sh, scripts/images.sh).
#
# The torch base is the lock's torch itself: requirements.lock pins torch with its CUDA wheels
# (nvidia-cuda-runtime, cuDNN, cuBLAS, NCCL), so this image runs on a GPU node whose driver the
# NVIDIA container toolkit mounts, with exactly the versions the test suite ran. A pytorch/pytorch
# base would bring a second torch of another version under the lock's one.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# kvfleet's own wheel, built from the sources alone (build tools stay in this stage).
FROM ${PYTHON_IMAGE} AS build
ARG PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Unset unless given: a CA bundle for pip where a TLS-intercepting proxy stands between the build
# and the package index (scripts/images.sh passes the host's).
ARG PIP_CERT
RUN python -m venv /opt/build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# ARG, not ENV: pip's settings for the build only, not the running image's environment.
ARG PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_CERT
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvfleet
# The dependencies first, in a layer of their own that only pyproject.toml and the lock decide
# (the package's folders and README are empty here), so a change of the sources does not
# reinstall torch.
# The replica's and the router's install set (the base, the `replica` extra, and `gateway` for
# `kvfleet epp`), every version pinned by the lock (the lock also names the lab and dev tools; a
# constraint only pins what is installed, so they stay out).
COPY pyproject.toml requirements.lock /tmp/kvfleet-deps/
RUN python -m venv /opt/kvfleet \
 && cd /tmp/kvfleet-deps \
 && touch README.md \
 && python -c 'import pathlib, tomllib; [pathlib.Path(p).mkdir(parents=True) for p in tomllib.load(open("pyproject.toml", "rb"))["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]]' \
 && /opt/kvfleet/bin/pip install --constraint requirements.lock ".[replica,gateway]" \
 && /opt/kvfleet/bin/pip uninstall --yes kvfleet \
 && rm -rf /tmp/kvfleet-deps
COPY --from=build /wheels/ /opt/kvfleet-wheel/
RUN /opt/kvfleet/bin/pip install --no-deps --no-index /opt/kvfleet-wheel/kvfleet-*.whl
# HOME=/tmp: whatever a library caches (torch, triton) goes to the writable /tmp the chart mounts;
# the root filesystem is read-only there.
ENV PATH=/opt/kvfleet/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 8000
# The chart passes the subcommand: `replica --model-dir ... --port ...` or `router ...`.
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
