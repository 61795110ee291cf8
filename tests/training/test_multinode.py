"""torchrun across nodes, on one machine: two launchers (--nnodes 2 --node-rank 0|1, c10d rendezvous on
127.0.0.1, gloo), so that what depends on LOCAL_RANK rather than RANK runs as on two hosts.

    node-shared reference   one /dev/shm copy per node (its local rank 0 writes it, keyed by torchrun's
                            GROUP_RANK); the two "nodes" of one machine each map their own file
    writes                  global rank 0 alone writes (the worker's params.pt; the CLI's metrics and
                            checkpoints)
    planner                 host RAM is a node's ranks', device memory shards over every rank
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowmem_grpo.config import load_config
from lowmem_grpo.memory.parallel_plan import per_rank
from lowmem_grpo.memory.plan import Arch, plan
from lowmem_grpo.memory.presets import preset
from lowmem_grpo.training import checkpoint as ckpt
from tests.training.test_distributed import ROOT, TOY, WORKER, assert_finished, metrics, one_step_experiment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args: list[str], nproc_per_node: int, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Two torchrun launchers, nodes 0 and 1 of one job, each with `nproc_per_node` ranks; both must end."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                                   f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint={endpoint}", "--rdzv-id=lowmem-grpo-test", *args],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in (0, 1)]
    done = []
    for p in launchers:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in launchers:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_each_node_maps_its_own_reference_copy_and_the_job_steps_as_one_process(tmp_path):
    """2 nodes x 1 rank on one machine: both ranks are local rank 0, so each node writes and maps its own
    /dev/shm copy (not the other node's), only global rank 0 writes params.pt, and 2 ranks x 4
    completions take the same 3 steps as 1 process x 8. (Two ranks of one node sharing one copy:
    test_distributed.py. A rank's share must be whole groups of 4, so 4 ranks do not fit this batch.)"""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs Linux's /proc/self/maps to see the mapping")
    overrides = ["beta=0.1", "reference_compute=cpu"]
    one = one_step_experiment(tmp_path, 1, "dapo", "ddp", *overrides)
    out = tmp_path / "two-nodes"
    for done in two_nodes([str(WORKER), str(out), "dapo", "ddp", *overrides], nproc_per_node=1):
        assert_finished(done)
    files = [(out / f"reference-file-rank{r}").read_text() for r in (0, 1)]
    assert all(f and " " not in f for f in files), files  # each rank maps exactly one copy
    assert files[0] != files[1], files  # one per node
    two = torch.load(out / "params.pt")
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, rtol=1e-5, atol=5e-5, msg=k)
    torch.testing.assert_close(torch.tensor(two["grad_norms"]), torch.tensor(one["grad_norms"]), rtol=1e-5, atol=0)


def test_a_two_node_run_writes_once_from_global_rank_0(tmp_path):
    """2 nodes x 1 rank through the CLI: both ranks are local rank 0, yet one metrics row per step and one
    checkpoint, written by global rank 0 alone."""
    run_dir = tmp_path / "run"
    for done in two_nodes(["-m", "lowmem_grpo", "train", *TOY, f"output_dir={run_dir}", "max_steps=2",
                           "save_steps=2", "eval_on_start=false", "eval_on_end=false"], nproc_per_node=1):
        assert_finished(done)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert ckpt.load_state(run_dir / "checkpoint-2")["world_size"] == 2


def test_the_planner_counts_host_ram_per_node_and_shards_over_every_rank():
    cfg = load_config(None, ["optimizer=adamw", "beta=0.04", "reference_compute=stream"], check=False)
    arch = Arch.from_config(preset("Qwen2.5-0.5B"))
    one = plan(cfg, arch)
    one_node = per_rank(one, cfg, arch, 4, "fsdp")
    two_nodes_ = per_rank(plan(cfg, arch), cfg, arch, 4, "fsdp", nnodes=2)
    assert two_nodes_.phase_categories == one_node.phase_categories  # a rank's device memory: 1/4 either way
    assert one_node.host_bytes == 4 * one.host_bytes  # streamed: each rank pins its own reference
    assert two_nodes_.host_bytes == 2 * one.host_bytes  # ... and a node holds 2 of the 4 ranks
    with pytest.raises(ValueError, match="multiple of the node count"):
        per_rank(plan(cfg, arch), cfg, arch, 3, "fsdp", nnodes=2)
