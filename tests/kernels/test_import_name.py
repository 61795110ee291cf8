"""No third-party probe can import our kernels as a top-level `kernels`.

`kernels` is the name of Hugging Face's Hub package, which transformers and bitsandbytes import when
they find it. Our fused ops once sat in a top-level `kernels/` folder: with the repository root on
sys.path (the bare tree on the GPU machine, `python -m` from the root) bitsandbytes imported it and
logged "Failed to load CPU gemm_4bit_forward from kernels-community: cannot import name 'get_kernel'
from 'kernels'". They now live in lowmem_grpo/kernels/, so the root holds nothing by that name.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = f"""
import importlib.util, logging, pathlib, sys, warnings
sys.path.insert(0, {str(ROOT)!r})                # the bare tree, as gpu_session.sh and `python -m` put it
spec = importlib.util.find_spec("kernels")
assert spec is None or not pathlib.Path(spec.origin or "").resolve().is_relative_to({str(ROOT)!r}), spec
records = []
handler = type("H", (logging.Handler,), {{"emit": lambda s, r: records.append(r.getMessage())}})()
logging.basicConfig(level=logging.DEBUG, handlers=[handler])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import bitsandbytes                          # probes for the Hub's kernels package at import
from transformers.utils import is_kernels_available
said = [m for m in records + [str(w.message) for w in caught] if "kernels" in m and "get_kernel" in m]
assert not said, said
import lowmem_grpo.kernels as ops
assert pathlib.Path(ops.__file__).resolve().parent == pathlib.Path({str(ROOT)!r}) / "lowmem_grpo" / "kernels"
print("ok", is_kernels_available())
"""


def test_the_tree_root_holds_no_kernels_package():
    assert not (ROOT / "kernels").exists(), "a top-level kernels/ folder answers probes for the Hub package"


def test_bitsandbytes_probe_from_the_bare_tree_finds_nothing_of_ours():
    pytest.importorskip("bitsandbytes")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("ok"), proc.stdout + proc.stderr
