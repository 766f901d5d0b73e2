# The two commands a new machine needs (see README): `make demo` and `make test`.
# Each installs what it needs by itself, then runs.
SHELL := /bin/bash
KVFLEET_HOME ?= $(HOME)/.cache/kvfleet
VENV ?= $(KVFLEET_HOME)/venv
export KVFLEET_HOME
export KVFLEET_VENV := $(VENV)

.PHONY: demo test setup system-deps cluster-bins check lock

demo: setup
	$(VENV)/bin/kvfleet breakeven

test: setup system-deps cluster-bins
	scripts/check.sh

setup:
	scripts/bootstrap.sh

system-deps:
	scripts/system-deps.sh

cluster-bins:
	@if [ -x tests/cluster/build.sh ]; then tests/cluster/build.sh; fi

check:
	scripts/check.sh

# Regenerate the lock after changing dependencies in pyproject.toml.
lock: setup
	$(KVFLEET_HOME)/tools/bin/uv pip compile pyproject.toml --extra dev --python-version 3.11 \
		--python-platform x86_64-unknown-linux-gnu -q -o requirements.lock
