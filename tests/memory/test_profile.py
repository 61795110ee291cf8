"""The memory profiler: exact categories on hand-checkable steps, and `lowmem-grpo profile` end to end."""

import json

import pytest
import torch
from torch import nn

from lowmem_grpo.memory.profile import CATEGORIES, MemoryProfile
from lowmem_grpo.phases import phase

MiB = 2**20


def _storage_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _at_end(result, category, device="host"):
    tl = result.devices[device]
    return int(tl.bytes[-1, CATEGORIES.index(category)])


def test_weights_gradients_optimizer_states_and_activations_are_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 512)
    params = list(model.parameters())
    with MemoryProfile(params, opt) as prof:
        with phase("forward"):
            loss = model(x).square().mean()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
    result = prof.result
    weight_bytes = _storage_bytes(params)
    assert _at_end(result, "weights") == weight_bytes
    assert _at_end(result, "gradients") == weight_bytes  # every .grad, found by the grad hooks' markers
    states = [v for s in opt.state.values() for v in s.values()]
    assert _at_end(result, "optimizer states") == _storage_bytes(states)
    summary = result.devices["host"].summary()
    # the forward keeps the ReLU input/output and the hidden (256 x 1024 fp32 = 1 MiB each)
    assert summary["phases"]["forward"]["categories"]["activations"] >= 2 * MiB
    for entry in [summary, *summary["phases"].values()]:  # categories add up to each peak
        assert sum(entry["categories"].values()) == entry["peak_bytes"]
    assert set(summary["phases"]) == {"forward", "backward", "optimizer"}


def test_offloaded_optimizer_host_memory_is_counted_by_category(tmp_path):
    # optim.offload_optimizer: the host weight copies and gradient buffers exist before profiling and are
    # named; the 8-bit states (made by the first update, inside the profile) are optimizer states; a CPU
    # run's device-equivalent summary leaves all three out, as they are host RAM on a GPU too.
    pytest.importorskip("bitsandbytes")
    from lowmem_grpo.memory.profile import device_equivalent, profile_trainer
    from lowmem_grpo.training.trainer import Trainer
    from tests.training.conftest import TINY_LLAMA, toy_rows, write_jsonl
    from lowmem_grpo.config import load_config
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(16))
    cfg = load_config(None, [
        f"model.config={json.dumps(TINY_LLAMA)}", "model.tokenizer=none", f"data.train_file={train}",
        "num_generations=4", "max_prompt_length=8", "max_completion_length=6", "per_device_train_batch_size=4",
        "steps_per_generation=2", "optimizer_in_backward=true", "offload_optimizer=true", "optimizer=adamw_8bit",
        "precision=bf16_sr", "reward_funcs=[tests.training.conftest:label_reward]", f"output_dir={tmp_path / 'run'}",
        "progress_bar=false", "device=cpu"])
    trainer = Trainer(cfg)
    prof, _, _ = profile_trainer(trainer, steps=1)
    params = list(trainer.policy.parameters())
    end = {c: _at_end(prof.result, c) for c in ("weights copy", "gradient buffer", "optimizer states")}
    assert end["weights copy"] == _storage_bytes(params)  # bf16 copies of bf16 weights
    # the gradient buffers, and one more for the tied embedding's head contribution (offload.py); views of
    # blocks of host memory (host_arena.py), each counted by its own bytes, not its block's
    head = trainer.optimizer.head_host
    assert end["gradient buffer"] == _storage_bytes(params) + head.numel() * head.element_size()
    # (bitsandbytes' qmaps are 256-entry tables made with the optimizer, before the profile: not new states)
    states = [v for opt in trainer.optimizer.inner.values() for s in opt.state.values() for k, v in s.items()
              if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2")]
    assert end["optimizer states"] == _storage_bytes(states) > 0
    _, summary = device_equivalent(prof, trainer)
    assert not {"weights copy", "gradient buffer", "optimizer states"} & set(summary["categories"])


def test_fused_head_workspace_is_the_loss_head_and_in_backward_gradients_are_gradients():
    from lowmem_grpo.optim.optimizer_in_backward import OptimizerInBackward
    from lowmem_grpo.kernels import linear_token_logprobs
    from lowmem_grpo.kernels.linear import default_chunk_size

    n, h, v = 512, 64, 50_000
    head = nn.Linear(h, v, bias=False)
    proj = nn.Linear(h, h)
    params = list(head.parameters()) + list(proj.parameters())
    opt = OptimizerInBackward([{"params": params, "lr": 1e-3}], lambda groups: torch.optim.SGD(groups, lr=1e-3),
                              max_grad_norm=None)
    x, ids = torch.randn(n, h), torch.randint(0, v, (n,))
    with MemoryProfile(params, opt) as prof:
        with phase("forward"):
            loss = -linear_token_logprobs(proj(x), head.weight, ids).mean()
        with phase("backward"):
            opt.begin_step()
            loss.backward()
            opt.end_step()
    summary = prof.result.devices["host"].summary()
    workspace = n * min(default_chunk_size(n, v, "cpu"), v) * 4
    assert summary["category_max"]["loss head"] >= workspace  # allocated inside the custom op
    # the head's gradient (v x h fp32) exists, then is freed in the hook: counted as a gradient
    assert summary["category_max"]["gradients"] >= v * h * 4
    assert _at_end(prof.result, "gradients") == 0


def test_the_profilers_own_lines_stay_out_of_stderr_and_nothing_else_does(capfd):
    import os
    model = nn.Linear(8, 8)
    with MemoryProfile(list(model.parameters())):
        with phase("forward"):
            model(torch.randn(4, 8)).sum().backward()
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "SyncActivityProfiler" not in err, err
    assert err.endswith("after\n")
    from lowmem_grpo.memory.profile import _quiet_profiler_lines
    with _quiet_profiler_lines():  # a line of anyone else's written while the profiler starts is passed on
        os.write(2, b"USDT:2026-11-28 01:32:59 24882:24882 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a user's warning\n")
    assert capfd.readouterr().err == "a user's warning\n"


def test_profile_command_writes_table_json_and_png(tmp_path, capsys):
    from pathlib import Path
    from lowmem_grpo.cli import main

    recipe = Path(__file__).parents[2] / "recipes" / "toy_tokens.yaml"
    out = tmp_path / "profile"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # a run there: profiling may still look
    code = main(["profile", str(recipe), "--steps", "2", "--out", str(out), f"output_dir={tmp_path / 'run'}",
                 "progress_bar=false", "device=cpu"])  # the host tables; the CUDA profile has its own test
    assert code == 0
    text = capsys.readouterr().out
    assert "PEAK" in text and "planner at this run's lengths" in text
    data = json.loads((out / "profile.json").read_text())
    host = data["devices"]["host"]
    assert sum(host["categories"].values()) == host["peak_bytes"] == data["peak_bytes"]
    for name, entry in host["phases"].items():
        assert sum(entry["categories"].values()) == entry["peak_bytes"], name
    # toy_tokens: beta > 0 (reference on the CPU) and two optimizer steps per generation batch (old log-probs)
    assert set(host["phases"]) == {"rollout", "old log-probs", "reference log-probs", "forward", "backward",
                                   "optimizer"}
    assert host["category_max"]["reference model"] > 0 and host["category_max"]["KV cache"] > 0
    assert data["measured_peak_bytes"] <= data["peak_bytes"]  # reference categories left out
    assert {"peak_bytes", "phases", "categories"} <= data["plan"].keys()
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # profiling saves nothing
    assert not any((tmp_path / "run").glob("checkpoint-*"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the run's log untouched


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_session.sh)")
def test_cuda_profile_matches_the_allocator_and_writes_a_snapshot(tmp_path):
    from lowmem_grpo.kernels import linear_token_logprobs

    torch.manual_seed(0)
    n, h, v = 2048, 256, 32_000
    head = nn.Linear(h, v, bias=False, device="cuda")
    proj = nn.Linear(h, h, device="cuda")
    params = list(head.parameters()) + list(proj.parameters())
    opt = torch.optim.AdamW(params)
    x, ids = torch.randn(n, h, device="cuda"), torch.randint(0, v, (n,), device="cuda")
    snapshot = tmp_path / "snapshot.pickle"
    torch.cuda.reset_peak_memory_stats()
    with MemoryProfile(params, opt, cuda_snapshot=str(snapshot)) as prof:
        with phase("forward"):
            loss = -linear_token_logprobs(proj(x), head.weight, ids).mean()
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
    summary = prof.result.devices["cuda"].summary()
    # The timeline replays the allocator's own events: its peak is the allocator's peak.
    assert summary["peak_bytes"] == torch.cuda.max_memory_allocated()
    assert summary["category_max"]["loss head"] > 0 and summary["category_max"]["gradients"] >= v * h * 4
    assert _at_end(prof.result, "gradients", "cuda") == _storage_bytes([p.grad for p in params])
    assert summary["peak_reserved_bytes"] >= summary["peak_bytes"]
    assert snapshot.stat().st_size > 0


class _FakeCuda:
    """Stands in for torch.cuda's memory API on a CPU: records each call with the device it was given."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name, value in (("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 0),
                            ("max_memory_allocated", 7 * MiB), ("max_memory_reserved", 8 * MiB)):
            monkeypatch.setattr(torch.cuda, name, self._record(name, value))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def _record(self, name, value):
        def call(device=None):
            self.calls.append((name, device))
            return value
        return call


def test_profile_reads_the_given_cuda_device_explicitly_and_resets_its_peak_first(monkeypatch):
    import lowmem_grpo.memory.profile as profile_module

    fake = _FakeCuda(monkeypatch)
    asked = []
    real_profile = profile_module.profile

    def profile(activities, **kwargs):  # what a profile of a CUDA device asks the profiler to record
        asked.append(list(activities))
        return real_profile(activities=activities, **kwargs)
    monkeypatch.setattr(profile_module, "profile", profile)
    model = nn.Linear(64, 64)  # CPU tensors: only the allocator queries go to the (fake) CUDA device
    with MemoryProfile(list(model.parameters()), device="cuda") as prof:
        fake.calls.append(("work", None))
        model(torch.randn(8, 64)).sum().backward()
    names = [name for name, _ in fake.calls]
    assert names.index("reset_peak_memory_stats") < names.index("work") < names.index("max_memory_allocated")
    assert names.index("reset_peak_memory_stats") < names.index("memory_allocated")  # the start is after the reset
    assert all(dev == torch.device("cuda", 1) for name, dev in fake.calls if name != "work"), fake.calls
    # CPU activity only: memory events reach the profiler without CUDA's (kernel and runtime events,
    # millions over a full-length rollout); the cuda test above checks that every allocation is seen
    assert asked == [[torch.profiler.ProfilerActivity.CPU]]
    assert prof.result.extra["cuda_allocator"] == {"device": "cuda:1", "max_allocated_bytes": 7 * MiB,
                                                   "max_reserved_bytes": 8 * MiB}


def test_a_cpu_profile_leaves_cuda_alone_even_where_cuda_is_available(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    model = nn.Linear(64, 64)
    with MemoryProfile(list(model.parameters())) as prof:
        model(torch.randn(8, 64)).sum().backward()
    assert fake.calls == [] and "cuda_allocator" not in prof.result.extra
    assert set(prof.result.devices) == {"host"}
