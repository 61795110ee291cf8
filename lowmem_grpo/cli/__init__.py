"""Command line: `lowmem-grpo train|eval|profile|plan|recipes ...`; each command's --help says more.

One module per command (train.py: train and eval; plan.py; profile.py; recipes.py); this one parses
the arguments, dispatches, and turns user errors into one line and exit code 2. The CLI imports the
library; nothing in the library imports the CLI.

`key=value` overrides use the config's names (`section.key=value` or a bare `key=value`); values are
YAML (`beta=0.04`, `reward_funcs=[numeric_answer]`). TRL's spelling works too: `--key value`,
`--key=value`, `--section.key value`, and a boolean key alone is true (`--bf16`); see options.py.
`--help-config` (before or after the command) lists every key with its default. A recipe argument
that is not a file may name a recipe shipped with the package (`lowmem-grpo recipes` lists them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lowmem_grpo import __version__

from ..config import ConfigError, describe, load_config
from .options import key_options_to_overrides
from .recipes import copy_recipe, list_recipes, resolve_recipe
from .train import evaluate, train

# Seconds a rank other than 0 waits before exiting on a configuration error, which rank 0 reports for all
# of them: torchrun stops every rank as soon as one exits, and rank 0 could be stopped before it printed.
SILENT_RANK_GRACE_S = 5.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowmem-grpo", description="Low-memory full-parameter GRPO.")
    p.add_argument("--version", action="version", version=f"lowmem-grpo {__version__}")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and help "
                   "(also after a command)")
    sub = p.add_subparsers(dest="command")
    for name, help in (("train", "train a recipe"), ("eval", "greedy evaluation on the recipe's held-out prompts")):
        s = sub.add_parser(name, help=help)
        s.add_argument("recipe", help="a YAML recipe, or the name of a shipped one (lowmem-grpo recipes)")
        s.add_argument("overrides", nargs="*", help="section.key=value, key=value or --key value" +
                       ("; model=PATH evaluates a checkpoint folder" if name == "eval" else ""))
    s = sub.add_parser("plan", help="predict peak GPU memory from a model config and settings (no GPU, no weights)")
    s.add_argument("recipe", nargs="?", help="a YAML recipe (optional: the trainer's defaults otherwise)")
    s.add_argument("overrides", nargs="*", help="section.key=value or key=value")
    s.add_argument("--model", help="preset (Qwen2.5-1.5B), hub id (Qwen/Qwen2.5-1.5B-Instruct) or config.json path")
    s.add_argument("--gpu-memory", default=None, help="the card's memory, e.g. 8GiB, 12GB, 24GiB (default: on a GPU "
                                                       "machine what the card has free now, else 8GiB)")
    s.add_argument("--host-memory", default=None, help="the machine's RAM for the host-side check (default: this "
                                                         "machine's), e.g. 32GiB")
    s.add_argument("--nproc", type=int, default=1, help="ranks under torchrun: predict one rank's peak (default 1)")
    s.add_argument("--nnodes", type=int, default=1,
                   help="with --nproc: the nodes the N ranks are spread over (torchrun --nnodes); host RAM is one "
                        "node's (default 1)")
    s.add_argument("--strategy", choices=("ddp", "fsdp"), default=None,
                   help="with --nproc: ddp or fsdp (default: the recipe's train.strategy)")
    s.add_argument("--json", action="store_true", help="print a machine-readable object")
    s.add_argument("--largest", action="store_true",
                   help="the same settings for every preset: which fit the card and host RAM, and the largest")
    s.add_argument("--card", default=None, help="estimate the step's time on this card, e.g. 'RTX 4060', 4090, H100 "
                                                "(an unknown name lists them)")
    s = sub.add_parser("profile", help="run N real steps and report peak memory per phase and category "
                                       "(table, profile.json, timeline.png)")
    s.add_argument("recipe", help="a YAML recipe (see recipes/)")
    s.add_argument("overrides", nargs="*", help="section.key=value or key=value")
    s.add_argument("--steps", type=int, default=2, help="trainer steps to profile (default 2)")
    s.add_argument("--out", default=None, help="folder for the results (default: OUTPUT_DIR/profile)")
    s = sub.add_parser("recipes", help="list the recipes shipped with the package; `recipes cp NAME [DEST]` "
                                       "copies one (with its data files)")
    r = s.add_subparsers(dest="recipes_command")
    r.add_parser("list", help="list them (the default)")
    c = r.add_parser("cp", help="copy a shipped recipe and the data files it names")
    c.add_argument("name", help="a name from `lowmem-grpo recipes`")
    c.add_argument("dest", nargs="?", help="a folder (default: the current one) or a .yaml file name")
    c.add_argument("--force", action="store_true", help="overwrite existing files")
    s = sub.add_parser("plot", help="draw a run's metrics.jsonl as a PNG: reward, held-out score, length, KL, ...")
    s.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    s.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/run.png)")
    return p


def _command_options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Command name -> its own option strings, for the commands that take key=value overrides."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(a.dest == "overrides" for a in sub._actions):
                    out[name] = set(sub._option_string_actions)
    return out


def _normalize(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """TRL-style `--key value` options after an override-taking command, rewritten as key=value."""
    commands = _command_options(parser)
    for i, arg in enumerate(argv):
        if arg in commands:
            extra = frozenset({"model"}) if arg == "eval" else frozenset()  # eval's model=PATH shorthand
            return argv[:i + 1] + key_options_to_overrides(argv[i + 1:], commands[arg] | {"--help-config"}, extra)
        if not arg.startswith("-"):
            break  # another command (or a stray word): argparse reports it
    return argv


def main(argv=None) -> int:
    """The `lowmem-grpo` command; returns the exit status. Output piped into a reader that stops early
    (`lowmem-grpo recipes | head`) ends quietly, as other command-line tools do."""
    try:
        return _main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


def _main(argv=None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help-config" in argv[:argv.index("--") if "--" in argv else len(argv)]:
        print(describe())
        return 0
    try:
        argv = _normalize(parser, argv)
    except ConfigError as e:
        print(f"lowmem-grpo: error: {e}", file=sys.stderr)
        return 2
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
    if args.command == "recipes":
        try:
            if args.recipes_command == "cp":
                return copy_recipe(args.name, args.dest, args.force)
            return list_recipes()
        except BrokenPipeError:
            raise  # the reader stopped reading (`| head`): main's caller
        except (ConfigError, OSError) as e:
            print(f"lowmem-grpo: error: {e}", file=sys.stderr)
            return 2
    if args.command == "plan":
        from .plan import run
        recipe, overrides = args.recipe, list(args.overrides)
        if recipe is not None and "=" in recipe:  # `plan --model X key=value`: no recipe given
            recipe, overrides = None, [recipe] + overrides
        try:
            return run(resolve_recipe(recipe), args.model, args.gpu_memory, overrides, args.json, args.host_memory,
                       nproc=args.nproc, strategy=args.strategy, nnodes=args.nnodes,
                       largest=args.largest, card_name=args.card)
        except ConfigError as e:
            print(f"lowmem-grpo: error: {e}", file=sys.stderr)
            return 2
    if args.command == "plot":
        from .plot import run as plot
        try:
            return plot(args.run_dir, args.out)
        except FileNotFoundError as e:
            print(f"lowmem-grpo: error: {e}", file=sys.stderr)
            return 2
    # heavy imports (torch, transformers) only when needed
    from ..policy.model import ModelError
    from ..rewards import RewardError
    from ..training.checkpoint import CheckpointError
    from ..training.data import DataError
    from ..training.distributed import PeerFailure
    from ..training.trainer import TrainingStopped
    user_errors = (ConfigError, DataError, ModelError, RewardError, CheckpointError, FileNotFoundError, ImportError)
    try:
        args.recipe = resolve_recipe(args.recipe)
        if args.command in ("eval", "profile") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"`lowmem-grpo {args.command}` runs in one process (only `train` uses torchrun's "
                              f"ranks): run it without torchrun")
        if args.command == "profile":
            from .profile import run as profile
            return profile(args.recipe, load_config(args.recipe, args.overrides), args.overrides, args.steps, args.out)
        if args.command == "eval":
            return evaluate(args.recipe, args.overrides)
        return train(args.recipe, args.overrides)
    except TrainingStopped as e:
        print(f"lowmem-grpo: {e}", file=sys.stderr)
        return 1
    except PeerFailure as e:  # under torchrun: the rank that failed reported its own error
        print(f"lowmem-grpo: rank {os.environ.get('RANK', '0')} stopped: {e}", file=sys.stderr)
        return 1
    except user_errors as e:
        if os.environ.get("LOWMEM_GRPO_DEBUG"):
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(e, ConfigError):  # under torchrun every rank reads the same config
            print(f"lowmem-grpo: error: {'' if rank == 0 else f'rank {rank}: '}{e}", file=sys.stderr)
        else:  # torchrun ends every rank once one exits: the silent ones wait for rank 0 to say it
            time.sleep(SILENT_RANK_GRACE_S)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
