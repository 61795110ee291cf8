"""The GPU session's cuda-tests part runs each test once: its steps select disjoint sets of tests."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_session():
    spec = importlib.util.spec_from_file_location("gpu_session", ROOT / "benchmarks" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_session"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _collect(argv: list[str]) -> set[str]:
    """The test ids a step's pytest command selects on a GPU machine (collection only, CUDA faked)."""
    i = argv.index("pytest")
    args = [a for a in argv[i + 1:] if a != "-q"]  # exactly one -q: node ids, one a line (-qq lists files)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.fake_cuda_plugin", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_cuda_tests_steps_select_each_test_once():
    steps = _gpu_session().parts(tiny=False)["cuda-tests"]
    selected = {step.name: _collect(step.argv) for step in steps}
    for name, tests in selected.items():
        assert tests, f"step {name!r} selects no test on a GPU machine"
    (a, tests_a), (b, tests_b) = selected.items()
    both = tests_a & tests_b
    assert not both, f"{len(both)} tests run in both {a!r} and {b!r}, e.g. {sorted(both)[:3]}"
    # the large-memory tests run, once, in the cuda-marked step; op tests on CUDA tensors in the other
    assert any("test_cuda_large.py" in t for t in tests_a)
    assert any("[cuda-triton" in t for t in tests_b) and any("[cuda-torch" in t for t in tests_b)
