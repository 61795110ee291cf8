"""Faults injected on purpose: each ends in a clear message and loses nothing (docs/usage.md, "Checkpoints and faults").

SIGKILL at chosen and at random moments (saves included), disk full during a save, corrupted and
truncated checkpoints, pickled code in a checkpoint, out of memory in every phase, a hanging reward
function, a torn last line in the logs.
"""

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lowmem_grpo.rewards.timeout import RewardTimeout, call_with_timeout
from lowmem_grpo.training import checkpoint as ckpt
from lowmem_grpo.training.checkpoint import CheckpointError, list_checkpoints, resolve_resume
from lowmem_grpo.training.metrics import _truncate_after, read_metrics
from lowmem_grpo.training.stopping import RunOutOfMemory
from lowmem_grpo.training.trainer import Trainer
from tests.training.conftest import toy_rows, write_jsonl
from tests.training.fault_driver import toy_overrides

ROOT = Path(__file__).resolve().parents[2]
TIMING = {"step_time", "generation_time", "tokens_per_second", "peak_memory_bytes"}


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_loads(output_dir) -> int:
    """resume_from=latest resolves, verifies and loads; returns its step."""
    path = resolve_resume("latest", output_dir)
    state = ckpt.load_state(path)
    assert not [p for p in os.listdir(output_dir) if p.startswith(".tmp-checkpoint-")]  # cleaned up on resume
    return state["step"]


# ----- SIGKILL ----------------------------------------------------------------------------------------
def _driver(kill_at: str, output_dir, train_file, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.training.fault_driver", kill_at, str(output_dir),
                             str(train_file), *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _straight(tmp_path, train_file, max_steps: int):
    from lowmem_grpo.config import load_config
    trainer = Trainer(load_config(None, toy_overrides(tmp_path / "straight", train_file, f"max_steps={max_steps}")))
    trainer.train()
    return _params(trainer.policy), read_metrics(tmp_path / "straight")


def _assert_same_run(tmp_path, output_dir, train_file, straight) -> None:
    """Resumed once more and run to its end (here), the killed run ends with the straight run's weights
    and metrics: nothing lost."""
    from lowmem_grpo.config import load_config
    params, rows = straight
    final = Trainer(load_config(None, toy_overrides(output_dir, train_file, "resume_from=latest", "max_steps=4")))
    final.train()
    for k, v in _params(final.policy).items():
        assert torch.equal(v, params[k]), k
    got = read_metrics(output_dir)
    assert [r["step"] for r in got] == [r["step"] for r in rows]
    for a, b in zip(rows, got):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}


def test_sigkill_during_saves_then_resume_continues_exactly(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(64))
    out = tmp_path / "killed"
    # (kill point, the step resume_from=latest must then find): each kill lands inside a save. Killed
    # before the manifest is written is the leftover-folder case below (no subprocess needed).
    for kill_at, expected in (("state:2", 1), ("rename:1", 1), ("prune:1", 2)):
        proc = _driver(kill_at, out, train, "max_steps=4")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        assert _assert_loads(out) == expected, kill_at
    _assert_same_run(tmp_path, out, train, _straight(tmp_path, train, 4))


def _start_driver(out, train, err) -> subprocess.Popen:
    """A driver process with no kill point; returns once it has started training (config.json reappears)."""
    (Path(out) / "config.json").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tests.training.fault_driver", "none", str(out), str(train),
                             "max_steps=4"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    while proc.poll() is None and not (Path(out) / "config.json").exists():
        time.sleep(0.01)
    return proc


@pytest.mark.slow
def test_sigkill_at_random_moments_many_times(tmp_path):
    """Kill a run that saves every step at random moments of its training (start-up excluded) until it
    finishes, then start another; every kill must leave a loadable `latest`, every run end as the
    straight one. LOWMEM_GRPO_KILLS sets how many kills (default 40)."""
    kills, rng = int(os.environ.get("LOWMEM_GRPO_KILLS", "40")), random.Random(0)
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(64))
    straight = _straight(tmp_path, train, 4)
    with open(tmp_path / "stderr.txt", "w") as err:  # how long a whole run trains in its own process
        proc = _start_driver(tmp_path / "calibrate", train, err)
        t0 = time.perf_counter()
        assert proc.wait() == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
        run_time = time.perf_counter() - t0
    done, runs, in_save = 0, 0, 0
    while done < kills:
        out = tmp_path / f"run{runs}"
        while done < kills:
            with open(tmp_path / "stderr.txt", "w") as err:
                proc = _start_driver(out, train, err)
                try:
                    proc.wait(timeout=rng.uniform(0.0, run_time))
                except subprocess.TimeoutExpired:
                    in_save += any(p.name.startswith(".tmp-checkpoint-") for p in out.iterdir())
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    done += 1
                    if any(p.name.startswith("checkpoint-") for p in out.iterdir()):
                        _assert_loads(out)
                    continue
            assert proc.returncode == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
            _assert_same_run(tmp_path, out, train, straight)
            break
        runs += 1
    print(f"\n{done} SIGKILLs ({in_save} with a save in progress) over {runs} runs: every resume loaded, every "
          f"finished run ended as the straight run")


