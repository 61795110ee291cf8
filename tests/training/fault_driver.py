"""A training run in its own process, for tests/training/test_faults.py to SIGKILL.

    python -m tests.training.fault_driver KILL_AT OUTPUT_DIR TRAIN_FILE [key=value ...]

KILL_AT is `none` (run until killed from outside, or to the end) or `<point>:<n>`: the process sends
itself SIGKILL the n-th time it reaches that point of a checkpoint save, to hit the moments a random
kill rarely does:
    state     while trainer_state.pt is being written (half of it on disk)
    manifest  every file written and fsynced, the manifest not yet
    rename    the folder complete, not yet renamed to checkpoint-<step>
    prune     the new checkpoint renamed, an older one half deleted
"""

import json
import os
import shutil
import signal
import sys

from lowmem_grpo.config import load_config
from lowmem_grpo.training import checkpoint as ckpt
from lowmem_grpo.training.trainer import Trainer
from tests.training.conftest import TINY_LLAMA


def toy_overrides(output_dir, train_file, *extra) -> list[str]:
    """The toy token task on a tiny random Llama, saving every step."""
    return [f"model.config={json.dumps(TINY_LLAMA)}", "model.tokenizer=none", f"data.train_file={train_file}",
            "num_generations=4", "max_prompt_length=8", "max_completion_length=6", "per_device_train_batch_size=4",
            "steps_per_generation=2", "num_iterations=2", "learning_rate=1e-3", "optimizer=adamw",
            "reward_funcs=[tests.training.conftest:label_reward]", f"output_dir={output_dir}", "progress_bar=false",
            "device=cpu", "save_steps=1", "save_total_limit=1", *extra]


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(point: str, n: int) -> None:
    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    if point == "state":
        real_save = ckpt.torch.save

        def save(obj, f, *a, **kw):
            real_save(obj, f, *a, **kw)
            if due():
                f.flush()
                f.truncate(f.tell() // 2)
                os.fsync(f.fileno())
                _die()
        ckpt.torch.save = save
    elif point == "manifest":
        real_manifest = ckpt._write_manifest

        def manifest(folder):
            if due():
                _die()
            real_manifest(folder)
        ckpt._write_manifest = manifest
    elif point == "rename":
        real_replace = ckpt.os.replace

        def replace(src, dst):
            if os.path.basename(str(dst)).startswith("checkpoint-") and due():
                _die()
            real_replace(src, dst)
        ckpt.os.replace = replace
    elif point == "prune":
        real_rmtree = ckpt.shutil.rmtree

        def rmtree(path, *a, **kw):
            if "pruned" in os.path.basename(str(path)) and due():
                files = sorted(p for p in os.listdir(path))
                os.remove(os.path.join(path, files[0]))  # half-way through deleting it
                _die()
            real_rmtree(path, *a, **kw)
        ckpt.shutil.rmtree = rmtree
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def main(argv: list[str]) -> None:
    kill_at, output_dir, train_file, *extra = argv
    if kill_at != "none":
        point, n = kill_at.split(":")
        _kill_at(point, int(n))
    # killed before its first checkpoint: the logs of the steps before it are the killed run's, start over
    resume = ["resume_from=latest"] if ckpt.list_checkpoints(output_dir) else ["overwrite_output_dir=true"]
    Trainer(load_config(None, toy_overrides(output_dir, train_file, *extra, *resume))).train()


if __name__ == "__main__":
    main(sys.argv[1:])
