# syntax=docker/dockerfile:1
# The runtime image: `kvfleet replica` (the GPU pods with the prefix-KV cache) and `kvfleet router`.
# Build from the repository root (the context is the repository; .dockerignore keeps it small):
#   docker build -f docker/runtime.Dockerfile -t kvfleet/kvfleet-runtime:0.1.0 .
#
# The torch base is the lock's torch itself: requirements.lock pins torch with its CUDA wheels
# (nvidia-cuda-runtime, cuDNN, cuBLAS, NCCL), so this image runs on a GPU node whose driver the
# NVIDIA container toolkit mounts, with exactly the versions the test suite ran. A pytorch/pytorch
# base would bring a second torch of another version under the lock's one.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvfleet
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# The replica's and the router's install set (the base and the `replica` extra), every version
# pinned by the lock (the lock also names the lab and dev tools; a constraint only pins what is
# installed, so they stay out).
RUN /opt/kvfleet/bin/pip install --constraint requirements.lock ".[replica]"

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvfleet
COPY --from=build /opt/kvfleet /opt/kvfleet
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
