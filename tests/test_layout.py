"""The package's layers import downward only (lowmem_grpo/__init__.py lists them).

Every import of a lowmem_grpo module, at the top of a file or inside a function, is read from the
source with `ast` and checked against the packages its own package may use. A new upward import (the
trainer importing the CLI, the memory modes importing the training loop) fails here by name.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowmem_grpo"

# package (first component under lowmem_grpo) -> the other packages it may import
BELOW = {
    "ranges": set(),  # the value ranges both the kernels and the config check (one copy of each rule)
    "phases": set(),
    "transfers": set(),  # the host<->device byte counter every copy site calls
    "host_arena": set(),  # pinned host memory: the optimizer's states, offloaded activations, the reference
    "native_build": set(),  # compiling the plain-C++ CPU kernels (the host optimizer's, the decode attention)
    "kernels": {"ranges"},
    "integrations": {"ranges", "kernels", "config", "policy"},  # TRL's trainer on our kernels and rollouts; nothing
                                                                # imports it
    "config": {"ranges"},
    "shipped_recipes": set(),
    "optim": {"ranges", "config", "phases", "host_arena", "transfers", "native_build"},
    "policy": {"ranges", "config", "kernels", "host_arena", "transfers", "native_build"},
    "rewards": {"policy", "transfers"},  # reward models stream their layers as the reference model does
    "training": {"ranges", "config", "phases", "host_arena", "transfers", "kernels", "policy", "rewards", "optim"},
    "memory": {"ranges", "config", "phases", "host_arena", "transfers", "kernels", "policy", "rewards", "optim", "training"},
    "memory_modes": {"host_arena", "optim", "policy", "training"},  # the old import path, deprecated
    "api": {"ranges", "config", "phases", "host_arena", "transfers", "kernels", "shipped_recipes", "policy", "rewards", "optim",
            "training"},
    "cli": {"ranges", "config", "phases", "host_arena", "transfers", "kernels", "shipped_recipes", "policy", "rewards", "optim",
            "training", "memory", "api"},
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield "lowmem_grpo." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts), path


def _imported(module: str, path: pathlib.Path) -> set[str]:
    """Absolute names of the lowmem_grpo modules (or packages) `path` imports."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if path.name == "__init__.py":
        package = package[:-1]  # module ends in .__init__
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if node.level and not node.module else [base]
            out.update(n for n in names if n.startswith("lowmem_grpo"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lowmem_grpo"))
    return out


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("module, path", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_point_down(module, path):
    own = _layer(module)
    if own in ("__init__", "__main__"):  # the package root (its lazy API names) and `python -m lowmem_grpo`
        allowed = {"cli", "api"}
    else:
        allowed = BELOW[own] | {own}
    bad = sorted(n for n in _imported(module, path) if _layer(n) not in allowed and _layer(n) is not None)
    assert not bad, f"{module} imports {bad}: {own} may import only {sorted(allowed)}"


def test_every_package_is_placed():
    placed = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    placed |= {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    assert placed <= set(BELOW), f"not placed in a layer: {sorted(placed - set(BELOW))}"


def test_every_subpackage_is_installed():
    """pyproject.toml lists the packages a `pip install .` (not editable) copies: every subpackage."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"lowmem_grpo." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE else "lowmem_grpo"
             for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"subpackages missing from pyproject.toml's packages: {sorted(found - listed)}"


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages by name: a new folder (lowmem_grpo/api/) must be added there."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml's packages lacks {sorted(found - listed)}"
