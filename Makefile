# The two commands of the README. Both do all set-up first (scripts/setup.sh, idempotent).
.PHONY: run test test-all lint format setup

CONFIG ?= configs/tiny.toml

run: setup
	.venv/bin/kiln run --config $(CONFIG) $(ARGS)

# The formatter and the linter first (ruff.toml): CI fails on a violation before the tests run.
test: setup lint
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# Also the slow tier (marked `slow`), which holds the compose tier (marked `compose`: a real
# `docker compose up` of the smoke preset, tests/test_compose_live.py); GPU tests skip
# themselves without a GPU, the compose tier without Docker.
test-all: setup lint
	.venv/bin/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

# Rewrites the tree to the formatter and the linter's fixes.
format: setup
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

setup:
	@./scripts/setup.sh
