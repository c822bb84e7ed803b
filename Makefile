# `make run` and `make test` work on a fresh machine: they create .venv, install the
# project with its test extra (again only when pyproject.toml changes), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/compare

.PHONY: run test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.compare --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -n 2 --durations=15 tests

clean:
	rm -rf runs .pytest_cache
