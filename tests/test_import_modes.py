"""`import lowmem_grpo.kernels` loads the kernels of the tree it should, however the package is found.

Three ways people run the code:
  (a) an editable install (`make setup`, `pip install -e .`);
  (b) a regular wheel install, also run from inside a source tree, which then shadows the install
      (`python -m pytest` puts the working directory first);
  (c) no install at all: the bare tree on sys.path, as on the GPU machine.
In each, the package and its kernels must come from the same place, and pytest must collect and run.
The top-level `recipes/` folder is mapped the same way (to lowmem_grpo/recipes): the shipped recipes,
and the data files they name, are found in each mode.
Subprocesses run with `python -S` and the environment's site-packages on PYTHONPATH, so no `.pth`
file, and so no editable install, is in effect unless the test wants one.
"""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = sysconfig.get_paths()["purelib"]
PROBE = "import lowmem_grpo, lowmem_grpo.kernels as k, lowmem_grpo.kernels.linear; print(lowmem_grpo.__file__); print(k.__file__)"
RECIPES = "from lowmem_grpo.shipped_recipes import recipes_dir; print(recipes_dir())"


def _python(args, cwd, path=(), site=True, timeout=300):
    """Run this interpreter without site processing; `path` (then site-packages) on PYTHONPATH."""
    env = {"PYTHONPATH": ":".join([*map(str, path), *([SITE] if site else [])]), "PATH": "/usr/bin:/bin",
           "TRITON_INTERPRET": "1", "HOME": str(cwd)}
    proc = subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} in {cwd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _loaded(cwd, path=(), site=True) -> tuple[Path, Path]:
    package, kernels = _python(["-c", PROBE], cwd, path, site).split()[-2:]
    return Path(package).resolve().parent, Path(kernels).resolve().parent


def _copy_tree(dest: Path) -> Path:
    for name in ("lowmem_grpo", "tests", "recipes"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def _pytest_runs(cwd, path=()):
    """The whole suite collects, and the layout test runs, from `cwd`."""
    out = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests"], cwd, path)
    assert "error" not in out.splitlines()[-1], out[-2000:]
    out = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py"], cwd, path)
    assert " passed" in out and "failed" not in out, out[-2000:]


def test_no_install_bare_tree(tmp_path):
    """(c) A bare copy of the tree, nothing installed: its own package and kernels."""
    tree = _copy_tree(tmp_path / "tree")
    assert _loaded(tree) == (tree / "lowmem_grpo", tree / "lowmem_grpo" / "kernels")
    assert Path(_python(["-c", RECIPES], tree).split()[-1]) == tree / "recipes"
    _pytest_runs(tree)


def test_wheel_install_alone_and_shadowed_by_a_tree(tmp_path):
    """(b) A built wheel in a throwaway site: the wheel's kernels from elsewhere, the tree's from the tree."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement); "
                    "building without isolation needs it installed")
    tree = _copy_tree(tmp_path / "tree")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(tree)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel, = (tmp_path / "dist").glob("lowmem_grpo-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    shipped = {f"lowmem_grpo/recipes/{p.relative_to(ROOT / 'recipes')}" for p in (ROOT / "recipes").rglob("*")
               if p.is_file() and p.suffix in (".yaml", ".jsonl", ".py") and "__pycache__" not in p.parts}
    assert shipped and shipped <= names, f"recipes missing from the wheel: {sorted(shipped - names)}"
    assert {"lowmem_grpo/recipes/data/arithmetic_train.jsonl", "lowmem_grpo/recipes/char_e.yaml"} <= names
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _loaded(elsewhere, [site]) == (site / "lowmem_grpo", site / "lowmem_grpo" / "kernels")
    assert not (site / "kernels").exists(), "the wheel installed a top-level `kernels` package"
    assert not (site / "recipes").exists(), "the wheel installed a top-level `recipes` folder"
    assert Path(_python(["-c", RECIPES], elsewhere, [site]).split()[-1]) == site / "lowmem_grpo" / "recipes"
    # a pip-install user copies a recipe with its data, and it loads
    _python(["-m", "lowmem_grpo", "recipes", "cp", "char_e", "mine"], elsewhere, [site])
    assert (elsewhere / "mine" / "char_e.yaml").is_file() and (elsewhere / "mine" / "data" / "char_e_train.jsonl").is_file()
    assert _loaded(tree, [site]) == (tree / "lowmem_grpo", tree / "lowmem_grpo" / "kernels")
    _pytest_runs(tree, [site])


def _editable_install() -> bool:
    """setuptools' editable install leaves an `__editable__...lowmem_grpo...` finder and .pth in site-packages."""
    return any(Path(SITE).glob("__editable__*lowmem_grpo*"))


@pytest.mark.skipif(not _editable_install(), reason="lowmem-grpo is not installed editable in this environment")
def test_editable_install(tmp_path):
    """(a) The editable install of this checkout, with site processing on: this checkout from anywhere."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    package, kernels = (Path(p).resolve().parent for p in proc.stdout.split()[-2:])
    assert kernels == package / "kernels", (package, kernels)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py"],
                          cwd=package.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
