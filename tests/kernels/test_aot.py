"""Every Triton kernel compiles for sm_75/80/86/89/90 within the target's shared memory, no GPU needed."""

import os
import subprocess
import sys

import pytest

from lowmem_grpo.kernels import HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_compiles_for_consumer_and_datacenter_gpus():
    # A subprocess, because this test session runs the kernels in the interpreter (which replaces
    # them with Python functions) and ahead-of-time compilation needs the real JIT functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "lowmem_grpo.kernels.aot", "--cc", "75", "80", "86", "89", "90"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cc in (75, 80, 86, 89, 90):
        assert f"sm_{cc} " in proc.stdout
    assert "FAILED" not in proc.stdout
