"""Ahead-of-time compilation: its list holds every configuration the launchers produce, and every
kernel in it compiles for sm_75/80/86/89/90 within the target's shared memory, no GPU needed."""

import os
import subprocess
import sys

import pytest
import torch

from lowmem_grpo.kernels import HAS_TRITON, use_backend
from lowmem_grpo.kernels._backend import interpreter_enabled

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

CCS = ("75", "80", "86", "89", "90")
TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _aot_keys():
    """(kernel, logits dtype, constexprs, num_warps) of every configuration aot.py compiles."""
    from lowmem_grpo.kernels.aot import kernel_configs

    keys = set()
    for config in kernel_configs():
        sig = dict(config.signature)
        dtype = (sig.get("logits_ptr") or sig["logp_ptr"]).lstrip("*")
        keys.add((config.kernel, dtype, tuple(sorted(config.constexprs)), config.num_warps))
    return keys


def _row_widths(n_rows: int, vocab: int, chunk_size):
    """Row widths the row kernels are launched with: the whole vocabulary (token_logprobs,
    grpo_token_loss), and each vocabulary slice of the fused head (linear_token_logprobs,
    linear_grpo_loss) with its chunk rule."""
    from lowmem_grpo.kernels.linear import _slices, default_chunk_size

    chunk = default_chunk_size(n_rows, vocab, "cuda") if chunk_size is None else chunk_size
    return {vocab} | {v1 - v0 for v0, v1 in _slices(vocab, chunk)}


# (N, V, H, chunk_size): real vocabularies (Qwen 151936, SmolLM 49152, Llama 128256, GPT-2 50257),
# token counts from one sequence to 16384 (whose last default slice is 384 wide: BLOCK_V 512), tiny
# and odd vocabularies, and explicit chunk sizes down to 1 column.
SHAPES = [(n, v, h, None) for n in (1, 7, 512, 2048, 4096, 16384, 65536) for v in (151936, 49152, 128256, 50257, 32000)
          for h in (576, 896, 4096)]
SHAPES += [(n, v, 64, None) for n in (1, 3, 100) for v in (1, 2, 3, 5, 17, 100, 255, 256, 257, 1000, 4097)]
SHAPES += [(64, 151936, 896, c) for c in (1, 2, 3, 100, 1000, 3000, 5000, 8192, 65536)]


def test_aot_list_holds_every_configuration_the_launcher_rule_produces():
    from lowmem_grpo.kernels.logprobs_triton import block_config

    keys = _aot_keys()
    missing = set()
    for n, v, h, chunk in SHAPES:
        for dtype in TORCH_TO_TRITON.values():  # H and the GEMM dtype do not change a width; dtype is a tag
            for width in _row_widths(n, v, chunk):
                block, warps = block_config(width)
                for kernel, flags in (
                    ("logits_stats_kernel", ("ACCUMULATE", "HAS_ENTROPY")),
                    ("logits_grad_kernel", ("HAS_ENT_GRAD",)),
                    ("grpo_row_kernel", ("HAS_MASK", "HAS_OLD", "HAS_REF", "HAS_WEIGHT")),
                ):
                    for values in range(1 << len(flags)):
                        constexprs = [(f, bool(values >> i & 1)) for i, f in enumerate(flags)] + [("BLOCK_V", block)]
                        key = (kernel, dtype, tuple(sorted(constexprs)), warps)
                        if key not in keys:
                            missing.add((n, v, h, chunk, key))
    assert not missing, (f"{len(missing)} launcher configurations are not compiled ahead of time, "
                         f"e.g. {sorted(missing)[:3]}")
    # N=16384, V=151936: the fused head's last slice is 384 wide, a BLOCK_V the old two-size list lacked
    assert 384 in _row_widths(16384, 151936, None) and block_config(384) == (512, 4)


