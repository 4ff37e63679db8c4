# The two commands of the README. Each creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,gpu-aot,ray]'  # gpu-aot: the deviceless XLA:GPU test; ray: --launcher ray's
	touch $(STAMP)

.PHONY: run test test-fast venv
venv: $(STAMP)

run: $(STAMP)
	$(PY) launch/run.py --mesh auto

# Everything, the slow tests too (kill/resume, multi-host): what CI runs. Three workers on CI's two cores
# (pytest-xdist, one test file per worker at a time): the tests are compile-bound and XLA compiles on one core, but
# the launched tests wait on their processes (detection timeouts, restarts) ~10% of the time, which a third worker
# fills (2 workers: 1,224 s of tests at 174% CPU; 3: 1,198 s at 187%, 2026-12-05); --durations: the slowest tests.
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=25 -m "slow or not slow" tests

# The default suite without the tests marked slow (development loop).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests
