"""benchmarks/trainer_step.py's model of an 8 GB card: the allocator gets the card minus the CUDA context."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def _trainer_step():
    spec = importlib.util.spec_from_file_location("trainer_step", ROOT / "benchmarks" / "trainer_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trainer_step"] = module
    spec.loader.exec_module(module)
    return module


def test_allocator_fraction_leaves_the_context_its_share_of_the_card():
    ts = _trainer_step()
    # an 8 GiB card on an 80 GiB device, 0.5 GiB of context: the allocator may take 7.5 GiB = 3/32 of it
    assert ts.allocator_fraction(8 * GiB, GiB // 2, 80 * GiB) == 7.5 / 80
    assert ts.allocator_fraction(80 * GiB, GiB, 40 * GiB) == 1.0  # a card bigger than the device: no cap
    with pytest.raises(ValueError, match="not more than the CUDA context"):
        ts.allocator_fraction(GiB // 2, GiB, 80 * GiB)


@pytest.mark.parametrize("nvml_before", [GiB, None])
def test_cap_subtracts_the_context_measured_at_cuda_init(monkeypatch, nvml_before):
    ts = _trainer_step()
    capped = []
    monkeypatch.setattr(ts, "_nvml_used_bytes", lambda device: nvml_before)  # another process holds 1 GiB
    monkeypatch.setattr(ts, "_init_cuda", lambda device: None)
    monkeypatch.setattr(ts, "outside_allocator_bytes", lambda device: GiB + 600 * 2**20)  # it + our context
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: capped.append((f, device)))
    info = ts.cap_cuda_memory(8, torch.device("cuda", 0))
    context = 600 * 2**20 if nvml_before is not None else GiB + 600 * 2**20
    assert info["context_bytes"] == context
    (fraction, device), = capped
    assert device == torch.device("cuda", 0)
    assert fraction * 80 * GiB == pytest.approx(8 * GiB - context)
    assert info["allocator_cap_bytes"] == pytest.approx(8 * GiB - context, abs=1)
    assert ("NVML" in info["context_measured_by"]) and (("other processes" in info["context_measured_by"])
                                                         == (nvml_before is None))


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
