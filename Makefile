# Two entry points for a fresh machine: `make demo` (set up + run the main job) and `make test`
# (set up + run the test suite). Torch is pinned to the CPU build used on this project's machines;
# on a CUDA machine, install your own torch first and `pip install -e ".[test]"`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test test-slow demo aot bench-cpu

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# Until the trainer lands, the main job is the loss-head memory benchmark on this machine's CPU.
demo: setup
	$(BIN)/python benchmarks/loss_head_memory.py --device cpu --tokens 2048 4096

aot: setup
	$(BIN)/python -m lowmem_grpo.kernels.aot

bench-cpu: setup
	$(BIN)/python benchmarks/loss_head_memory.py --device cpu --tokens 2048 4096 8192
	$(BIN)/python benchmarks/loss_head_speed.py --device cpu --tokens 4096
