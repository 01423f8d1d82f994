# The two set-up commands the README promises:
#   make train   a real 2-rank training run on localhost (creates .venv on first use)
#   make test    the whole test suite (CI runs exactly this, via .ci/run)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hora-installed
NP     ?= 2
PYTEST_ARGS ?=

.PHONY: train test lint bench system-deps clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet -e .
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/hora run -np $(NP) $(BIN)/python examples/train_digits.py

# Multi-host tests build hosts from network namespaces with their own sshd: they need root, iproute2 and
# openssh-server. Installed here when missing (root only); without root those tests skip and say why.
system-deps:
	@if [ "$$(id -u)" = "0" ] && { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] || ! command -v ip >/dev/null; }; then \
		echo "installing openssh-server iproute2 for the multi-host tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server iproute2 >/dev/null; \
	fi

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/allreduce_bench.py
	$(BIN)/python benchmarks/optimizer_bench.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
