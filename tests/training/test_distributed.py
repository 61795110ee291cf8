"""Data-parallel training under torchrun on the CPU (gloo, 2 processes): the same step as one process.

Each test launches real processes with torchrun (torch.distributed.run), as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")


def run(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(launch + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


ABORT_SIGNS = ("terminate called", "SIGABRT", "Signal 6", "exitcode")  # a rank's abort, as torchrun relays it


def assert_finished(done: subprocess.CompletedProcess) -> None:
    """A finished job: exit status 0 and no rank that aborted on its way out. torchrun relays each
    rank's stderr; the lines that tell of an abort come first in the message (a long traceback or
    torchrun's summary would push them out of a plain tail)."""
    signs = [line for line in done.stderr.splitlines() if any(k in line for k in ABORT_SIGNS)]
    assert done.returncode == 0 and not signs, "\n".join(signs) + "\n----- stderr (end) -----\n" + done.stderr[-4000:]


def one_step_experiment(tmp_path, nproc: int, loss_type: str, strategy: str, *overrides: str) -> dict:
    out = tmp_path / "-".join([strategy, loss_type, str(nproc), *overrides])
    done = run([str(WORKER), str(out), loss_type, strategy, *overrides], nproc=nproc)
    assert_finished(done)
    return torch.load(out / "params.pt")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_ranks_take_the_same_steps_as_one(tmp_path, strategy, loss_type):
    """3 optimizer steps on a fixed batch: 2 ranks x 4 completions == 1 rank x 8 (clipping active).

    Adam divides each update by the gradient's running RMS, so parameters alone would not see a wrong
    gradient scale (say dapo's denominator counted on one rank): the global gradient norms before
    clipping are compared too. atol 5e-5 against updates of ~3e-2: Adam turns reduction-order
    rounding of near-zero gradients into update differences of that size."""
    one = one_step_experiment(tmp_path, 1, loss_type, strategy)
    two = one_step_experiment(tmp_path, 2, loss_type, strategy)
    start = one_step_experiment(tmp_path, 1, loss_type, strategy, "learning_rate=0")["params"]
    assert one["params"].keys() == two["params"].keys()
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=1e-5, atol=5e-5, msg=k)
        assert not torch.equal(v, start[k]), f"{k} did not move: the test would not see a wrong update"
    assert one["grad_norms"][0] > 0.5  # max_grad_norm=0.5: the global norm's clip is active
    torch.testing.assert_close(torch.tensor(two["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-5, atol=0)


def test_the_ranks_of_a_node_share_one_reference_copy_and_step_as_one_rank(tmp_path):
    """beta > 0: the reference weights are one /dev/shm file mapped by both ranks; KL included, 2 x 4 == 1 x 8."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs Linux's /proc/self/maps to see the mapping")
    one = one_step_experiment(tmp_path, 1, "dapo", "ddp", "beta=0.1", "reference_compute=cpu")
    two = one_step_experiment(tmp_path, 2, "dapo", "ddp", "beta=0.1", "reference_compute=cpu")
    out = tmp_path / "-".join(["ddp", "dapo", "2", "beta=0.1", "reference_compute=cpu"])
    assert [(out / f"reference-shared-rank{r}").read_text() for r in (0, 1)] == ["True", "True"]
    assert (tmp_path / "-".join(["ddp", "dapo", "1", "beta=0.1", "reference_compute=cpu"])
            / "reference-shared-rank0").read_text() == "False"  # one process: its own copy, as before
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=1e-5, atol=5e-5, msg=k)
    torch.testing.assert_close(torch.tensor(two["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-5, atol=0)


TOY = ["recipes/toy_tokens.yaml", "per_device_train_batch_size=32", "progress_bar=false"]  # 2 ranks x 32 x 2


def train(tmp_path, name: str, *overrides: str, nproc: int = 2, timeout: int = 300):
    return run(["-m", "lowmem_grpo", "train", *TOY, f"output_dir={tmp_path / name}", *overrides], nproc=nproc,
               timeout=timeout)


def metrics(run_dir) -> list[dict]:
    import json
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_torchrun_run_learns_writes_once_and_resumes_exactly(tmp_path):
    """torchrun -m lowmem_grpo train: the reward rises, rank 0 alone writes metrics.jsonl, the checkpoint
    loads with from_pretrained, and a run resumed from step 40 ends with the same weights and metrics.
    (80 steps: the toy task's reward is still ~0.02 after 40, where whether it has risen by 0.03 depends on
    the sampled stream; by 80 it is ~0.2, measured from 0.004.)"""
    from transformers import AutoModelForCausalLM

    done = train(tmp_path, "a", "max_steps=80", "save_steps=40", "eval_on_start=false", "eval_on_end=false")
    assert_finished(done)
    rows = metrics(tmp_path / "a")
    assert [r["step"] for r in rows] == list(range(1, 81))  # one writer: each step once
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.03, rewards
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-80")
    assert model.config.vocab_size == 32

    # Resume from step 40 in a fresh folder: the same 40 steps follow, on both ranks' own batches and RNGs.
    import shutil
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-40", tmp_path / "b" / "checkpoint-40")
    done = train(tmp_path, "b", "max_steps=80", "save_steps=40", "eval_on_start=false", "eval_on_end=false",
                 "resume_from=latest")
    assert_finished(done)
    resumed = metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == list(range(41, 81))
    for r, ref in zip(resumed, rows[40:]):
        for k in ("reward", "loss", "grad_norm", "kl", "num_tokens"):
            assert r[k] == ref[k], (r["step"], k)
    from safetensors.torch import load_file
    a = load_file(tmp_path / "a" / "checkpoint-80" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint-80" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # Another number of ranks cannot continue this checkpoint exactly: a clear error.
    done = train(tmp_path, "b", "max_steps=100", "resume_from=latest", "per_device_train_batch_size=64", nproc=1)
    assert done.returncode == 2 and "written by 2 process(es)" in done.stderr, done.stderr[-2000:]


EXIT_PROBE = '''
import atexit, os, sys
_dir, _rank = os.environ["EXIT_PROBE_DIR"], os.environ["RANK"]
atexit.register(lambda: open(os.path.join(_dir, f"atexit-rank{_rank}"), "w").close())


class _Finalized:
    """Deleted only when the interpreter finalizes (sys's attributes are cleared last)."""
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):
        open(self.path, "w").close()


sys.lowmem_exit_probe = _Finalized(os.path.join(_dir, f"finalized-rank{_rank}"))


def zero(completions, **kwargs):
    return [0.0 for _ in completions]
'''


def test_a_finished_rank_runs_its_exit_handlers_but_does_not_finalize_the_interpreter(tmp_path, monkeypatch):
    """gloo's worker threads outlive destroy_process_group (DDP and FSDP2 hold the group), and one that
    lets go of a collective's tensors while the interpreter finalizes aborts the rank ("terminate called
    without an active exception", exit -6) after a finished run. A finished rank therefore ends after its
    exit handlers without the interpreter's finalization (distributed.end_rank): the atexit marker of
    a reward module is written on both ranks, the marker of an object deleted only at finalization
    is not."""
    (tmp_path / "probe.py").write_text(EXIT_PROBE)
    monkeypatch.setenv("EXIT_PROBE_DIR", str(tmp_path))
    done = train(tmp_path, "run", "max_steps=2", "save_steps=0", f"reward_funcs=[{tmp_path / 'probe.py'}:zero]",
                 "reward_weights=[1.0]", "eval_on_start=false", "eval_on_end=false")
    assert_finished(done)
    assert [(tmp_path / f"atexit-rank{r}").is_file() for r in (0, 1)] == [True, True]
    assert [(tmp_path / f"finalized-rank{r}").is_file() for r in (0, 1)] == [False, False]
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]


FAILING_REWARD = '''
import os
def flaky(prompts, completions, completion_ids, trainer_state=None, **kwargs):
    if os.environ["RANK"] == "1" and trainer_state.global_step >= 3:
        raise ValueError("reward service unreachable on rank 1")
    return [0.0 for _ in completions]
'''


def test_a_rank_that_raises_stops_the_job_with_its_error_and_a_checkpoint(tmp_path):
    import time
    (tmp_path / "failing_reward.py").write_text(FAILING_REWARD)
    t0 = time.perf_counter()
    done = train(tmp_path, "run", "max_steps=50", f"reward_funcs=[{tmp_path / 'failing_reward.py'}:flaky]",
                 "reward_weights=[1.0]",
                 "eval_on_start=false", "eval_on_end=false", "ddp_timeout=60", timeout=180)
    elapsed = time.perf_counter() - t0
    assert done.returncode != 0
    assert elapsed < 90, f"the surviving rank waited {elapsed:.0f} s"  # not the 60 s collective timeout + more
    assert "reward service unreachable on rank 1" in done.stderr
    saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved == ["checkpoint-4"], saved  # generation batches start at steps 0, 2, 4: 4 steps done, saved alone
    # That checkpoint continues (every rank starts a new generation batch: the failing rank could not
    # collect the others' unfinished ones).
    done = train(tmp_path, "run", "max_steps=6", "eval_on_start=false", "eval_on_end=false", "resume_from=latest")
    assert_finished(done)
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, 7))


def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step_and_saves_once(tmp_path):
    import signal
    import time
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "lowmem_grpo", "train", *TOY, f"output_dir={out}", "max_steps=1000",
                             "eval_on_start=false", "eval_on_end=false"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file()
                                          and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun's agent passes SIGTERM on to every rank
    output = proc.communicate(timeout=60)[0]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    steps = [r["step"] for r in metrics(out)]
    assert len(saved) == 1 and saved[0] == steps[-1], (saved, steps, output[-3000:])
    assert steps == list(range(1, steps[-1] + 1))


def test_eval_and_profile_under_torchrun_are_refused_once(tmp_path):
    done = run(["-m", "lowmem_grpo", "eval", "recipes/toy_tokens.yaml", f"output_dir={tmp_path}"], nproc=2)
    assert done.returncode != 0
    assert done.stderr.count("runs in one process") == 1, done.stderr[-2000:]  # rank 0 says it, once
