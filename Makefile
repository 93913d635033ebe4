# Two commands do all the set-up: `make demo` and `make test`. Each creates .venv
# with what it needs. PYTHON may name any Python 3.10 or newer. `make docs` builds
# the documentation alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo echo-demo test lint docs unit bench scorecard clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[servers,test,bench,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m loadtest demo

echo-demo: $(STAMP)
	$(PY) -m loadtest.echo_demo

test: lint docs unit

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# The documentation site (Sphinx), warnings as errors: docs/_build/html/index.html.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

# Two pytest processes, each taking whole files (their module fixtures stay shared):
# the suite mostly waits on real servers and clients, so it takes about half the time
# on two cores. `make unit WORKERS=0` runs it in one process.
WORKERS ?= 2
unit: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) -m pytest -q benchmarks/checks
	$(PY) -m pytest -q -m bench tests
	$(PY) -m benchmarks.core

# The speed and memory targets against Mosquitto, uvicorn[standard] and granian, judged
# (about ten minutes a round; needs Mosquitto installed).
scorecard: $(STAMP)
	$(PY) -m loadtest scorecard --rounds 2

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis docs/_build
