#!/usr/bin/env bash
# One command for a session that has a GPU lent: CUDA tests + GPU benchmarks, results into $OUT.
#
#   bash benchmarks/gpu_session.sh [PART ...]   (device tool: run it from the repository root)
#
# PARTS: tests, kernels, trainer, memory (default: all four, in that order). The device tool runs
# one command for at most 10 minutes: give it one or two parts per call. Each part writes its logs
# and JSON into $OUT; run them in any order.
#
# The GPU machine reaches no package registry. Its image has torch, triton and transformers; the
# package itself is put on PYTHONPATH by copying (no pip needed): kernels/ becomes
# lowmem_grpo/kernels exactly as pyproject's package-dir maps it. Anything else it needs (e.g.
# bitsandbytes wheels for the trainer) travels in .whl/ (see the device tool's README) and is
# installed below when present.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

site=/tmp/lowmem_site
rm -rf "$site" && mkdir -p "$site"
cp -r lowmem_grpo "$site/lowmem_grpo" && cp -r kernels "$site/lowmem_grpo/kernels"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$site:/tmp/site"
else
  export PYTHONPATH="$site"
fi

{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$out/environment.txt"

status=0
parts="${*:-tests kernels trainer memory}"
for part in $parts; do
  case "$part" in
  tests)
    # Every op test runs on ("cuda", "triton") and ("cuda", "torch") in addition to the CPU paths.
    python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -n 30 || status=1 ;;
  kernels)
    python3 benchmarks/row_kernel_bandwidth.py --tokens 8192 --json "$out/row_kernel_bandwidth.json" 2>&1 \
      | tee -a "$out/kernels.log" || status=1
    python3 benchmarks/loss_head_memory.py --device cuda --tokens 2048 4096 8192 --json "$out/loss_head_memory.json" \
      2>&1 | tee -a "$out/kernels.log" || status=1
    python3 benchmarks/loss_head_speed.py --device cuda --tokens 4096 8192 --json "$out/loss_head_speed.json" 2>&1 \
      | tee -a "$out/kernels.log" || status=1 ;;
  trainer)
    # Trainer steps on random-weight models of the recipe architectures (no hub weights on this
    # machine), each under an 8 GiB cap as on an 8 GB card.
    for spec in "Qwen2.5-0.5B qwen2.5-0.5b_gsm8k_8gb 256 1024" "Qwen2.5-0.5B qwen2.5-0.5b_expected-string_8gb 128 64" \
                "Qwen2.5-1.5B qwen2.5-1.5b_gsm8k_8gb 256 512"; do
      set -- $spec
      python3 benchmarks/trainer_step.py --arch "$1" --recipe "recipes/$2.yaml" --memory-cap-gib 8 \
        --prompt-len "$3" --completion-len "$4" --steps 3 --json "$out/trainer_step_$2.json" \
        2>&1 | tee -a "$out/trainer.log" || status=1
    done ;;
  memory)
    python3 benchmarks/memory_accounting.py --json "$out/memory_accounting.json" 2>&1 | tee -a "$out/memory.log" \
      || status=1
    # The planner against the profiler on the 8 GB recipes (CUDA allocator peaks by phase and category).
    python3 benchmarks/plan_accuracy.py --gpu-recipes --memory-cap-gib 8 --steps 2 \
      --json "$out/plan_accuracy_gpu.json" 2>&1 | tee -a "$out/memory.log" || status=1 ;;
  *)
    echo "unknown part '$part' (tests, kernels, trainer, memory)" >&2; exit 2 ;;
  esac
done
exit $status
