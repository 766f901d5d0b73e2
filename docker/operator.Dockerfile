# syntax=docker/dockerfile:1
# The operator image: `kvfleet-operator` (kopf), without torch and without the model runtime.
# Build from the repository root (the context is the repository; .dockerignore keeps it small):
#   docker build -f docker/operator.Dockerfile -t kvfleet/kvfleet-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvfleet
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
# The operator's install set (the base and the `operator` extra: no torch, no matplotlib), at the
# lock's versions. tests/chart/test_images.py checks it against what `kvfleet_operator` imports.
RUN /opt/kvfleet/bin/pip install --constraint requirements.lock ".[operator]"

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
    PYTHONUNBUFFERED=1
USER 10001:10001
ENTRYPOINT ["kvfleet-operator"]
# The chart passes its own arguments (`run --liveness ...`); alone, the image runs the operator.
CMD ["run"]
