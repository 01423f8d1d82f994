# The two set-up commands the README promises (`make help` lists the others):
#   make train   a real 2-rank training run on localhost (creates .venv on first use)
#   make test    the whole test suite (CI runs it after `make lint`, via .ci/run)
PYTHON ?= python3
VENV   ?= .venv
# Which torch build the set-up installs: cpu (default; ~1.5 GB from PyTorch's CPU wheel index, or a CPU wheel
# already on disk) or cuda (PyPI's Linux build, which bundles CUDA; ~5 GB). TORCH_INDEX picks another index,
# e.g. TORCH=cuda TORCH_INDEX=https://download.pytorch.org/whl/cu126 for a given CUDA version (TORCH=cuda
# without it uses pip's usual index).
TORCH         ?= cpu
TORCH_VERSION ?= 2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hora-installed
NP     ?= 2
PYTEST_ARGS ?=

ifeq ($(TORCH),cpu)
TORCH_SPEC    := torch==$(TORCH_VERSION)+cpu
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
else ifeq ($(TORCH),cuda)
TORCH_SPEC    := torch==$(TORCH_VERSION)
TORCH_INDEX   ?=
else
$(error TORCH=$(TORCH): choose TORCH=cpu or TORCH=cuda)
endif

.PHONY: help train test test-fast test-gpu test-gpu-sanitizer lint bench bench-quick torch system-deps clean image image-cuda

help:  ## list the targets
	@echo "make train         a real 2-rank training run on localhost (NP=4 for 4 ranks; sets up .venv on first use)"
	@echo "make test          the whole test suite, as CI runs it (PYTEST_ARGS='-x -k name' to narrow it)"
	@echo "make test-fast     unit, single-host distributed, bench and docs tests, a few minutes: the edit loop"
	@echo "make test-gpu      the GPU suite (tests marked gpu; on a machine with CUDA GPUs and TORCH=cuda)"
	@echo "make test-gpu-sanitizer  the GPU suite under torch's CUDA sanitizer (stream races are errors)"
	@echo "make lint          ruff, mypy and the layer contracts (lint-imports) (CI runs it before make test)"
	@echo "make bench-quick   every benchmark on its smallest settings, a minute or two; reports go to out/bench-quick/"
	@echo "make bench         the full benchmarks (many minutes); reports go to benchmarks/results/"
	@echo "make image         build the CPU container image localhost/hora:cpu (from Docker Hub's Debian, or from"
	@echo "                   Debian packages where Docker Hub is unreachable) and run hora check in it"
	@echo "make image-cuda    the same for the CUDA image localhost/hora:cuda"
	@echo "make clean         remove .venv and build files"
	@echo "variables: TORCH=cpu|cuda (torch build for .venv, default cpu), TORCH_VERSION=$(TORCH_VERSION), NP=$(NP)"

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@$(MAKE) --no-print-directory torch
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

# torch first, from the index of the chosen build; a matching wheel already on disk (pip's find-links) is used
# without downloading it (its small dependencies come from the usual index). Later installs keep it:
# requirements-dev.txt and pyproject.toml only ask for torch>=2.1.
torch:
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' and (torch.version.cuda is None) == ('$(TORCH)' == 'cpu') else 1)" 2>/dev/null; then \
		echo "torch $(TORCH_VERSION) ($(TORCH) build) is already installed"; \
	else \
		echo "installing torch $(TORCH_VERSION), $(TORCH) build: a large download, once (TORCH=cpu|cuda picks the build)"; \
		if $(BIN)/python -m pip install --quiet --no-index --no-deps "$(TORCH_SPEC)" 2>/dev/null; then \
			$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"; \
		else \
			$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
		fi; \
	fi

train: $(STAMP)
	$(BIN)/hora run -np $(NP) $(BIN)/python examples/train_digits.py

# Multi-host tests build hosts from network namespaces with their own sshd: they need root, iproute2 and
# openssh-server. The deployment tests (tests/deploy) need podman, runc, mmdebstrap and iptables (containers) and
# slurm-wlm and munge (a Slurm cluster); the Spark tests (tests/frameworks) need Java 17. Installed here when missing
# (root with apt only). Locally a tool still missing afterwards is named and the tests needing it skip and say why;
# under CI (the CI variable set) it fails the run, naming the tool, since a skipped multi-host suite would make a
# green run a lie.
SYSTEM_DEPS := openssh-server iproute2 podman runc buildah mmdebstrap iptables netavark aardvark-dns uidmap \
               slurm-wlm munge podman-compose catatonit openjdk-17-jre-headless
