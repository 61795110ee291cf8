"""benchmarks/trainer_step.py's model of an 8 GB card (the allocator gets the card minus the CUDA context),
its allocator set up as `lowmem-grpo train` sets it up (as plan_accuracy.py's), and what its results
record."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def _trainer_step():
    return load_benchmark("trainer_step")


def test_allocator_fraction_leaves_the_context_its_share_of_the_card():
    ts = _trainer_step()
    # an 8 GiB card on an 80 GiB device, 0.5 GiB of context: the allocator may take 7.5 GiB = 3/32 of it
    assert ts.allocator_fraction(8 * GiB, GiB // 2, 80 * GiB) == 7.5 / 80
    assert ts.allocator_fraction(80 * GiB, GiB, 40 * GiB) == 1.0  # a card bigger than the device: no cap
    with pytest.raises(ValueError, match="not more than the CUDA context"):
        ts.allocator_fraction(GiB // 2, GiB, 80 * GiB)


def _fake_cuda_start(monkeypatch, ts, nvml: list, outside_after_init: int, reserved: int = 2 * 2**20):
    """A GPU that is not started yet: NVML reads `nvml` (one reading each call, None: no NVML); CUDA's start
    leaves `outside_after_init` outside the allocator (mem_get_info's meter) and `reserved` in it."""
    started = []
    readings = iter(nvml)
    monkeypatch.setattr(ts, "_nvml_used_bytes", lambda device: next(readings))
    monkeypatch.setattr(ts, "_init_cuda", lambda device: started.append(device))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(ts, "outside_allocator_bytes", lambda device: outside_after_init)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))


@pytest.mark.parametrize("nvml", [[GiB, GiB + 600 * 2**20 + 2 * 2**20], [None]])
def test_cap_subtracts_the_context_measured_at_cuda_init(monkeypatch, nvml):
    ts = _trainer_step()
    capped = []
    # another process holds 1 GiB; our context 600 MiB; mem_get_info's meter counts 0.9 GiB the driver keeps
    # beside them, which NVML's does not: one meter on both sides
    _fake_cuda_start(monkeypatch, ts, nvml, outside_after_init=GiB + 600 * 2**20 + 900 * 2**20)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: capped.append((f, device)))
    info = ts.cap_cuda_memory(8, torch.device("cuda", 0))
    context = 600 * 2**20 if nvml[0] is not None else GiB + 1500 * 2**20
    assert info["context_bytes"] == context
    (fraction, device), = capped
    assert device == torch.device("cuda", 0)
    assert fraction * 80 * GiB == pytest.approx(8 * GiB - context)
    assert info["allocator_cap_bytes"] == pytest.approx(8 * GiB - context, abs=1)
    assert ("NVML before and after" in info["context_measured_by"]) == (nvml[0] is not None)


def test_a_context_nvml_barely_sees_is_measured_outside_the_allocator_instead(monkeypatch):
    ts = _trainer_step()
    _fake_cuda_start(monkeypatch, ts, [GiB, GiB + 2 * 2**20 + 2**19], outside_after_init=900 * 2**20)  # 0.5 MiB
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: None)
    info = ts.cap_cuda_memory(8, torch.device("cuda", 0))
    assert info["context_bytes"] == 900 * 2**20 and "only 0.5 MiB" in info["context_measured_by"]


