"""The trainer's use of an outside rollout engine (generation.engine=vllm), with a stub in vLLM's place: the
engine reads the weights only once the offloaded optimizer's update has landed in all of them, its seed
draws do not race that update, and train() closes it when it ends (normally or by an error); a second
train() starts a new one. Runs without vLLM (tests/vllm runs the real engine)."""

import logging
import threading
import time

import pytest
import torch

from lowmem_grpo.optim.offload import OffloadedOptimizer
from lowmem_grpo.policy.rollout import generate
from lowmem_grpo.training.trainer import Trainer

RNG_RACE = "was drawn from while the offloaded optimizer's update"


class StubEngine:
    """VLLMEngine's interface: `sync` records the weights it is sent, `generate` draws its seed from torch's
    global generator (as VLLMEngine does) and samples with the native rollout."""

    def __init__(self, trainer: Trainer):
        self.policy, self.cfg = trainer.policy, trainer.cfg.generation
        self.synced_step, self.synced, self.closed = -1, [], 0

    def sync(self, policy, step):
        self.synced.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        self.synced_step = step

    def generate(self, prompts, *, eos_ids, pad_id, greedy=False, max_new_tokens=None):
        torch.randint(0, 2**31 - 1, ())
        return generate(self.policy, prompts, self.cfg, eos_ids=eos_ids, pad_id=pad_id, device=torch.device("cpu"),
                        greedy=greedy, max_new_tokens=max_new_tokens), None

    def close(self):
        self.closed += 1


@pytest.fixture
def stub_engines(monkeypatch):
    """Every engine the trainers of the test start, in order."""
    started = []
    monkeypatch.setattr(Trainer, "_vllm_engine", lambda self: started.append(StubEngine(self)) or started[-1])
    return started


def test_the_engine_reads_the_weights_once_the_offloaded_update_has_landed(toy_config, stub_engines, monkeypatch,
                                                                            caplog):
    real_update = OffloadedOptimizer._update

    def slow_update(self, *args, **kwargs):  # the update thread lags well behind the next rollout
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(OffloadedOptimizer, "_update", slow_update)
    trainer = Trainer(toy_config("max_steps=3", "offload_optimizer=true", "optimizer_in_backward=true"))
    landed = []  # the weights at each step's start: begin_step waits for the last update
    real_begin = trainer.step_mode.begin
    trainer.step_mode.begin = lambda loss_fns=(): (real_begin(loss_fns), landed.append(
        {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}))
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):
        trainer.train()
    engine = stub_engines[0]
    assert len(engine.synced) == len(landed) == 3  # one generation batch per step
    for step, (synced, want) in enumerate(zip(engine.synced, landed)):
        for name in want:
            assert torch.equal(synced[name], want[name]), (step, name)
    assert all(any(not torch.equal(landed[s][k], landed[s - 1][k]) for k in want) for s in (1, 2))  # steps moved
    assert RNG_RACE not in caplog.text


def test_train_closes_the_engine_and_a_second_train_starts_another(toy_config, stub_engines):
    trainer = Trainer(toy_config("max_steps=1"))
    trainer.train()
    assert [e.closed for e in stub_engines] == [1] and trainer.rollout.engine is None
    trainer.cfg.train.max_steps = 2
    trainer.train()
    assert [e.closed for e in stub_engines] == [1, 1] and trainer.step == 2
    assert len(stub_engines[1].synced) == 1  # the new engine got step 1's weights


def test_a_failing_train_closes_the_engine(toy_config, stub_engines, monkeypatch):
    trainer = Trainer(toy_config("max_steps=2"))

    def fails():
        raise RuntimeError("a reward function failed")

    monkeypatch.setattr(trainer, "optimizer_step", fails)
    with pytest.raises(RuntimeError, match="a reward function failed"):
        trainer.train()
    assert [e.closed for e in stub_engines] == [1] and trainer.rollout.engine is None
