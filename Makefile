# The two commands of the README. Both do all set-up first (scripts/setup.sh, idempotent).
.PHONY: run test test-all setup

CONFIG ?= configs/tiny.toml

run: setup
	.venv/bin/kiln run --config $(CONFIG) $(ARGS)

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# Also the slow tier (marked `slow`); GPU tests skip themselves without a GPU.
test-all: setup
	.venv/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

setup:
	@./scripts/setup.sh
