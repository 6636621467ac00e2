# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from local disk on kvtier's CI machines); on a CUDA host, install
# your CUDA torch first and `pip install -e .[gpu,server]` instead.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test lint clean
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/kvtier demo

test: install
	./tests/install-servers.sh
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

lint: install
	$(VENV)/bin/ruff check engine cachestore tiers connectors tests bench

clean:
	rm -rf $(VENV) build *.egg-info
