"""Command line: `lowmem-grpo train|eval|profile|plan ...`; each command's --help says more.

`key=value` overrides use the config's names (`section.key=value` or a bare `key=value`); values are
YAML (`beta=0.04`, `reward_funcs=[numeric_answer]`). `--help-config` lists every key with its default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import ConfigError, describe, load_config



def _split_model_override(overrides: list[str]) -> list[str]:
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowmem-grpo", description="Low-memory full-parameter GRPO.")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and help")
    sub = p.add_subparsers(dest="command")
    for name, help in (("train", "train a recipe"), ("eval", "greedy evaluation on the recipe's held-out prompts")):
        s = sub.add_parser(name, help=help)
        s.add_argument("recipe", help="a YAML recipe (see recipes/)")
        s.add_argument("overrides", nargs="*", help="section.key=value or key=value" +
                       ("; model=PATH evaluates a checkpoint folder" if name == "eval" else ""))
    s = sub.add_parser("plan", help="predict peak GPU memory from a model config and settings (no GPU, no weights)")
    s.add_argument("recipe", nargs="?", help="a YAML recipe (optional: the trainer's defaults otherwise)")
    s.add_argument("overrides", nargs="*", help="section.key=value or key=value")
    s.add_argument("--model", help="preset (Qwen2.5-1.5B), hub id (Qwen/Qwen2.5-1.5B-Instruct) or config.json path")
    s.add_argument("--gpu-memory", default="8GiB", help="the card's memory, e.g. 8GiB (default), 12GB, 24GiB")
    s.add_argument("--json", action="store_true", help="print a machine-readable object")
    s = sub.add_parser("profile", help="run N real steps and report peak memory per phase and category "
                                       "(table, profile.json, timeline.png)")
    s.add_argument("recipe", help="a YAML recipe (see recipes/)")
    s.add_argument("overrides", nargs="*", help="section.key=value or key=value")
    s.add_argument("--steps", type=int, default=2, help="trainer steps to profile (default 2)")
    s.add_argument("--out", default=None, help="folder for the results (default: OUTPUT_DIR/profile)")
    return p


def main(argv=None) -> int:
    parser = _parser()
    # key=value overrides may come after options (`profile R --steps 3 beta=0`): argparse leaves them over
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if args.help_config:
        print(describe())
        return 0
    if args.command is None:
        _parser().print_help()
        return 2
    if args.command == "plan":
        from .plan_cli import run
        recipe, overrides = args.recipe, list(args.overrides)
        if recipe is not None and "=" in recipe:  # `plan --model X key=value`: no recipe given
            recipe, overrides = None, [recipe] + overrides
        try:
            return run(recipe, args.model, args.gpu_memory, overrides, args.json)
        except ConfigError as e:
            print(f"lowmem-grpo: error: {e}", file=sys.stderr)
            return 2
    # heavy imports (torch, transformers) only when needed
    from .data import DataError
    from .model import ModelError
    from .rewards import RewardError
    from .trainer import Trainer, TrainingStopped
    user_errors = (ConfigError, DataError, ModelError, RewardError, FileNotFoundError, ImportError)
    try:
        overrides = _split_model_override(args.overrides) if args.command == "eval" else args.overrides
        cfg = load_config(args.recipe, overrides)
        recipe_dir = Path(args.recipe).resolve().parent
        if args.command == "profile":
            from .profile_cli import run as profile
            return profile(args.recipe, cfg, args.overrides, args.steps, args.out)
        if args.command == "eval":
            trainer = Trainer(cfg, recipe_dir=recipe_dir, training=False)
            result = trainer.evaluate()
            print(json.dumps(result, indent=2))
            return 0
        result = Trainer(cfg, recipe_dir=recipe_dir).train()
        return 130 if result["stopped_by"] else 0
    except TrainingStopped as e:
        print(f"lowmem-grpo: {e}", file=sys.stderr)
        return 1
    except user_errors as e:
        if os.environ.get("LOWMEM_GRPO_DEBUG"):
            raise
        print(f"lowmem-grpo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
