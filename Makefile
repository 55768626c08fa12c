# polar-vit-hf: the two commands of the README quickstart, and the checks around them.
#   make demo       - the project's main job: the digits training demo, then the precision table
#   make test       - lint, the documentation build and the whole test suite on two pytest-xdist workers
#   make test-fast  - the suite without the slow tests (processes, end-to-end training, compiles)
#   make lint       - ruff check, ruff format --check, mypy on modeling/ and polar_vit_hf/
#   make docs       - mkdocs build --strict (a broken link or anchor fails)
# Every target installs what it needs first; the virtual environment is (re)built only when setup.cfg changes.
# `install` also fetches the tests of the installed transformers' source distribution (transformers' own common
# model tests, run on Polar-ViT by tests/test_transformers_common.py) into .venv/transformers-sdist/.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SDIST  := $(VENV)/transformers-sdist

.PHONY: demo test test-fast lint docs install clean

install: $(SDIST)/.fetched

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,train,triton,spherical,onnx,docs]"
	@touch $(STAMP)

$(SDIST)/.fetched: $(STAMP)
	rm -rf $(SDIST) && mkdir -p $(SDIST)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(SDIST) \
		"transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
	tar -xzf $(SDIST)/transformers-*.tar.gz -C $(SDIST) --wildcards '*/tests/*'
	@touch $@

demo: install
	$(PY) training/demo.py --output_dir outputs/demo
	$(PY) benchmarks/precision.py --out outputs/precision

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

docs: install
	$(PY) -m mkdocs build --strict --quiet

test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow" --durations=10

test: lint docs
	$(PY) -m pytest -q -n 2 --durations=15

clean:
	rm -rf $(VENV) outputs .pytest_cache .hypothesis .mypy_cache
