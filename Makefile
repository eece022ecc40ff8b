# `make demo` and `make test` from a fresh clone; both build .venv first when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Where this machine has it, torch 2.13.0 is the CPU wheel; a bare `torch` would pull CUDA.
TORCH_PIN ?= torch==2.13.0
DEEPSPEED_PIN ?= deepspeed==0.19.8
# megatron-core >= 0.17 needs Python >= 3.12; 0.16.1 is the newest for 3.11.
MEGATRON_PIN ?= megatron-core==0.16.1

.PHONY: install demo test clean-shm

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet "$(TORCH_PIN)" "$(DEEPSPEED_PIN)" "$(MEGATRON_PIN)" -e ".[deepspeed,megatron,test,bench]"
	touch $@

demo: install
	DS_ACCELERATOR=cpu $(PY) -m examples.deepspeed.demo

test: install
	$(PY) -m pytest -q -ra tests

clean-shm: install
	$(VENV)/bin/ftmem clean --all
