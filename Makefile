# `make run`, `make test`, `make lint` and `make docs` work on a fresh machine: they create
# .venv, install the project with its test and docs extras (again only when pyproject.toml
# changes), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/compare

.PHONY: run test test-fast lint docs install clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,docs]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.compare --workdir=$(WORKDIR)

PYTEST := $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder
# The sources' bytecode, written once: the suite starts some sixty Python processes
# (programs, notebook kernels, elastic runs), and where PYTHONDONTWRITEBYTECODE is set each
# would compile every module of jaxcomm, experiments and benchmarks (test_cli runs them)
# again (0.2 s of each start-up).
BYTECODE := $(PY) -m compileall -q jaxcomm experiments benchmarks

test: $(STAMP)
	$(BYTECODE)
	$(PYTEST) --durations=15 tests

# The edit loop: the unit tests, without the checks marked `slow` (subprocess runs,
# notebooks, reproductions, docstring examples, whole sharded models, training to a target);
# `make test` (and CI) runs those too.
test-fast: $(STAMP)
	$(BYTECODE)
	$(PYTEST) -m "not slow" tests

# pyflakes, the pycodestyle errors and warnings, 100-character lines ([tool.ruff] in
# pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff check jaxcomm experiments benchmarks tests colab docs setup.py

# The documentation site, warnings as errors: docs/_build/html/index.html.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf runs .pytest_cache docs/_build
