"""Renamed public import paths keep working for a release, with a DeprecationWarning naming the new one."""

import subprocess
import sys

import pytest


def _run(code: str, *warning_flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *warning_flags, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("old, name, new", [
    ("lowmem_grpo.memory_modes.offload", "OffloadedOptimizerInBackward", "lowmem_grpo.optim.offload.OffloadedOptimizer"),
    ("lowmem_grpo.memory_modes.offload", "host_bytes_per_param", "lowmem_grpo.optim.host_ram.host_bytes_per_param"),
    ("lowmem_grpo.memory_modes.optimizers", "build_optimizer", "lowmem_grpo.optim.optimizers.build_optimizer"),
    ("lowmem_grpo.memory_modes.reference", "Reference", "lowmem_grpo.policy.reference.Reference"),
    ("lowmem_grpo.memory_modes.activation_offload", "offload_activations",
     "lowmem_grpo.training.activation_offload.offload_activations"),
    ("lowmem_grpo.memory_modes.host_arena", "HostArena", "lowmem_grpo.host_arena.HostArena"),
    ("lowmem_grpo.kernels.reference", "grpo_token_terms", "lowmem_grpo.kernels.spec.grpo_token_terms"),
    ("lowmem_grpo.kernels.reference", "_per_sequence", "lowmem_grpo.kernels.spec._per_sequence"),
])
def test_old_path_gives_the_new_object(old, name, new):
    module, attribute = new.rsplit(".", 1)
    code = (f"import importlib; from {old} import {name} as old\n"
            f"new = getattr(importlib.import_module({module!r}), {attribute!r})\n"
            f"assert old is new, (old, new)")
    done = _run(code)
    assert done.returncode == 0, done.stderr


def test_old_path_warns_with_the_new_one():
    done = _run("import lowmem_grpo.memory_modes.offload", "-W", "error::DeprecationWarning")
    assert done.returncode != 0
    assert "DeprecationWarning" in done.stderr and "lowmem_grpo.optim" in done.stderr, done.stderr


def test_the_spec_module_old_path_warns_with_the_new_one():
    done = _run("from lowmem_grpo.kernels import reference", "-W", "error::DeprecationWarning")
    assert done.returncode != 0
    assert "DeprecationWarning" in done.stderr and "lowmem_grpo.kernels.spec" in done.stderr, done.stderr


def test_the_model_pass_old_name_warns_and_is_the_new_function():
    code = ("import warnings; from lowmem_grpo.policy import logprobs\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    old = logprobs.token_logprobs\n"
            "assert old is logprobs.completion_logprobs, old\n"
            "assert [w.category for w in seen] == [DeprecationWarning], seen\n"
            "assert 'completion_logprobs' in str(seen[0].message), seen[0].message")
    done = _run(code)
    assert done.returncode == 0, done.stderr


def test_new_paths_do_not_warn():
    done = _run("import lowmem_grpo.optim.offload, lowmem_grpo.policy.reference, lowmem_grpo.kernels.spec, "
                "lowmem_grpo.training.activation_offload; "
                "from lowmem_grpo.policy.logprobs import completion_logprobs", "-W", "error::DeprecationWarning")
    assert done.returncode == 0, done.stderr
