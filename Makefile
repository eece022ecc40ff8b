# `make demo` and `make test` from a fresh clone; both build .venv first when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Where this machine has it, torch 2.13.0 is the CPU wheel; a bare `torch` would pull CUDA.
TORCH_PIN ?= torch==2.13.0
DEEPSPEED_PIN ?= deepspeed==0.19.8
# megatron-core >= 0.17 needs Python >= 3.12; 0.16.1 is the newest for 3.11.
MEGATRON_PIN ?= megatron-core==0.16.1

.PHONY: install demo test test-faults test-compat test-peer test-slurm test-gpu clean-shm megatron-lm docs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet "$(TORCH_PIN)" "$(DEEPSPEED_PIN)" "$(MEGATRON_PIN)" -e ".[deepspeed,megatron,test,bench,docs]"
	touch $@

demo: install
	DS_ACCELERATOR=cpu $(PY) -m examples.deepspeed.demo

# Megatron-LM 0.19.2's own training package, only to test ftmem against it on this Python
# 3.11 (tests/harness/megatron_lm/build_env.py says what it changes); a cluster installs Megatron-LM
# as usual, on Python >= 3.12.
MLM := .mlm

megatron-lm: $(MLM)/.built

$(MLM)/.built: $(VENV)/.installed tests/harness/megatron_lm/build_env.py patches/megatron-lm-0.19.2-ftmem.patch
	mkdir -p $(MLM)
	$(PY) tests/harness/megatron_lm/build_env.py $(MLM)
	touch $@

# Every tier (tests/unit, tests/integration, tests/faults; tests/gpu skips without CUDA), with
# the random-kill loops in their short, seeded form: each victim kind and moment kind once.
# Two pytest sessions run side by side, the DeepSpeed and Megatron integration tests in one and
# the rest in the other: their tests wait on ranks, stores and timeouts for much of their time,
# and each session's shared memory, SMPs, ports and namespaces are its own (a test must pass
# beside another run of the suite). The first session's output follows the second's.
# The fault campaign's lines go to build/fault-campaign-<session>.json (tests/harness/campaign.py).
# As root, the suite's processes resolve names from /etc/hosts alone: torch's store looks up
# each new connection by name on its one serving thread, and a resolver that drops queries
# stalls it past the tests' 4 s detector timeouts (tests/harness/names_from_files.py).
FRAMEWORK_TESTS := tests/integration/deepspeed tests/integration/megatron
NAMES_FROM_FILES = $(shell $(PY) -m tests.harness.names_from_files build/names)
PYTEST_ALL = $(NAMES_FROM_FILES) $(PY) -m pytest -q -ra --durations=30
test: install megatron-lm
	mkdir -p build
	$(PYTEST_ALL) --fault-report build/fault-campaign-1.json $(FRAMEWORK_TESTS) > build/test-1.log 2>&1 & first=$$!; \
	$(PYTEST_ALL) --fault-report build/fault-campaign-2.json --ignore=tests/slurm $(FRAMEWORK_TESTS:%=--ignore=%) tests; \
	second=$$?; wait $$first; first=$$?; echo "== $(FRAMEWORK_TESTS), side by side with the above:"; \
	cat build/test-1.log; [ $$first -eq 0 ] && [ $$second -eq 0 ]

# The fault campaign: every test marked `fault`, the random-kill loops at full length (20 and
# 10 kills per loop); its table in docs/design/fault-matrix.md is rewritten from the run, as
# it went, and the target fails if a test did.
test-faults: install megatron-lm
	$(PY) -m pytest -q -ra --durations=30 --full-faults -m fault --fault-report build/fault-campaign.json tests; \
	status=$$?; $(PY) -m tests.harness.campaign build/fault-campaign.json && exit $$status

# ftmem under a real Slurm (tests/slurm, tests/harness/slurm.py): slurmctld and three slurmd on
# this machine, each node a network, mount and UTS namespace of its own, running the sbatch script
# of examples/slurm. Needs root; installs Debian's slurm-wlm and munge where they are missing.
test-slurm: install
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
	$(PY) -m pytest -q -ra --durations=30 tests/slurm

# The compatibility matrix's smoke tier (tests/harness/compat_matrix.py, the tests marked
# `compat`) on each version set of docs/compatibility.md, each in a fresh environment from the
# package index under build/compat; its table goes to build/compat/matrix.md. SETS="a b" runs
# only those. Not part of `make test`: it downloads several GB (older torch are CUDA wheels).
SETS ?=
test-compat: install megatron-lm
	$(PY) tests/harness/compat_matrix.py $(SETS)

# DeepSpeed's own tests/unit/checkpoint (tests/harness/peer_suite.py), stock and with ftmem forced
# through the JSON alone, on the pinned DeepSpeed and the oldest supported, each in its own
# environment under build/peer; the test tree is fetched once from DEEPSPEED_GIT at the pinned tag.
# PEER_SETS="pinned" runs one set, PEER_ARGS="--tests PATH -k EXPR" some tests. Not part of
# `make test`: several hours on 2 cores for the whole folder.
PEER_SETS ?= pinned oldest
PEER_ARGS ?=
test-peer: install
	$(PY) tests/harness/peer_suite.py --sets $(PEER_SETS) $(PEER_ARGS)

clean-shm: install
	$(VENV)/bin/ftmem clean --all

# The documentation site (mkdocs.yml, docs/) into build/site; --strict fails on a broken link.
docs: install
	$(PY) -m mkdocs build --strict --site-dir build/site

# The GPU tests (tests/gpu/test_gpu.py, marked gpu; skipped by `make test` without CUDA) in a venv
# of their own. It sees the system's packages: a GPU machine's image usually holds a CUDA
# build of torch, and nothing may be fetchable there. Where its python3 has no CUDA torch,
# the venv gets PyPI's default Linux torch wheel, which is a CUDA build.
# --system-site-packages lends the base interpreter's packages only; where $(PYTHON) is
# itself a venv (as on this project's GPU machines), a .pth file lends its own.
# Offline (as the lent GPU machines are), GPU_WHEELS=DIR names a folder of wheels (and
# DeepSpeed's sdist) to install from instead of the package index.
VENV_GPU := .venv-gpu
GPU_WHEELS ?=
GPU_PIP_SOURCE := $(if $(GPU_WHEELS),--no-index --find-links $(GPU_WHEELS),)
PY_GPU := $(VENV_GPU)/bin/python

$(VENV_GPU)/.installed: Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV_GPU)
	$(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
		> "$$($(PY_GPU) -c 'import site; print(site.getsitepackages()[0])')/ftmem-gpu-base.pth"
	$(PY_GPU) -c "import torch, numpy, xxhash, pyeclib, pytest, pytest_timeout; assert torch.cuda.is_available()" || \
		$(PY_GPU) -m pip install --quiet $(GPU_PIP_SOURCE) torch numpy xxhash "pyeclib>=1.6" pytest pytest-timeout
	$(PY_GPU) -c "import deepspeed, megatron.core" 2>/dev/null || DS_BUILD_OPS=0 $(PY_GPU) -m pip install --quiet \
		--no-build-isolation $(GPU_PIP_SOURCE) "$(DEEPSPEED_PIN)" "$(MEGATRON_PIN)"
	touch $@

test-gpu: $(VENV_GPU)/.installed
	PYTHONPATH=$(CURDIR) $(PY_GPU) -m pytest -q -ra -m gpu tests/gpu/test_gpu.py
