# The two commands of the README. Each creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: run test venv
venv: $(STAMP)

run: $(STAMP)
	$(PY) launch/run.py --mesh auto

test: $(STAMP)
	$(PY) -m pytest -q tests
