"""The docs say what the code does: every repository path they name exists, and every planner figure a
recipe header states is what `lowmem-grpo plan` prints for that recipe today.

Paths are read from README.md, docs/**/*.md, benchmarks/RESULTS.md, the recipes' leading comments and
the docstrings of lowmem_grpo/**/*.py and benchmarks/*.py. A path is checked when it is
- rooted at a top-level folder of the repository (`lowmem_grpo/...`, `tests/...`, `benchmarks/...`,
  `recipes/...`, `docs/...`, `.ci/...`; a `*` in it must match something);
- a `.py` path inside the package written without `lowmem_grpo/` (`training/distributed.py`), the
  way the docs name modules; except `kernels/FILE`, which until recently meant a top-level folder:
  write `lowmem_grpo/kernels/FILE` so nobody looks for the old one (a bare `kernels/` in an indented
  layout tree is fine);
- a bare file name (`prepare_gsm8k.py`, `RESULTS.md`, `char_e.yaml`): some file of the repository
  has that name.
A docs page (`docs/usage.md`, or `usage.md` in a link between pages) may also be a page of mkdocs.yml's
nav: `make docs` (mkdocs build --strict) fails when a nav page is missing. The README stays short: at
most README_MAX_LINES lines; the rest of what it used to hold lives in docs/.
Each failure lists every bad path with the file that names it, so one run shows them all.
"""

from __future__ import annotations

import ast
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOTED = ("lowmem_grpo", "tests", "benchmarks", "recipes", "docs", ".ci")
README_MAX_LINES = 250
PACKAGE_DIRS = sorted(p.name for p in (ROOT / "lowmem_grpo").iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
# Paths the docs name that are not kept in the repository, each with why.
NOT_IN_THE_TREE = {
    "lowmem_grpo/recipes": "the installed name of recipes/ (pyproject.toml's package-dir)",
    "recipes/data/gsm8k_train.jsonl": "recipes/data/prepare_gsm8k.py writes it",
    "recipes/data/gsm8k_test.jsonl": "recipes/data/prepare_gsm8k.py writes it",
}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "runs", "gpu-results", "build", "dist", ".whl", "site"}

# A path-like token: not part of a longer path or URL (no word character, '/', '.' or '-' before it).
_TOKEN = re.compile(r"(?<![\w/.\-~$])((?:\.ci/)?[\w*][\w.*\-/]*)")
_BARE_FILE = re.compile(r"[\w\-]+\.(?:py|md|yaml|sh)")


def repo_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not any(part in SKIP_DIRS or part.startswith(".venv") or part.endswith(".egg-info")
                                      for part in rel.parts):
            files.append(rel)
    return files


def nav_pages() -> set[str]:
    """The pages of mkdocs.yml's nav, as paths under docs/ (`usage.md`, `api/kernels.md`)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:", 1)[1]
    return set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.\-]+\.md)\s*$", nav, re.M))


def doc_texts() -> dict[str, str]:
    """Where the docs are: {file it comes from: text}."""
    texts = {"README.md": (ROOT / "README.md").read_text(),
             "benchmarks/RESULTS.md": (ROOT / "benchmarks" / "RESULTS.md").read_text()}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        texts[str(page.relative_to(ROOT))] = page.read_text()
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        texts[f"recipes/{recipe.name} (header)"] = recipe_header(recipe)
    for source in sorted((ROOT / "lowmem_grpo").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(source.read_text())
        docs = [ast.get_docstring(node, clean=False) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        texts[f"{source.relative_to(ROOT)} (docstrings)"] = "\n".join(d for d in docs if d)
    return texts


def recipe_header(recipe: Path) -> str:
    """The recipe's leading comment block, without the '#'s."""
    lines = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return "\n".join(lines)


def bad_paths(text: str, names: set[str], pages: frozenset[str] = frozenset()) -> list[str]:
    """The repository paths named in `text` that do not exist, each with why. `pages`: the docs pages
    (paths under docs/) that count as present because mkdocs.yml's nav names them."""
    bad = []
    for m in _TOKEN.finditer(text):
        token = m.group(1).rstrip(".-")
        if text[m.end():m.end() + 1] == "{":
            continue  # a pattern such as gsm8k_{train,test}.jsonl, not one file
        top = token.split("/", 1)[0]
        if "/" in token and top == "kernels" and token != "kernels/":  # a bare "kernels/" is a folder in a layout tree
            bad.append(f"{token} (the fused ops live in lowmem_grpo/kernels/: write lowmem_grpo/{token})")
        elif "/" in token and (top in ROOTED or token.startswith(".ci/")):
            if token.rstrip("/") in NOT_IN_THE_TREE or (top == "docs" and token[len("docs/"):] in pages):
                continue
            if not (list(ROOT.glob(token.rstrip("/"))) if "*" in token else (ROOT / token).exists()):
                bad.append(token)
        elif "/" in token and top in PACKAGE_DIRS and token.endswith(".py"):
            if not (ROOT / "lowmem_grpo" / token).exists():
                bad.append(f"{token} (read as lowmem_grpo/{token})")
        elif _BARE_FILE.fullmatch(token) and token not in names and token not in pages:
            bad.append(f"{token} (no file of that name in the repository)")
    return bad


