# `make demo` and `make test` do the whole set-up on a fresh machine (see README).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint

setup:
	bash scripts/setup_env.sh

demo: setup
	$(VENV)/bin/diffkv demo

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check diffkv tests benchmarks scripts
