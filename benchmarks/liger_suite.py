"""Liger-Kernel's own GRPO test file, run against Liger's module and against ours (FusedLinearGRPOLoss), on the CPU.

    python benchmarks/liger_suite.py --liger PATH [--rev REV] [--compiled as-written] [--skip-large]
                                     [--workdir DIR] [-- PYTEST ARGS]

PATH: a Liger-Kernel checkout, or its git directory (read with `git show REV:path`); nothing is fetched. Two
copies of test/chunked_loss/test_grpo_loss.py (with the test/ files it imports) run in separate pytests: Liger's
as it is, and one importing `LigerFusedLinearGRPOLoss` from lowmem_grpo.kernels. Tests calling Liger's functional
or Function APIs directly stay Liger's in both and are counted apart. Prints passed / failed / skipped per copy
and each test passing against Liger's module but not ours (exit status 1 if any). --compiled off (default):
compiled=False in both copies (torch.compile of Liger's loss math only, the same arithmetic; hours on a CPU).
--skip-large: without test_correctness's (8, 128, 1024, 4096) cases. Details: docs/kernels.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["test/__init__.py", "test/conftest.py", "test/utils.py", "test/chunked_loss/__init__.py",
         "test/chunked_loss/test_grpo_loss.py"]
TEST_FILE = "test/chunked_loss/test_grpo_loss.py"
MODULE_IMPORT = "from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss\n"
OURS_IMPORT = "from lowmem_grpo.kernels import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss  # substituted\n"
MODULE_USERS = ("LigerLMHeadGRPO(", "LigerFusedLinearGRPOLoss(")  # a test built on the module names one of them
LARGE_ID = "8-128-1024-4096"


def read_liger_files(liger: Path, rev: str) -> dict[str, str]:
    """The files, from a work tree when `liger` has them, else `git show rev:path` on the git directory."""
    if (liger / TEST_FILE).is_file():
        return {f: (liger / f).read_text() for f in FILES}
    out = {}
    for f in FILES:
        done = subprocess.run(["git", "--git-dir", str(liger), "show", f"{rev}:{f}"], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"cannot read {f} from {liger} at {rev}: {done.stderr.strip()} (pass a Liger-Kernel checkout "
                     "or its git directory with --liger)")
        out[f] = done.stdout
    return out


def module_tests(source: str) -> set[str]:
    """Names of the test functions whose body builds Liger's module (through LigerLMHeadGRPO or directly)."""
    names, current = set(), None
    for line in source.splitlines():
        match = re.match(r"def (test_\w+)\(", line)
        if match:
            current = match.group(1)
        elif line and not line[0].isspace() and not line.startswith(("@", ")")):
            current = None
        if current and any(user in line for user in MODULE_USERS):
            names.add(current)
    return names


def write_copy(root: Path, files: dict[str, str], ours: bool, compiled_off: bool) -> None:
    for name, text in files.items():
        if name == TEST_FILE:
            if compiled_off:
                text = text.replace("compiled=True,", "compiled=False,")
            if ours:
                if MODULE_IMPORT not in text:
                    sys.exit(f"{TEST_FILE} no longer imports the module as `{MODULE_IMPORT.strip()}`: update "
                             "benchmarks/liger_suite.py")
                text = text.replace(MODULE_IMPORT, OURS_IMPORT)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def run_copy(root: Path, pytest_args: list[str]) -> tuple[dict[str, str], float]:
    """{test id: passed | failed | skipped} of one pytest run in `root`, and its wall time."""
    report = root / "report.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", TEST_FILE, "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           "-o", "addopts=", *pytest_args]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if not report.is_file():
        sys.exit(f"pytest wrote no report in {root}: run `{' '.join(cmd)}` there to see why")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[case.get("name")] = outcome
    return outcomes, seconds


def counts(outcomes: dict[str, str], names: set[str], inside: bool) -> str:
    picked = [o for t, o in outcomes.items() if (t.split("[")[0] in names) == inside]
    return ", ".join(f"{sum(o == k for o in picked)} {k}" for k in ("passed", "failed", "skipped"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--liger", type=Path, required=True, help="a Liger-Kernel checkout or its git directory")
    parser.add_argument("--rev", default="HEAD", help="the revision to read from a git directory (default HEAD)")
    parser.add_argument("--compiled", choices=["off", "as-written"], default="off")
    parser.add_argument("--skip-large", action="store_true", help=f"deselect test_correctness's {LARGE_ID} cases")
    parser.add_argument("--workdir", type=Path, help="write the two copies here and keep them (default: a temporary "
                        "directory); rerun one test there with the command this prints")
    parser.add_argument("pytest_args", nargs="*", help="passed on to both pytest runs (after --)")
    args = parser.parse_args()
    files = read_liger_files(args.liger, args.rev)
    users = module_tests(files[TEST_FILE])
    pytest_args = list(args.pytest_args)
    if args.skip_large:
        pytest_args += ["-k", f"not (test_correctness and {LARGE_ID})"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="liger_suite_") as tmp:
        for label, ours in (("liger", False), ("lowmem-grpo", True)):
            root = (args.workdir or Path(tmp)) / label
            write_copy(root, files, ours, args.compiled == "off")
            results[label], seconds = run_copy(root, pytest_args)
            if args.workdir:
                print(f"  rerun: cd {root} && PYTHONPATH={root}:{REPO} {sys.executable} -m pytest {TEST_FILE} -k NAME")
            print(f"{label:12s} {seconds:7.0f} s   module tests: {counts(results[label], users, True)}   "
                  f"Liger-API tests (Liger's in both): {counts(results[label], users, False)}", flush=True)
    regressions = sorted(t for t, o in results["liger"].items()
                         if o == "passed" and results["lowmem-grpo"].get(t) != "passed")
    print(f"module tests: {', '.join(sorted(users))}")
    for label in results:
        failed = sorted(t for t, o in results[label].items() if o == "failed")
        print(f"failed against {label}: {len(failed)}" + "".join(f"\n  {t}" for t in failed[:10])
              + (f"\n  ... {len(failed) - 10} more" if len(failed) > 10 else ""))
    print(f"passing against Liger's module but not against ours: {len(regressions)}")
    for name in regressions:
        print(f"  {name}: {results['lowmem-grpo'].get(name, 'missing')}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