def test_every_path_the_docs_name_exists():
    names, pages = {p.name for p in repo_files()}, frozenset(nav_pages())
    missing = {source: sorted(set(bad)) for source, text in doc_texts().items()
               if (bad := bad_paths(text, names, pages))}
    report = "\n".join(f"  {source}: {', '.join(bad)}" for source, bad in missing.items())
    assert not missing, f"paths named in the docs that are not in the repository:\n{report}"


def test_the_path_check_sees_what_it_should():
    """The checker itself: it flags each kind of bad path and passes good ones."""
    names = {p.name for p in repo_files()}
    text = ("see lowmem_grpo/sr_optim.py, tests/test_sr_optim.py, kernels/linear.py, training/nope.py, "
            "backward_optim.py and DESIGN.md; but lowmem_grpo/kernels/linear.py, training/distributed.py, "
            "lowmem_grpo/kernels/*.py, recipes/data/gsm8k_{train,test}.jsonl, RESULTS.md, "
            "https://example.com/tests/none.py and prepare_gsm8k.py are fine.")
    assert bad_paths(text, names) == [
        "lowmem_grpo/sr_optim.py", "tests/test_sr_optim.py",
        "kernels/linear.py (the fused ops live in lowmem_grpo/kernels/: write lowmem_grpo/kernels/linear.py)",
        "training/nope.py (read as lowmem_grpo/training/nope.py)",
        "backward_optim.py (no file of that name in the repository)",
        "DESIGN.md (no file of that name in the repository)"]


_NUMBERED_OP = re.compile(r"\bops?\s+[1-4](?:\s*(?:and|-|,|to)\s*[1-4])*\b(?!\s*%|\d)", re.I)


def test_ops_are_named_not_numbered():
    """The pages and the package's code name each fused op by its function (`token_logprobs`, `grpo_token_terms`, ...): a number
    ("op 2") sends the reader to a table to learn which op is meant."""
    texts = {source: text for source, text in doc_texts().items() if not source.endswith("(docstrings)")}
    texts.update({str(path.relative_to(ROOT)): path.read_text() for path in (ROOT / "lowmem_grpo").rglob("*.py")})
    numbered = {source: sorted(set(_NUMBERED_OP.findall(text))) for source, text in texts.items()
                if _NUMBERED_OP.search(text)}
    assert not numbered, f"ops named by number (write the function's name): {numbered}"


def test_the_nav_is_read():
    pages = nav_pages()
    assert {"index.md", "usage.md", "trl.md", "api/kernels.md"} <= pages, sorted(pages)
    text = "see docs/usage.md, docs/nope.md and nope.md; docs/index.md links usage.md."
    assert bad_paths(text, set(), frozenset(pages)) == [
        "docs/nope.md", "nope.md (no file of that name in the repository)"]


def test_readme_commands_are_the_ones_ci_and_make_run():
    """The README's two newcomer commands are make targets, and CI runs the test one, the rest of the suite
    and builds the docs."""
    readme = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    ci = re.findall(r"^make ([\w-]+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    for target in ("demo", "test"):
        assert re.search(rf"^make {target}\b", readme, re.M), f"README.md: no `make {target}` line"
        assert target in targets, f"Makefile: no target {target}"
    assert ci[:3] == ["test", "test-extended", "docs"], (f".ci/run runs {ci}: `make test` (README's test command), "
                                                          "`make test-extended` (the rest), then `make docs`")


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail into "
                                       f"a docs/ page and link it")


# ---- planner figures in the recipe headers ------------------------------------------------------------
# A header states planner figures after the command that prints them, in backticks:
#   `lowmem-grpo plan recipes/NAME.yaml [options]`: 4.020 GiB allocator peak (backward), 4.721 GiB with
#   the margin; host RAM 12.0 GiB ...
# Everything up to the next backticked `lowmem-grpo plan` command (or the header's end) belongs to it.
_PLAN_COMMAND = re.compile(r"`lowmem-grpo plan (recipes/\S+\.yaml)((?: [^`]*)?)`")
_FIGURES = {
    "peak": re.compile(r"([0-9]+\.[0-9]+)\s+GiB\s+allocator\s+peak(?:\s+\((\w[\w-]*)\b)?"),
    "total": re.compile(r"([0-9]+\.[0-9]+)\s+GiB\s+with\s+the\s+margin"),
    "host": re.compile(r"host\s+RAM:?\s+([0-9]+\.[0-9]+)\s+GiB", re.I),
}