# ----- disk full --------------------------------------------------------------------------------------
def test_disk_full_during_a_save_stops_and_keeps_the_previous_checkpoint(toy_config, monkeypatch):
    cfg = toy_config("max_steps=4", "save_steps=1")
    trainer = Trainer(cfg)
    real_save, calls = torch.save, {"n": 0}

    def full_disk(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint: half of the file lands, then the disk is full
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    out = Path(cfg.output.output_dir).resolve()
    with pytest.raises(CheckpointError, match=rf"no space left on the disk holding {re.escape(str(out))} while writing "
                                              r"checkpoint-2 .*free space there.*checkpoint-1 is intact"):
        trainer.train()
    assert calls["n"] == 2  # no second attempt at the save that just failed
    assert [s for s, _ in list_checkpoints(out)] == [1]
    assert not [p for p in os.listdir(out) if p.startswith(".tmp")]  # the half-written folder is gone
    monkeypatch.setattr(torch, "save", real_save)
    assert Trainer(toy_config("max_steps=4", "resume_from=latest")).step == 1


# ----- corrupted, truncated, unsafe checkpoints -------------------------------------------------------
@pytest.fixture
def two_checkpoints(toy_config):
    cfg = toy_config("max_steps=2", "save_steps=1", "save_total_limit=2")
    Trainer(cfg).train()
    return cfg.output.output_dir


@pytest.mark.parametrize("damage", ["truncate weights", "flip a byte of the state", "delete the state"])
def test_a_damaged_checkpoint_is_named_and_latest_falls_back(two_checkpoints, toy_config, damage, logged):
    newest = Path(two_checkpoints) / "checkpoint-2"
    target = newest / ("model.safetensors" if damage == "truncate weights" else ckpt.STATE_FILE)
    if damage == "truncate weights":
        os.truncate(target, target.stat().st_size // 2)
    elif damage == "flip a byte of the state":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
        resolve_resume(str(newest), two_checkpoints)
    with logged(rf"skipping checkpoint-2: {re.escape(str(target))}"):
        resumed = Trainer(toy_config("max_steps=3", "resume_from=latest"))
    assert resumed.step == 1 and resumed.resumed_from.name == "checkpoint-1"
    resumed.train()
    assert [r["step"] for r in read_metrics(two_checkpoints)] == [1, 2, 3]


def test_reading_a_truncated_state_names_the_file(two_checkpoints):
    state = Path(two_checkpoints) / "checkpoint-2" / ckpt.STATE_FILE
    os.truncate(state, state.stat().st_size // 3)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(state))} is corrupted or truncated"):
        ckpt.load_state(state.parent)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_holding_pickled_code_is_refused(two_checkpoints, toy_config, tmp_path):
    newest = Path(two_checkpoints) / "checkpoint-2"
    marker = tmp_path / "code_ran"
    evil = _RunsCode()
    evil.marker = marker
    state = ckpt.load_state(newest)
    state["sampler"]["extra"] = evil  # a checkpoint from the internet, its manifest made to match
    torch.save(state, newest / ckpt.STATE_FILE)
    ckpt._write_manifest(newest)
    with pytest.raises(CheckpointError, match=rf"refused to load {re.escape(str(newest / ckpt.STATE_FILE))}: it holds pickled "
                                              r"Python objects.*could run code"):
        Trainer(toy_config("max_steps=3", f"resume_from={newest}"))
    assert not marker.exists()
    torch.load(newest / ckpt.STATE_FILE, weights_only=False)  # the test's own check: the payload does run
    assert marker.exists()


def test_leftover_temporary_folders_are_never_checkpoints_and_are_removed(two_checkpoints, toy_config, logged):
    out = Path(two_checkpoints)
    leftover = out / ".tmp-checkpoint-9-12345"
    (out / "checkpoint-2").rename(leftover)  # a complete-looking folder that was never renamed into place
    half = out / "checkpoint-5"  # a folder with the right name but no manifest (killed before it)
    half.mkdir()
    (half / ckpt.STATE_FILE).write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(out)] == [1]
    with logged("skipping checkpoint-5: .* has no manifest.json"):
        assert Trainer(toy_config("max_steps=3", "resume_from=latest")).step == 1
    assert not leftover.exists()


# ----- out of memory in every phase -------------------------------------------------------------------
def _raise_oom_on_second_call(real):
    calls = {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(*args, **kwargs)
    return patched


@pytest.mark.parametrize("phase, extra, fix", [
    ("rollout", [], r"generation_micro_batch_size=32"),
    ("old log-probs", ["num_iterations=2", "logprob_micro_batch_size=4"], r"logprob_micro_batch_size=2"),
    ("reference log-probs", ["beta=0.04", "reference_compute=stream"], r"reference_compute=cpu"),
    ("forward", [], r"offload_activations=true"),
    ("backward", ["gradient_checkpointing=false"], r"gradient_checkpointing=true"),
    ("optimizer", [], r"optimizer=adamw_8bit"),
    ("forward", ["offload_activations=true", "steps_per_generation=2", "generation_batch_size=null"],
     r"per_device_train_batch_size=4 with gradient_accumulation_steps=2"),
    ("forward", ["offload_activations=true", "optimizer_in_backward=true", "steps_per_generation=2",
                 "generation_batch_size=null"],
     r"per_device_train_batch_size=4 with steps_per_generation=4 \(optimizer_in_backward updates once"),
])
def test_out_of_memory_names_the_phase_and_the_cheapest_fix_and_saves(toy_config, monkeypatch, phase, extra, fix):
    import lowmem_grpo.training.generation as generation
    from lowmem_grpo.policy.reference import Reference
    if phase == "reference log-probs":  # the stream mode needs a GPU: its log-probs are patched away anyway
        monkeypatch.setattr(Reference, "__init__", lambda self, model, device, mode: setattr(self, "device", device))
    trainer = Trainer(toy_config("max_steps=4", *extra))
    if phase == "rollout":
        monkeypatch.setattr(generation, "generate", _raise_oom_on_second_call(generation.generate))
    elif phase == "old log-probs":
        monkeypatch.setattr(generation, "completion_logprobs",
                            _raise_oom_on_second_call(generation.completion_logprobs))
    elif phase == "reference log-probs":
        calls = {"n": 0}

        def logprobs(self, batch, **kw):  # the first batch gets zeros (ratio to itself), the second fails
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return torch.zeros(batch.completion_ids.shape)
        monkeypatch.setattr(Reference, "logprobs", logprobs)
    elif phase == "forward":
        monkeypatch.setattr(trainer, "micro_batch_loss", _raise_oom_on_second_call(trainer.micro_batch_loss))
    elif phase == "backward":
        monkeypatch.setattr(torch.Tensor, "backward", _raise_oom_on_second_call(torch.Tensor.backward))
    else:
        monkeypatch.setattr(trainer.optimizer, "step", _raise_oom_on_second_call(trainer.optimizer.step))
    saved_step = 2 if phase == "old log-probs" else 1  # num_iterations=2: the second batch comes at step 3
    out = Path(trainer.cfg.output.output_dir)
    with pytest.raises(RunOutOfMemory, match=rf"out of memory in the {phase} phase of step {saved_step + 1}\. "
                                             rf"Cheapest fix: {fix}.*lowmem-grpo plan RECIPE.*"
                                             rf"Checkpoint {re.escape(str(out / f'checkpoint-{saved_step}'))} holds the run"):
        trainer.train()
    assert [s for s, _ in list_checkpoints(out)] == [saved_step]
    _assert_loads(out)


@pytest.mark.parametrize("when", ["during", "start", "end"])
def test_out_of_memory_in_evaluation_names_it_and_the_eval_batch_size(toy_config, monkeypatch, when):
    # Evaluation decodes eval_batch_size prompts at once (64 by default): its KV cache can be the run's
    # largest. Its error names the evaluation and eval_batch_size, during the run (after the save) and
    # at either end of it (outside the loop: before the first step nothing is saved yet).
    import lowmem_grpo.training.evaluate as evaluate_module
    extra = {"during": ["eval_steps=2", "save_steps=0"], "start": ["eval_on_start=true"],
             "end": ["eval_on_end=true"]}[when]
    trainer = Trainer(toy_config("max_steps=3", "eval_batch_size=8", *extra))

    def generate_oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    monkeypatch.setattr(evaluate_module, "generate", generate_oom)
    out = Path(trainer.cfg.output.output_dir)
    where = {"during": "the evaluation after step 2", "start": "the evaluation before training",
             "end": "the evaluation after step 3"}[when]
    saved = {"during": rf"Checkpoint {re.escape(str(out / 'checkpoint-2'))} holds the run",
             "start": "No checkpoint exists yet", "end": rf"Checkpoint {re.escape(str(out / 'checkpoint-3'))}"}[when]
    with pytest.raises(RunOutOfMemory, match=rf"out of memory in {where}\. Cheapest fix: eval_batch_size=4 .*"
                                             rf"lowmem-grpo plan RECIPE.*{saved}"):
        trainer.train()


def test_out_of_memory_is_still_a_torch_out_of_memory_error():
    assert issubclass(RunOutOfMemory, torch.OutOfMemoryError)


# ----- a reward function that hangs -------------------------------------------------------------------
_release = threading.Event()


def hanging_reward(prompts, completions, completion_ids, label, **kwargs):
    hanging_reward.calls += 1
    if hanging_reward.calls == 2:
        _release.wait()  # never returns on its own (the test lets it go at the end)
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


def test_a_hanging_reward_function_stops_the_run_with_its_name(toy_config):
    hanging_reward.calls = 0
    cfg = toy_config("max_steps=4", "reward_timeout=0.5",
                     "reward_funcs=[tests.training.test_faults:hanging_reward]")
    t0 = time.perf_counter()
    try:
        with pytest.raises(RewardTimeout, match=r"reward function 'hanging_reward' did not return within "
                                                r"reward_timeout=0.5 s"):
            Trainer(cfg).train()
    finally:
        _release.set()
    assert time.perf_counter() - t0 < 60
    assert [s for s, _ in list_checkpoints(cfg.output.output_dir)] == [1]  # what the run had is saved


_stuck_calls = []


def stuck_reward(prompts, completions, completion_ids, label, **kwargs):
    """Scores the first generation batch, then never returns (for the driver process)."""
    _stuck_calls.append(1)
    if len(_stuck_calls) == 2:
        print("reward stuck", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.05)
    return [float(sum(t == lab for t in ids)) for ids, lab in zip(completion_ids, label)]


def test_one_ctrl_c_stops_a_hung_reward_function_and_saves_the_last_step(tmp_path):
    # no reward_timeout: the call runs in the main thread and would never end the step the first Ctrl-C waits for;
    # the stop waits STOP_GRACE_S (5 s) for it, then stops
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(64))
    proc = _driver("none", tmp_path / "run", train, "max_steps=4", "save_steps=100", "steps_per_generation=1",
                   "num_iterations=1", "reward_funcs=[tests.training.test_faults:stuck_reward]")
    try:
        lines = []
        while not lines or lines[-1].strip() != "reward stuck":
            line = proc.stderr.readline().decode()
            assert line, f"the driver ended before the reward hung: {''.join(lines)[-2000:]}"
            lines.append(line)
        proc.send_signal(signal.SIGINT)  # once
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode != 0 and "SIGINT: saving a checkpoint after this step, which is waiting on the reward " \
        "functions; if they have not returned within 5 s" in err, err[-2000:]
    assert ("the reward functions did not return within 5 s of SIGINT: stopping now; this step is abandoned and the "
            "last completed one is saved") in err
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1]  # step 1, done before the hang, is kept
    ckpt.verify(tmp_path / "run" / "checkpoint-1")


def test_call_with_timeout_passes_results_and_errors_through():
    assert call_with_timeout(lambda x: x + 1, 5.0, "f", 1) == 2
    assert call_with_timeout(lambda: threading.current_thread().name, None, "f") == threading.current_thread().name
    with pytest.raises(KeyError, match="inner"):
        call_with_timeout(lambda: {}["inner"], 5.0, "f")


# ----- a torn last line in the logs -------------------------------------------------------------------
def test_a_torn_last_log_line_is_dropped_with_a_warning(tmp_path, logged):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n{"step": 3, "rew')
    with logged(r"metrics.jsonl: dropping line 3, which is not complete JSON"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3][:2]
    with logged("dropping line 3"):
        _truncate_after(path, 2)
    assert path.read_text() == '{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n'


def test_resume_after_a_kill_mid_log_line(toy_config, logged):
    cfg = toy_config("max_steps=2", "save_steps=1")
    Trainer(cfg).train()
    out = Path(cfg.output.output_dir)
    for name in ("metrics.jsonl", "completions.jsonl"):
        with open(out / name, "a") as f:
            f.write('{"step": 3, "prompt": [7, 8')  # killed while writing step 3's line
    with logged("not complete JSON"):
        Trainer(toy_config("max_steps=3", "resume_from=latest")).train()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert all(json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines())
