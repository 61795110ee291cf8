"""`lowmem-grpo train RECIPE [key=value ...]` and `lowmem-grpo eval RECIPE [model=PATH] [key=value ...]`."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError, load_config


def split_model_override(overrides: list[str]) -> list[str]:
    """`model=PATH` (eval's shorthand) -> evaluate that save_pretrained folder instead of the recipe's model."""
    out = []
    for item in overrides:
        if item.startswith("model="):
            path = item.split("=", 1)[1]
            out += [f"model.name_or_path={path}", "model.gguf_file=null", "model.config=null"]
            if (Path(path) / "tokenizer_config.json").is_file():
                out.append(f"model.tokenizer={path}")
        else:
            out.append(item)
    return out


def check_model_folder(overrides: list[str], output_dir: str) -> None:
    """`model=PATH` that does not exist where checkpoints do (in PATH's folder or the recipe's output_dir): a
    ConfigError listing them. With none there, the model loader's "no such folder" says it."""
    from ..training.checkpoint import list_checkpoints
    given = [item.split("=", 1)[1] for item in overrides if item.startswith("model=")]
    if not given or Path(given[-1]).exists():
        return
    path = Path(given[-1])
    found = {p for folder in (path.parent, Path(output_dir)) for _, p in list_checkpoints(folder)}
    if not found:
        return
    where = ", ".join(str(p) for p in sorted(found, key=lambda p: (str(p.parent), int(p.name.split("-")[1]))))
    raise ConfigError(f"model={path}: no such checkpoint; the checkpoints there are: {where}")


def train(recipe: str, overrides: list[str]) -> int:
    """Train the recipe; exit code 130 when a signal stopped the run (after it saved).

    Under torchrun (`torchrun --nproc-per-node N -m lowmem_grpo train RECIPE`) every rank runs this;
    the trainer joins the process group, and it is left here, also on an error. A rank whose run is
    over ends without finalizing the interpreter (distributed.end_rank).

    First, before anything starts CUDA: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the
    user set the allocator's settings; then, before the trainer loads any weight, the planner's peak
    against what the card has free (memory/fit.py says why and how)."""
    from ..memory.fit import check_run, use_expandable_segments
    from ..memory.reward_plan import resolve_folders
    use_expandable_segments()
    from ..training import distributed
    from ..training.trainer import Trainer  # torch/transformers only when needed
    cfg = load_config(recipe, overrides)
    resolve_folders(cfg, Path(recipe).resolve().parent)  # reward-model folders named from the recipe's folder
    check_run(cfg)
    try:
        result = Trainer(cfg, recipe_dir=Path(recipe).resolve().parent).train()
    finally:
        distributed.stop()
    code = 130 if result["stopped_by"] else 0
    if distributed.torchrun_env() is not None:  # a finished rank must not abort at exit: see end_rank
        distributed.end_rank(code)
    return code


def evaluate(recipe: str, overrides: list[str]) -> int:
    """Greedy evaluation of the recipe's model (or `model=PATH`) on its held-out prompts, printed as JSON."""
    from ..training.trainer import Trainer
    cfg = load_config(recipe, split_model_override(overrides))
    check_model_folder(overrides, cfg.output.output_dir)
    trainer = Trainer(cfg, recipe_dir=Path(recipe).resolve().parent, training=False)
    print(json.dumps(trainer.evaluate(), indent=2))
    return 0