SYSTEM_TOOLS := /usr/sbin/sshd /usr/sbin/ip /usr/bin/podman /usr/sbin/runc /usr/bin/mmdebstrap /usr/sbin/iptables \
                /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/podman-compose /usr/bin/catatonit \
                /usr/bin/java
APT_GET ?= apt-get
SYSTEM_DEPS_LOG ?= /tmp/hora-system-deps.log
system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do [ -x "$$t" ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = "0" ] && command -v $(APT_GET) >/dev/null; then \
		echo "installing system packages for the multi-host and deployment tests (missing:$$missing)"; \
		if { $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq \
				--no-install-recommends $(SYSTEM_DEPS); } >$(SYSTEM_DEPS_LOG) 2>&1; then \
			systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; \
		else \
			echo "apt-get install failed; its output:"; tail -n 20 $(SYSTEM_DEPS_LOG); \
		fi; \
		missing=""; for t in $(SYSTEM_TOOLS); do [ -x "$$t" ] || missing="$$missing $$t"; done; \
	fi; \
	if [ -n "$$missing" ]; then \
		case "$${CI:-}" in \
		""|0|false|False|FALSE|no) \
			echo "warning: missing$$missing; the tests needing them skip (as root with apt, make system-deps installs them)";; \
		*) \
			echo "error: CI is set and these tools are missing:$$missing. The multi-host and deployment tests need" \
			     "them; run make system-deps as root on a Debian/Ubuntu machine (packages: $(SYSTEM_DEPS))" >&2; \
			exit 1;; \
		esac; \
	fi

# -v: each test's name is printed as it starts, and a failure's cause right under it (tests/plugins/progress.py)
test: $(STAMP) system-deps
	$(BIN)/python -m pytest -v $(PYTEST_ARGS)

# The edit loop: pure logic and the fork-harness tests on one machine; no root, no containers, no namespaces.
FAST_TESTS := tests/unit tests/distributed tests/bench tests/docs
test-fast: $(STAMP)
	$(BIN)/python -m pytest -v $(FAST_TESTS) $(PYTEST_ARGS)

# Tests marked gpu (tests/gpu): CUDA tensors, NCCL, AMP, SyncBatchNorm. On a machine without a CUDA device they
# skip with one line; .venv needs the CUDA build of torch there (make clean; make test-gpu TORCH=cuda).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -v -s -m gpu tests/gpu $(PYTEST_ARGS)

# The same under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1: every kernel's reads and writes are checked
# against the streams' order; an unsynchronised access fails the rank that made it). Slow: run it after test-gpu.
test-gpu-sanitizer: $(STAMP)
	TORCH_CUDA_SANITIZER=1 $(BIN)/python -m pytest -v -s -m gpu tests/gpu $(PYTEST_ARGS)

# The container images, by docker/build_image.py (the deployment tests build theirs with it too): the base is
# Docker Hub's debian:bookworm-slim where it can be pulled, else a Debian made from Debian packages with
# mmdebstrap; torch comes from PyTorch's index where it answers, else through this machine's pip configuration.
# It says which it chose, then runs `hora check` in the new image. Opt-in, not part of `make test` (the CUDA
# image downloads several GB). CONTAINER=docker works as well; OCI_RUNTIME=runc passes podman --runtime;
# IMAGE names the image; PUBLIC_BASE the public base to try; TORCH_INDEX_URL=URL|pip-config forces torch's source.
CONTAINER   ?= podman
OCI_RUNTIME ?=
PUBLIC_BASE ?= docker.io/library/debian:bookworm-slim
IMAGE_ARGS = --engine $(CONTAINER) --torch-version $(TORCH_VERSION) --public-base $(PUBLIC_BASE) \
             $(if $(OCI_RUNTIME),--runtime $(OCI_RUNTIME)) $(if $(TORCH_INDEX_URL),--torch-index $(TORCH_INDEX_URL)) \
             $(if $(IMAGE),--tag $(IMAGE))
image:
	$(PYTHON) docker/build_image.py --flavor cpu $(IMAGE_ARGS)

image-cuda:
	$(PYTHON) docker/build_image.py --flavor cuda $(IMAGE_ARGS)

# The layer contracts (pyproject.toml's [tool.importlinter]): the packages import downwards only, the launcher no
# worker-side layer, the agent no torch, and no import cycle anywhere in src/hora.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python benchmarks/allreduce_bench.py
	$(BIN)/python benchmarks/optimizer_bench.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run_quick.py --out out/bench-quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
