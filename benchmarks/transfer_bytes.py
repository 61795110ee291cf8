"""Bytes across PCIe per optimizer step of the shipped GPU recipes, as shipped and as the code moved them
before the layer-major passes (the reference streamed once per log-prob micro-batch, every micro-batch's
gradients sent down): the planner's figures (memory/step_time.py, `transfers`), which
tests/training/test_transfer_counts.py holds equal to what a run counts, on the recipes' shapes with a tiny
model. Also the step-time estimate on a card, before and after.

    PYTHONPATH=. python benchmarks/transfer_bytes.py [--card "H100 SXM"] [RECIPE ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # presets and the one-layer probe only

from lowmem_grpo.cli.plan import architecture  # noqa: E402
from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.memory.cards import card  # noqa: E402
from lowmem_grpo.memory.step_time import estimate, transfers  # noqa: E402

RECIPES = ("qwen2.5-1.5b_gsm8k_8gb.yaml", "qwen2.5-3b_gsm8k_8gb.yaml", "qwen2.5-1.5b_gsm8k-4096_8gb.yaml",
           "qwen2.5-1.5b_gsm8k-8192_8gb.yaml")
# the settings each recipe had before the layer-major passes (where it changed them with them)
BEFORE_ALL = ["layer_major_backward=false", "head_gradient_once_per_step=false", "layers_per_checkpoint=1"]
BEFORE = {"qwen2.5-3b_gsm8k_8gb.yaml": ["offload_activations=false"],
          "qwen2.5-1.5b_gsm8k-4096_8gb.yaml": ["per_device_train_batch_size=4", "gradient_accumulation_steps=8",
                                               "steps_per_generation=8"],
          "qwen2.5-1.5b_gsm8k-8192_8gb.yaml": ["reference_stream_rows=null", "per_device_train_batch_size=2",
                                               "gradient_accumulation_steps=16", "steps_per_generation=16"]}


def totals(moves) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in moves:
        out[m.kind] = out.get(m.kind, 0.0) + m.total / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=RECIPES)
    parser.add_argument("--card", default="H100 SXM")
    args = parser.parse_args()
    print(f"GB per optimizer step (planner); step time on {args.card} (estimate, s)")
    print(f"{'recipe':36} {'before':>8} {'now':>8} {'ratio':>6}  {'step s before':>13} {'now':>6}  kinds now (GB)")
    for name in args.recipes:
        path = str(ROOT / "recipes" / name)
        now_cfg = load_config(path, check=False)
        before_cfg = load_config(path, [*BEFORE_ALL, *BEFORE.get(name, [])], check=False)
        arch = architecture(now_cfg, None)[0]
        then = transfers(before_cfg, arch, reference_per_micro_batch=True)
        now = transfers(now_cfg, arch)
        b, n = sum(m.total for m in then) / 1e9, sum(m.total for m in now) / 1e9
        t0 = estimate(before_cfg, arch, card(args.card), reference_per_micro_batch=True).total
        t1 = estimate(now_cfg, arch, card(args.card)).total
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in totals(now).items())
        print(f"{name:36} {b:8.1f} {n:8.1f} {n / b:6.2f}  {t0:13.2f} {t1:6.2f}  {kinds}")


if __name__ == "__main__":
    main()
