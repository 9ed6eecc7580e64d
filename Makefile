# `make test` bootstraps uv (pip) and the locked environment, warms DeepSpeed's JIT ops once, lints, and runs
# the whole suite: unit tests, multi-rank torchrun runs on CPU, and (as root on Debian) the 2-node SLURM tests.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
UV := $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
PY := .venv/bin/python
export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
# One JIT-ops cache per checkout: checkouts sharing ~/.cache/torch_extensions rebuild each other's ops.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: test env tools warm lint gpu-check

# shellcheck lints the rendered launchers; the SLURM tests install their own packages (tests/slurm/cluster.sh).
tools:
	@command -v shellcheck >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -qq shellcheck >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq shellcheck; }; \
	  else echo "shellcheck is missing: install it (e.g. apt-get install shellcheck)" >&2; exit 1; fi; }

env: tools
	@python3 -m uv --version >/dev/null 2>&1 || command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@# Bytecode compiled here once (later syncs only add what changed): without .pyc files, and with
	@# PYTHONDONTWRITEBYTECODE set, every rank spends ~10 s compiling ~2,000 modules at each start.
	$(UV) sync --frozen --quiet --compile-bytecode

# DeepSpeed compiles its CPU ops on first use (~1-2 min each); do it once here, not inside a timed test.
# Through the same set-up as training (model_utils.kernels.prepare_jit_env: extensions dir, TORCH_CUDA_ARCH_LIST).
warm: env
	$(PY) -c "from model_utils import kernels; kernels.warm_deepspeed_ops(['ShareMemCommBuilder', 'CPUAdamBuilder'])"

lint: env
	.venv/bin/ruff format --check src tests examples
	.venv/bin/ruff check src tests examples

test: warm lint
	$(PY) -m pytest tests -q

# The acceptance of a GPU machine in under 10 minutes: the gpu tests, dskit bench against plain PyTorch and the
# default launcher; logs/gpu-check-*.json and .md (docs/speed.md). Without a GPU, its CPU subset.
gpu-check: warm
	$(PY) -m dskit.cli gpu-check
