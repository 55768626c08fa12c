# polar-vit-hf: the two commands of the README quickstart.
#   make demo   - the project's main job: the digits training demo, then the precision table
#   make test   - ruff (line length 119) and the whole test suite on two pytest-xdist workers (installs what it needs first)
# Both are idempotent: the virtual environment is (re)built only when setup.cfg changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,train,triton,spherical]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) training/demo.py --output_dir outputs/demo
	$(PY) benchmarks/precision.py --out outputs/precision

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --durations=15

clean:
	rm -rf $(VENV) outputs .pytest_cache .hypothesis
