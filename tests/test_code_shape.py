"""Measures of a readable package that anyone can rerun: no import cycle, short files, short module
docstrings, short lines, and no tracker numbers, session names or dates in the code.

Each test lists every offender at once, with where it is.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowmem_grpo"
SOURCES = sorted(PACKAGE.rglob("*.py"))
NATIVE = sorted([*PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")])

MAX_FILE_LINES = 600
MAX_MODULE_DOCSTRING_LINES = 15
MAX_LINE_CHARS = 120
# A tracker or work-log reference: "issue 27", "issues 13 and 14", "#13", "session", a date.
TRACKER = re.compile(r"\bissues? \d+|(?<![\w&])#\d+\b|\bsession\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `path` imports, at any depth of the file (inside functions too)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` names a module; `from module import name` not
                candidate = f"{base}.{alias.name}"
                out.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {n for n in out if n in known and n != name}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_find_cycles_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    """No module imports one that (through others) imports it back, at the top of a file or inside a
    function: a package's `__init__` re-exporting its modules is the only edge into a package, and a
    module importing its own package's `__init__` would close a loop, so it counts."""
    known = {_module_name(p) for p in SOURCES}
    graph = {_module_name(p): imports_of(p, known) for p in SOURCES}
    # A submodule importing a name from its package's __init__ that re-exports that submodule is a cycle
    # Python tolerates only by import order; count it like any other.
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_files_are_short():
    long = {_rel(p): n for p in SOURCES + NATIVE if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by what they hold): {long}"


def test_module_docstrings_state_a_contract_briefly():
    long = {}
    for path in SOURCES:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.strip().splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long[_rel(path)] = len(doc.strip().splitlines())
    assert not long, (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (the design story goes in "
                      f"docs/): {long}")


def test_lines_are_short():
    long = [f"{_rel(p)}:{i}" for p in SOURCES + NATIVE
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"lines over {MAX_LINE_CHARS} characters: {long}"


def test_no_tracker_references_in_code():
    found = [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES + NATIVE
             for i, line in enumerate(p.read_text().splitlines(), 1) if TRACKER.search(line)]
    assert not found, "tracker numbers, session names or dates in code (the story goes in docs/):\n" + \
        "\n".join(found)


def test_tracker_pattern_catches_what_it_should():
    for text in ("absent before issue 13", "see #27", "measured 2026-11-24", "the GPU session"):
        assert TRACKER.search(text), text
    for text in ("color #fff", "1.5B model", "version 2.13.0", "an 8 GB card"):
        assert not TRACKER.search(text), text
