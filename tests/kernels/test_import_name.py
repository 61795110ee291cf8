"""The source folder `kernels/` must be harmless when something imports it as a top-level `kernels`.

transformers imports any top-level `kernels` it can find while probing for the Hub package of that
name; with the repository root on sys.path (`python -m ...` from the root) that is our folder. A
second registration of the torch.library ops corrupted the dispatcher (seen as segfaults), so the
folder must define nothing under that name.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import kernels                                   # the folder, as transformers would import it
assert not hasattr(kernels, "token_logprobs"), "ops defined under the top-level name"
from transformers.utils import is_kernels_available
assert not is_kernels_available()
import torch
from lowmem_grpo.kernels import grpo_token_loss, token_logprobs
x = torch.randn(2, 3, 50, requires_grad=True)
ids = torch.randint(0, 50, (2, 3))
for _ in range(20):
    (grpo_token_loss(x * 1, ids, torch.randn(2)).loss.sum() + token_logprobs(x * 1, ids).sum()).backward()
try:
    import kernels.logprobs
except ImportError as exc:
    assert "lowmem_grpo.kernels" in str(exc)
else:
    raise AssertionError("kernels.logprobs imported under the wrong name")
print("ok")
"""


def test_top_level_kernels_import_defines_nothing():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
