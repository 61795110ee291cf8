"""The recipes shipped with the package: where they are, their names and headers, and the files each needs.

The top-level `recipes/` folder of the source tree installs as `lowmem_grpo/recipes/` (pyproject's
package-dir), so a `pip install` user has them; in a source tree (editable install,
or the bare tree on sys.path) they are the `recipes/` folder beside this package. Imports nothing.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Optional

_HERE = Path(__file__).resolve().parent


def recipes_dir() -> Optional[Path]:
    """The shipped recipes folder: inside the installed package, else beside the source tree's package."""
    for folder in (_HERE / "recipes", _HERE.parent / "recipes"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def shipped_recipes() -> dict[str, Path]:
    """Recipe name (file stem) -> path, sorted by name."""
    folder = recipes_dir()
    return {} if folder is None else {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def header(path: Path) -> str:
    """A recipe's description: the first sentence of its leading comment (which may run over several
    comment lines), without the '#'s, on one line."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text and words:
            break
        words.append(text)
    paragraph = " ".join(w for w in words if w)
    end = re.search(r"[.!?](\s|$)", paragraph)
    return paragraph[:end.start() + 1] if end else paragraph


def find_shipped(name: str) -> Optional[Path]:
    """The shipped recipe called `name` (with or without .yaml), or None."""
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    return shipped_recipes().get(stem) if "/" not in stem and "\\" not in stem else None


def nearest_shipped(name: str) -> str:
    """'; did you mean ...?' for the closest shipped recipe name, or ''."""
    stem = Path(name).stem
    match = difflib.get_close_matches(stem, list(shipped_recipes()), n=1, cutoff=0.5)
    return f"; did you mean the shipped recipe {match[0]!r}?" if match else ""


def data_files(recipe: Path) -> tuple[list[Path], list[str]]:
    """(files under the recipe's data/ folder that its text names, data paths it names that are not there).

    A recipe names its task files (data.train_file: data/x.jsonl) and, for data that is not shipped,
    the script that makes it (prepare_gsm8k.py in its header); both are copied with the recipe."""
    text = recipe.read_text()
    folder = recipe.parent / "data"
    present = sorted(p for p in folder.iterdir() if p.is_file() and p.name in text) if folder.is_dir() else []
    named = set(re.findall(r"(?<![\w/.])data/[\w.\-]+", text))
    missing = sorted(n for n in named if not (recipe.parent / n).is_file())
    return present, missing
