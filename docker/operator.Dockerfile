# syntax=docker/dockerfile:1
# The operator image: `kvfleet-operator` (kopf), without torch and without the model runtime.
# Build from the repository root (the context is the repository; .dockerignore keeps it small):
#   docker build -f docker/operator.Dockerfile -t kvfleet/kvfleet-operator:0.1.0 .
# Without a registry, PYTHON_IMAGE names a local base (docker/python-base.sh, scripts/images.sh).
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
# (the package's folders and README are empty here), so a change of the sources reinstalls
# nothing else.
# The operator's install set (the base and the `operator` extra: no torch, no matplotlib), at the
# lock's versions. tests/chart/test_images.py checks it against what `kvfleet_operator` imports.
COPY pyproject.toml requirements.lock /tmp/kvfleet-deps/
RUN python -m venv /opt/kvfleet \
 && cd /tmp/kvfleet-deps \
 && touch README.md \
 && python -c 'import pathlib, tomllib; [pathlib.Path(p).mkdir(parents=True) for p in tomllib.load(open("pyproject.toml", "rb"))["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]]' \
 && /opt/kvfleet/bin/pip install --constraint requirements.lock ".[operator]" \
 && /opt/kvfleet/bin/pip uninstall --yes kvfleet \
 && rm -rf /tmp/kvfleet-deps
COPY --from=build /wheels/ /opt/kvfleet-wheel/
RUN /opt/kvfleet/bin/pip install --no-deps --no-index /opt/kvfleet-wheel/kvfleet-*.whl
# HOME=/tmp: whatever a library caches goes to the writable /tmp the chart mounts; the root
# filesystem is read-only there.
ENV PATH=/opt/kvfleet/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
ENTRYPOINT ["kvfleet-operator"]
# The chart passes its own arguments (`run --liveness ...`); alone, the image runs the operator.
CMD ["run"]
