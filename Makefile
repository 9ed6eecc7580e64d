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

.PHONY: test test-fast env tools warm lint wheelhouse offline-check gpu-check
# make wheelhouse: every locked dependency as wheels, for an air-gapped cluster (WHEELHOUSE=DIR on the launchers).
# The target defaults to this machine; set WHEELHOUSE_PYTHON=3.12 WHEELHOUSE_MACHINE=aarch64 WHEELHOUSE_GLIBC=2.28
# for another. `make offline-check` builds it, then runs the air-gapped install test against it (docs/testing.md).
WHEELHOUSE_DIR ?= wheelhouse
WHEELHOUSE_OPTS := $(if $(WHEELHOUSE_PYTHON),--python $(WHEELHOUSE_PYTHON)) \
  $(if $(WHEELHOUSE_MACHINE),--machine $(WHEELHOUSE_MACHINE)) $(if $(WHEELHOUSE_GLIBC),--glibc $(WHEELHOUSE_GLIBC))

# As root on Debian, `make test` installs with apt-get what it needs and lacks, and first says what and why
# (nothing when all is there): shellcheck, which lints the rendered launchers (the render tests; `make lint` is ruff
# alone and needs none); ccache, optional, which `make warm` compiles DeepSpeed's ops through; and the packages of
# the 2-node SLURM test cluster, which tests/slurm/cluster.sh installs when those tests start (its PACKAGES).
# Not as root, a missing shellcheck stops it, and the SLURM tests are skipped.
SLURM_PACKAGES := $(shell sed -n 's/^readonly PACKAGES=(\(.*\))$$/\1/p' tests/slurm/cluster.sh)
tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  tools=(); for tool in shellcheck ccache; do command -v "$$tool" >/dev/null || tools+=("$$tool"); done; \
	  slurm=(); for pkg in $(SLURM_PACKAGES); do \
	    [ "$$(dpkg-query -W -f='$${Status}' "$$pkg" 2>/dev/null)" = "install ok installed" ] || slurm+=("$$pkg"); \
	  done; \
	  if [ $${#tools[@]} -gt 0 ] || [ $${#slurm[@]} -gt 0 ]; then \
	    echo "As root on Debian, the tests install with apt-get what they lack (with its dependencies):"; \
	    for tool in "$${tools[@]}"; do case $$tool in \
	      shellcheck) echo "  shellcheck, now: it lints the rendered launchers";; \
	      ccache) echo "  ccache, now: DeepSpeed's ops compile through it, for other checkouts here to reuse" \
	        "(ops built before it are rebuilt once)";; \
	    esac; done; \
	    [ $${#slurm[@]} -eq 0 ] || echo "  $${slurm[*]}, when the SLURM tests start (make test):" \
	      "their 2-node cluster on this machine (tests/slurm/cluster.sh)"; \
	  fi; \
	  for tool in "$${tools[@]}"; do \
	    apt-get install -y -qq "$$tool" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "$$tool"; } \
	      || [ "$$tool" = ccache ]; \
	  done; \
	elif ! command -v shellcheck >/dev/null; then \
	  echo "shellcheck is missing: install it (e.g. apt-get install shellcheck)" >&2; exit 1; \
	fi

env:
	@python3 -m uv --version >/dev/null 2>&1 || command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@# Bytecode compiled here once (later syncs only add what changed): without .pyc files, and with
	@# PYTHONDONTWRITEBYTECODE set, every rank spends ~10 s compiling ~2,000 modules at each start.
	$(UV) sync --frozen --quiet --compile-bytecode
	@$(PY) -m dskit.env.lock_stamp write  # the launchers then skip their uv sync (src/dskit/env/lock_stamp.py)

# DeepSpeed compiles its CPU ops on first use (~1-2 min each); do it once here, not inside a timed test.
# Through the same set-up as training (model_utils.launch.ops.prepare_jit_env: extensions dir, TORCH_CUDA_ARCH_LIST).
# One process per op, side by side: each compiles on one core (torch's file lock is per op).
# torch compiles through ccache where it is on PATH (`make tools` installs it as root on Debian): with the
# checkout as ccache's base dir (its paths made relative, the -g build dir not hashed) another checkout on this
# machine takes the compiled objects from the cache (~70 s of compiling -> ~3 s).
# The ops of the embedded default on CPU ranks, as the engine names them (engines.jit_ops; tests/unit/launch/
# test_ops.py holds this list to it).
WARM_OPS := ShareMemCommBuilder CPUAdamBuilder
warm: env
	@export CCACHE_BASEDIR="$(CURDIR)" CCACHE_NOHASHDIR=1; \
	pids=(); for op in $(WARM_OPS); do \
	  $(PY) -c "from model_utils.launch import ops; ops.warm_deepspeed_ops(['$$op'])" & pids+=($$!); \
	done; status=0; for pid in "$${pids[@]}"; do wait "$$pid" || status=$$?; done; exit "$$status"

lint: env
	.venv/bin/ruff format --check src tests examples tools
	.venv/bin/ruff check src tests examples tools

# Two tiers side by side (tools/test_tiers.py): the SLURM and launcher tests mostly wait, the rest computes.
test: tools warm lint
	$(PY) tools/test_tiers.py

# The edit loop: ruff and the unit tier (tests/unit mirrors src/: no engine built, no multi-rank run, no DeepSpeed
# op build, so no warm), under 2 minutes on 2 cores (docs/testing.md).
test-fast: tools lint
	$(PY) -m pytest tests/unit -q

wheelhouse: env
	$(PY) -m dskit.cli wheelhouse build $(WHEELHOUSE_DIR) $(WHEELHOUSE_OPTS)

# The air-gapped path for real: install from wheelhouse/ with no network, train through both launchers (~3.5 min).
offline-check: warm
	$(MAKE) wheelhouse WHEELHOUSE_DIR=wheelhouse
	DSKIT_TEST_WHEELHOUSE=$(CURDIR)/wheelhouse $(PY) -m pytest tests/slurm/test_slurm.py -k offline -q -rA

# The acceptance of a GPU machine in under 10 minutes: the gpu tests, dskit bench against plain PyTorch and the
# default launcher; logs/gpu-check-*.json and .md (docs/speed.md). Without a GPU, its CPU subset. With DSKIT_PYTHON
# and/or WHEELHOUSE set, in the environment the launchers would make of them (no uv sync, no network).
gpu-check:
ifeq ($(DSKIT_PYTHON)$(WHEELHOUSE),)
	$(MAKE) warm
	$(PY) -m dskit.cli gpu-check
else
	$(if $(WHEELHOUSE),PYTHONPATH=src $(or $(DSKIT_PYTHON),python3) -m dskit.env.wheelhouse install $(WHEELHOUSE) \
	  --venv .venv $(if $(DSKIT_PYTHON),--overlay) --test_tools)
	PYTHONPATH=src $(if $(WHEELHOUSE),.venv/bin/python,$(DSKIT_PYTHON)) -m dskit.cli gpu-check
endif
