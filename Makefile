# Set-up and the two main commands. `make demo` and `make test` each create .venv and install
# everything on a fresh machine (torch==2.13.0 first: a newer torch would pull CUDA packages).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed

.PHONY: demo test install bench clean

demo: $(STAMP)
	$(VENV)/bin/tandem demo

# mypy (strict for tandem; its few exceptions are listed in pyproject.toml), then the whole suite
# on two processes (pytest-xdist; a test file stays on one, so its shared runs are made once),
# then its 25 slowest tests; one tier alone: `$(PY) -m pytest -m pure` (README)
test: $(STAMP)
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

bench: $(STAMP)
	$(PY) benchmarks/dp_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