def test_cap_of_a_device_without_an_index_is_set_on_the_current_device(monkeypatch):
    ts = _trainer_step()
    capped = []

    def set_fraction(fraction, device):  # as torch: a torch.device must name its index
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, but got:{device}")
        capped.append((fraction, device))
    monkeypatch.setattr(ts, "_nvml_used_bytes", lambda device: None)
    monkeypatch.setattr(ts, "_init_cuda", lambda device: None)
    monkeypatch.setattr(ts, "outside_allocator_bytes", lambda device: GiB // 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    info = ts.cap_cuda_memory(8, torch.device("cuda"))  # --device cuda, the default on a GPU machine
    assert capped == [(7.5 / 80, torch.device("cuda", 1))]
    assert info["allocator_cap_bytes"] == int(7.5 * GiB)


class _StartsCuda(Exception):
    """Raised where the benchmark would first touch CUDA."""


def _no_allocator_settings(monkeypatch):
    """No allocator variable set (restored after the test, whatever the code under test sets), and a GPU
    that torch reports without CUDA having started, as at the start of a benchmark on a GPU machine."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def _allocator_seen(seen: dict):
    def first_cuda_use(*args, **kwargs):
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise _StartsCuda
    return first_cuda_use


def test_trainer_step_sets_expandable_segments_before_cuda_starts(monkeypatch):
    ts = _trainer_step()
    _no_allocator_settings(monkeypatch)
    seen = {}
    monkeypatch.setattr(ts, "cap_cuda_memory", _allocator_seen(seen))  # the first thing that starts CUDA
    with pytest.raises(_StartsCuda):
        ts.main(["--device", "cuda", "--memory-cap-gib", "8", "--tiny"])
    assert seen["conf"] == "expandable_segments:True"


def test_plan_accuracy_sets_expandable_segments_before_cuda_starts_and_records_it(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    _trainer_step()
    pa = load_benchmark("plan_accuracy")
    _no_allocator_settings(monkeypatch)
    seen = {}
    monkeypatch.setattr(pa, "cap_cuda_memory", _allocator_seen(seen))
    with pytest.raises(_StartsCuda):
        pa.main(["--device", "cuda", "--memory-cap-gib", "8", "--only", "qwen0.5b-gsm8k"])
    assert seen["conf"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # a second run, on the CPU: what its rows record
    monkeypatch.setattr(pa, "measure", lambda name, *args: {"config": name, "measured_peak_bytes": GiB,
                                                           "predicted_peak_bytes": GiB, "error": 0.0})
    pa.main(["--device", "cpu", "--only", "qwen0.5b-gsm8k", "--json", str(tmp_path / "rows.json")])
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["allocator"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "set_here": True,
                                "PYTORCH_ALLOC_CONF": None, "cuda_initialized_before": False}


def test_a_tiny_offloaded_run_records_allocator_time_split_pinned_memory_and_plan(monkeypatch, tmp_path):
    # the 1.5B recipe's modes (offloaded optimizer, streamed reference) at toy width on the CPU
    ts = _trainer_step()
    _no_allocator_settings(monkeypatch)
    real_build, seen = ts.build, {}

    def build(args, before_trainer=None):  # on a GPU machine this is where CUDA starts (no cap asked for)
        seen["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the rest runs on the CPU
        return real_build(args, before_trainer)
    monkeypatch.setattr(ts, "build", build)
    out = tmp_path / "result.json"
    recipe = str(ROOT / "recipes" / "qwen2.5-1.5b_gsm8k_8gb.yaml")
    assert ts.main(["--arch", "Qwen2.5-1.5B", "--recipe", recipe, "--tiny", "--prompt-len", "8",
                    "--completion-len", "4", "--steps", "2", "--device", "cpu", "--json", str(out)]) == 0
    assert seen["conf"] == "expandable_segments:True"
    result = json.loads(out.read_text())
    assert result["allocator"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert result["allocator"]["set_here"] and not result["allocator"]["cuda_initialized_before"]
    assert result["planned_peak_bytes"] > 0 and result["planned_pinned_host_bytes"] == 0  # a CPU pins nothing
    assert result["pinned_after_setup"]["total_bytes"] == 0
    for row in result["steps"]:
        assert row["generation_s"] > 0 and row["training_s"] > 0
        assert row["generation_s"] + row["training_s"] == pytest.approx(row["step_s"])
        assert row["host_update_s"] > 0 and row["host_update_wait_s"] >= 0  # the offloaded optimizer's
        assert row["pinned"]["total_bytes"] == 0


@pytest.mark.parametrize("head_once", [True, False])
def test_the_plan_pins_the_staging_ring_only_where_a_later_gradient_needs_it(head_once):
    """The 1.5B recipe's layer-major backward at toy width, untied, on the CPU: with the head's gradient sent
    once too, no gradient crosses after the first micro-batch and the ring is never made (an H200 run pinned
    64 MiB less than planned); without it the head's arrives through the ring. The plan's pinned bytes are
    what the run made, to the byte (the same blocks as on a GPU, in plain memory)."""
    from lowmem_grpo.memory.plan import Arch, plan
    from lowmem_grpo.memory.presets import preset
    ts = _trainer_step()
    arch = {**preset("Qwen2.5-1.5B"), "tie_word_embeddings": False}
    args = SimpleNamespace(arch=arch, recipe=str(ROOT / "recipes" / "qwen2.5-1.5b_gsm8k_8gb.yaml"), tiny=True,
                           layers=None, prompt_len=8, completion_len=4, device="cpu",
                           overrides=[f"train.head_gradient_once_per_step={str(head_once).lower()}"])
    trainer = ts.build(args)
    trainer.run_step()
    opt = trainer.optimizer
    made = [opt.arena] + ([opt.head_arena] if opt.head_arena is not None else [])
    made = sum(b.nbytes for b in made) + (opt._staging.nbytes if opt._staging is not None else 0)
    assert (opt._staging is None) == head_once
    planned = plan(trainer.cfg, Arch.from_config(trainer.policy.config), device="cuda")
    assert planned.host_categories["weights copy"] + planned.host_categories["gradient buffer"] == made


def test_pinned_host_bytes_counts_pinned_arenas_only(monkeypatch):
    ts = _trainer_step()
    pinned, plain = ts.HostArena([((1000,), torch.float32)]), ts.HostArena([((3000,), torch.float32)])
    pinned.pinned = True  # (registering needs CUDA; the count reads the flag)
    try:
        out = ts.pinned_host_bytes(torch.device("cpu"))
    finally:
        pinned.pinned = False
    assert out["arenas"] == 1 and out["arena_bytes"] == pinned.nbytes == 4096 and out["total_bytes"] == 4096
    del plain


CAP_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "benchmarks")
import trainer_step as ts
dev = torch.device("cuda", 0)
info = ts.cap_cuda_memory(2, dev)
cap = info["allocator_cap_bytes"]
ok = torch.empty(cap - 64 * 2**20, dtype=torch.uint8, device=dev)  # fits under the cap
try:
    torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)  # past it: the modelled card is full
    over = False
except torch.OutOfMemoryError:
    over = True
print(json.dumps({**info, "over_cap_refused": over, "outside_allocator_end": ts.outside_allocator_bytes(dev)}))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_the_cap_models_a_2_gib_card_on_the_real_gpu():
    # a subprocess: the cap and the context measurement need a process whose CUDA is not initialised yet
    proc = subprocess.run([sys.executable, "-c", CAP_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 50 * 2**20 < info["context_bytes"] < 2 * GiB  # a CUDA context is hundreds of MiB
    assert info["allocator_cap_bytes"] + info["context_bytes"] == pytest.approx(2 * GiB, abs=2**20)
    assert info["over_cap_refused"]