class _Recorder:
    """Stands in for a jit kernel: records the configuration of each launch, then runs the real kernel."""

    def __init__(self, name, kernel, seen):
        self.name, self.kernel, self.seen = name, kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            num_warps = kwargs.get("num_warps", 4)  # Triton's default
            constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k != "num_warps"))
            self.seen.add((self.name, TORCH_TO_TRITON[args[0].dtype], constexprs, num_warps))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.skipif(not interpreter_enabled(), reason="runs the Triton launchers on CPU tensors in the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_aot_list_holds_every_configuration_the_launchers_actually_launch(monkeypatch, dtype):
    from lowmem_grpo.kernels import grpo_loss_triton, logprobs_triton
    from lowmem_grpo.kernels import grpo_token_loss, grpo_token_terms, linear_token_logprobs, token_logprobs

    seen = set()
    for module, name in ((logprobs_triton, "logits_stats_kernel"), (logprobs_triton, "logits_grad_kernel"),
                         (grpo_loss_triton, "grpo_row_kernel"), (grpo_loss_triton, "grpo_token_kernel")):
        monkeypatch.setattr(module, name, _Recorder(name, getattr(module, name), seen))
    torch.manual_seed(0)
    n, v, h = 5, 37, 8
    ids = torch.randint(0, v, (n,))
    mask = torch.tensor([True, True, False, True, True])
    with use_backend("triton"):
        logits = torch.randn(n, v, dtype=dtype, requires_grad=True)
        logp, ent = token_logprobs(logits * 1, ids, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        loss = grpo_token_loss((logits * 1).view(1, n, v), ids.view(1, n), torch.ones(1), mask=mask.view(1, n),
                               old_logp=torch.zeros(1, n), ref_logp=torch.zeros(1, n), beta=0.1).loss
        loss.sum().backward()
        grpo_token_terms(torch.zeros(1, n), torch.ones(1, n), mask=mask.view(1, n))
        hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
        weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
        for chunk in (16, 1):  # slices 16, 16, 5 and 1 column wide
            linear_token_logprobs(hidden, weight, ids, chunk_size=chunk).sum().backward()
    kernels = {key[0] for key in seen}
    assert kernels == {"logits_stats_kernel", "logits_grad_kernel", "grpo_row_kernel", "grpo_token_kernel"}
    assert {dict(key[2]).get("BLOCK_V") for key in seen} >= {1, 8, 16, 64}
    missing = seen - _aot_keys()
    assert not missing, f"launched but not compiled ahead of time: {sorted(missing)}"


def test_block_v_subset_names_the_choices():
    from lowmem_grpo.kernels.aot import kernel_configs

    with pytest.raises(ValueError, match="384.*choose from"):
        kernel_configs((384,))
    assert len(kernel_configs((1, 4096))) < len(kernel_configs())


def _compile(extra, timeout):
    # A subprocess, because this test session runs the kernels in the interpreter (which replaces
    # them with Python functions) and ahead-of-time compilation needs the real JIT functions.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "lowmem_grpo.kernels.aot", "--cc", *CCS, *extra],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for cc in CCS:
        assert f"sm_{cc} " in proc.stdout
    assert "FAILED" not in proc.stdout
    return proc.stdout


def test_every_kernel_compiles_at_the_extreme_block_sizes():
    # The default suite compiles the smallest and the largest BLOCK_V the launchers use (one of each
    # num_warps); the full list is the slow test below (5 x 554 kernels: 3m00s to 5m12s on this project's
    # shared 2 CPU cores, cold Triton cache, against 67 s for this test file by default).
    from lowmem_grpo.kernels.logprobs_triton import block_configs

    blocks = [b for b, _ in block_configs()]
    _compile(["--block-v", str(min(blocks)), str(max(blocks))], timeout=900)


@pytest.mark.slow
def test_every_kernel_configuration_compiles():
    out = _compile([], timeout=1800)
    from lowmem_grpo.kernels.aot import kernel_configs

    n = len(kernel_configs())
    assert out.count(f"{n}/{n} kernels compiled") == len(CCS)
