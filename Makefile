# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first (idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# megatron-core >= 0.17 needs Python 3.12: take python3.12 from PATH, else pyenv's.
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)

.PHONY: setup test demo lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found (megatron-core needs it)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.11.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check policyworker tests benchmarks gpu_tests
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m policyworker demo --out runs/demo

lint: $(STAMP)
	$(PY) -m ruff check policyworker tests benchmarks gpu_tests
	$(PY) -m ruff format --check policyworker tests benchmarks gpu_tests

format: $(STAMP)
	$(PY) -m ruff format policyworker tests benchmarks gpu_tests
	$(PY) -m ruff check --fix policyworker tests benchmarks gpu_tests

clean:
	rm -rf $(VENV) runs .pytest_cache
