# The two set-up commands the README promises:
#   make train   a real 2-rank training run on localhost (creates .venv on first use)
#   make test    the whole test suite (CI runs exactly this, via .ci/run)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hora-installed
NP     ?= 2
PYTEST_ARGS ?=

.PHONY: train test lint bench system-deps clean image-cuda

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/hora run -np $(NP) $(BIN)/python examples/train_digits.py

# Multi-host tests build hosts from network namespaces with their own sshd: they need root, iproute2 and
# openssh-server. The deployment tests (tests/deploy) need podman, runc, mmdebstrap and iptables (containers) and
# slurm-wlm and munge (a Slurm cluster). Installed here when missing (root with apt only); a failed install
# is reported and the tests that need the missing tools skip and say why.
SYSTEM_DEPS := openssh-server iproute2 podman runc buildah mmdebstrap iptables netavark aardvark-dns uidmap \
               slurm-wlm munge podman-compose catatonit
SYSTEM_TOOLS := /usr/sbin/sshd /usr/sbin/ip /usr/bin/podman /usr/sbin/runc /usr/bin/mmdebstrap /usr/sbin/iptables \
                /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/podman-compose /usr/bin/catatonit
system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do [ -x "$$t" ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
		echo "installing system packages for the multi-host and deployment tests (missing:$$missing)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(SYSTEM_DEPS) >/tmp/hora-system-deps.log 2>&1; } \
		|| echo "warning: apt-get install failed (see /tmp/hora-system-deps.log); tests needing those tools skip"; \
		systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; \
	fi

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Opt-in (not part of `make test`: torch's CUDA wheels are several GB): build the CUDA image and run
# `hora check` in it, on the GPUs when nvidia-smi is present. CONTAINER=docker works as well.
CONTAINER ?= podman
image-cuda:
	$(CONTAINER) build -f docker/Containerfile -t hora:cuda --build-arg FLAVOR=cuda .
	$(CONTAINER) run --rm $$(command -v nvidia-smi >/dev/null && echo --gpus all) hora:cuda hora check

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/allreduce_bench.py
	$(BIN)/python benchmarks/optimizer_bench.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