def stated_plans(header: str) -> list[tuple[str, list[str], str]]:
    """[(recipe path, extra command-line options, the text stating its figures)] of one header."""
    commands = list(_PLAN_COMMAND.finditer(header))
    ends = [c.start() for c in commands[1:]] + [None]
    return [(m.group(1), m.group(2).split(), header[m.end():end]) for m, end in zip(commands, ends)]


def planner_output(recipe: str, options: list[str]) -> dict:
    """`lowmem-grpo plan RECIPE OPTIONS --json`, run in this process as the CLI runs it."""
    import json
    from lowmem_grpo.cli import main
    if "--host-memory" not in options:
        options = [*options, "--host-memory", "1024GiB"]  # the figures, whatever this machine's RAM
    out = io.StringIO()
    with redirect_stdout(out):
        main(["plan", str(ROOT / recipe), *options, "--json"])
    return json.loads(out.getvalue())


def _rounded(value_bytes: int, stated: str) -> str:
    decimals = len(stated.split(".")[1])
    return f"{value_bytes / 2**30:.{decimals}f}"


# Every GPU recipe states what the planner predicts for it; the CPU recipes are measured instead.
GPU_RECIPES = sorted(r.name for r in (ROOT / "recipes").glob("*.yaml") if "gb" in r.stem.split("_")[-1])


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_recipe_header_planner_figures_are_the_planners(recipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # presets and the one-layer probe only, no downloads
    header = recipe_header(ROOT / "recipes" / recipe)
    plans = stated_plans(header)
    assert plans, (f"recipes/{recipe}: its header states no planner figures; add "
                   f"`lowmem-grpo plan recipes/{recipe}`: X GiB allocator peak (phase), Y GiB with the margin")
    wrong = []
    for path, options, text in plans:
        assert path == f"recipes/{recipe}", f"recipes/{recipe}: its header plans {path}, another recipe"
        result = planner_output(path, options)
        stated = {key: m for key, pattern in _FIGURES.items() if (m := pattern.search(text))}
        assert "peak" in stated, f"recipes/{recipe}: after `lowmem-grpo plan {path}` say 'X GiB allocator peak'"
        actual = {"peak": result["peak_bytes"], "total": result["total_bytes"], "host": result["host_bytes"]}
        for key, m in stated.items():
            if m.group(1) != _rounded(actual[key], m.group(1)):
                wrong.append(f"{key} {m.group(1)} GiB stated, the planner says {_rounded(actual[key], m.group(1))}")
        phase = stated["peak"].group(2)
        if phase and phase != result["peak_phase"]:
            wrong.append(f"peak phase {phase!r} stated, the planner says {result['peak_phase']!r}")
    assert not wrong, f"recipes/{recipe} header (`lowmem-grpo plan {' '.join([path, *options])}`): " + "; ".join(wrong)


# ---- dependency floors ------------------------------------------------------------------------------------
# torch's floor (2.6) has no CPU wheel on the machines CI runs on, and triton's is set by the torch build;
# pyproject.toml says so. Every other floor is what `make test-floor` installs and tests.
UNTESTED_FLOORS = {"torch", "triton"}


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_pyproject_floors_are_the_versions_make_test_floor_tests():
    pyproject = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    floors = dict(re.findall(r'^\s*"([\w-]+)>=([0-9.]+)', dependencies, re.M))
    pins_line = re.search(r"^FLOOR_PINS := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert pins_line, "Makefile: no FLOOR_PINS (the versions make test-floor installs)"
    pins = dict(pin.split("==") for pin in pins_line.group(1).split())
    tested = {name: floor for name, floor in floors.items() if name not in UNTESTED_FLOORS}
    unpinned = sorted(set(tested) - set(pins))
    assert not unpinned, f"pyproject.toml floors that make test-floor does not test: {unpinned}; add them to FLOOR_PINS"
    differ = [f"{name}: pyproject >={tested[name]}, FLOOR_PINS =={pins[name]}" for name in tested
              if _version(tested[name]) != _version(pins[name])]
    assert not differ, "pyproject.toml's floors are not the tested versions: " + "; ".join(differ)
