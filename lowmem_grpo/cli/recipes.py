"""`lowmem-grpo recipes` (list the recipes shipped with the package) and `lowmem-grpo recipes cp NAME
[DEST]` (copy one, with the data files it names, to edit and run); and the shipped-name fallback that
lets `lowmem-grpo train NAME` run a shipped recipe when no file NAME exists."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path
from typing import Optional

from ..config import ConfigError
from ..shipped_recipes import data_files, find_shipped, header, nearest_shipped, recipes_dir, shipped_recipes


def resolve_recipe(arg: Optional[str]) -> Optional[str]:
    """A recipe argument as a path: the file if it exists, else the shipped recipe of that name."""
    if arg is None or Path(arg).exists():
        return arg
    shipped = find_shipped(arg)
    if shipped is None:
        raise ConfigError(f"recipe {arg!r} not found{nearest_shipped(arg)} (`lowmem-grpo recipes` lists the "
                          "recipes shipped with the package)")
    print(f"[lowmem-grpo] no file {arg!r}: using the shipped recipe {shipped}", file=sys.stderr)
    return str(shipped)


def list_recipes() -> int:
    recipes = shipped_recipes()
    if not recipes:
        print("lowmem-grpo: error: no recipes found beside the package (a broken install?)", file=sys.stderr)
        return 2
    width = max(map(len, recipes))
    columns = max(shutil.get_terminal_size((100, 24)).columns, width + 40)
    for name, path in recipes.items():  # each description wrapped at words, under its own column
        print(textwrap.fill(header(path), columns - 1, initial_indent=f"{name:<{width}}  ",
                            subsequent_indent=" " * (width + 2), break_long_words=False, break_on_hyphens=False))
    print(f"\n({recipes_dir()})\nRun one with `lowmem-grpo train NAME`; copy one to edit with "
          "`lowmem-grpo recipes cp NAME [DEST]`.")
    return 0


def copy_recipe(name: str, dest: Optional[str] = None, force: bool = False) -> int:
    """Copy recipe `name` to DEST (a folder, default '.', or a .yaml path) and its data files to DEST/data/."""
    source = find_shipped(name)
    if source is None:
        raise ConfigError(f"no shipped recipe {name!r}" + (nearest_shipped(name) or
                          f" (shipped: {', '.join(shipped_recipes()) or 'none'})"))
    target = Path(dest or ".")
    if target.suffix not in (".yaml", ".yml"):
        target = target / source.name
    present, missing = data_files(source)
    copies = [(source, target)] + [(f, target.parent / "data" / f.name) for f in present]
    existing = [str(t) for _, t in copies if t.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s): pass --force to overwrite, or give another DEST")
    for src, dst in copies:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        print(f"wrote {dst}")
    scripts = [t for s, t in copies[1:] if s.suffix == ".py"]
    for path in missing:
        how = f"make it with `python {scripts[0]}`" if scripts else "the recipe's header says how to make it"
        print(f"note: {path} is not shipped with the package; {how}")
    print(f"run it: lowmem-grpo train {target}")
    return 0
