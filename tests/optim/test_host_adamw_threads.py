"""The host kernel's threads (optim/host_pool.cpp): a call never waits for a helper thread that gets no
core, the kernel works in a forked child, and the results are the same bits for any thread count and when two
Python threads call it at once (the second runs its job alone)."""

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from lowmem_grpo.optim import host_adamw

from .test_host_adamw_levels import eight_bit_state

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("bitsandbytes")  # (the states: test_host_adamw_levels.eight_bit_state)


def _run(script: str, timeout: float) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter that imports this checkout's lowmem_grpo."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling policies (SCHED_IDLE)")
def test_a_helper_that_gets_no_core_does_not_hold_up_the_call(kernel):
    # Where a core is busy with other work (the trainer's main thread, a data loader, another job), a helper
    # thread may not run for milliseconds. Here that is made certain: the process and a busy process share
    # one core, and the kernel's helper thread is SCHED_IDLE (it runs only when nothing else wants the core).
    # The caller must finish the job itself, at about the speed of a one-thread call; an OpenMP team waits at
    # its barrier for the helper's share (measured: ~300x the one-thread time).
    result = _run("""
        import json, os, subprocess, sys, time
        import torch
        from lowmem_grpo.optim import host_adamw
        torch.set_num_threads(1)  # (no torch threads of its own: every new thread below is the kernel's)
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})  # the threads the kernel starts now inherit this one core
        lib = host_adamw.library()
        n = 1 << 22
        g = torch.randn(n)
        before = set(os.listdir("/proc/self/task"))
        lib.grad_sum_squares(n, g.data_ptr(), 0, 2)
        helpers = set(os.listdir("/proc/self/task")) - before
        for tid in helpers:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        try:
            time.sleep(0.3)
            def timed(threads):
                t0 = time.perf_counter()
                lib.grad_sum_squares(n, g.data_ptr(), 0, threads)
                return time.perf_counter() - t0
            alone = min(timed(1) for _ in range(3))
            two = min(timed(2) for _ in range(3))
        finally:
            busy.kill()
            busy.wait()
        print(json.dumps({"helpers": len(helpers), "alone": alone, "two": two}))
    """, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["helpers"] == 1, out  # threads=2: the caller and one helper
    assert out["two"] < 5 * out["alone"], out


def test_the_kernel_runs_in_a_forked_child(kernel):
    # A child forked after the parent used the kernel (its helper threads do not exist in the child) steps and
    # computes the same bits; an OpenMP runtime that was in use before fork() hangs there.
    result = _run("""
        import os, signal, sys, time
        import torch
        from lowmem_grpo.optim import host_adamw
        torch.set_num_threads(2)
        g = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
        parent = host_adamw.grad_sum_squares(g)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if host_adamw.grad_sum_squares(g) == parent else 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                sys.exit(os.waitstatus_to_exitcode(status))
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)  # hung
        os.waitpid(pid, 0)
        sys.exit(4)
    """, timeout=180)
    assert result.returncode == 0, (result.returncode, "4: the child hung", result.stderr[-2000:])


def _steps(seed: int, n: int = 256 * 700 + 13) -> list[torch.Tensor]:
    """Three 8-bit and three fp32 AdamW steps on inputs from `seed`: the weights and states after them."""
    gen = torch.Generator().manual_seed(seed)
    p, st = torch.randn(n, generator=gen).to(torch.bfloat16), eight_bit_state(n)
    w, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    for step in (1, 2, 3):
        g = (0.01 * torch.randn(n, generator=gen)).to(torch.bfloat16)
        assert host_adamw.adamw8bit_step(p, g, st, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.01, step=step,
                                         generator=torch.Generator().manual_seed(seed + step))
        assert host_adamw.adamw_step(w, g, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                     step=step)
    return [p, st["state1"], st["state2"], st["absmax1"], st["absmax2"], w, m, v]


def test_same_bits_for_any_thread_count_and_two_callers_at_once(kernel, monkeypatch):
    reference = {seed: _steps(seed) for seed in (0, 1)}  # (torch's thread count)
    for threads in (1, 3, 8):  # more threads than this machine's cores, too
        monkeypatch.setattr(host_adamw, "_threads", lambda threads=threads: threads)
        for got, want in zip(_steps(0), reference[0]):
            assert torch.equal(got, want), threads
    monkeypatch.setattr(host_adamw, "_threads", lambda: 2)
    results, errors = {}, []

    def call(seed):
        try:
            for _ in range(5):  # calls overlap: one caller has the helpers, the other runs its job alone
                results[seed] = _steps(seed)
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    workers = [threading.Thread(target=call, args=(seed,)) for seed in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    for seed in (0, 1):
        for got, want in zip(results[seed], reference[seed]):
            assert torch.equal(got, want), seed
