"""One optimizer-step experiment, run by test_distributed.py as one process or under torchrun.

    python tests/training/distributed_worker.py OUT LOSS_TYPE STRATEGY [key=value ...]
    torchrun --standalone --nproc-per-node 2 tests/training/distributed_worker.py OUT LOSS_TYPE STRATEGY ...

Every process builds the same fixed generation batch of 8 completions (2 prompts x 4), keeps its
rank's rows, and takes 3 optimizer steps on them; rank 0 writes the parameters to OUT/params.pt.
With N processes, per_device_train_batch_size is 8 / N, so the global batch is the same.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lowmem_grpo.config import load_config  # noqa: E402
from lowmem_grpo.policy.batch import Batch  # noqa: E402
from lowmem_grpo.training import distributed  # noqa: E402
from lowmem_grpo.training.generation import GenerationBatch  # noqa: E402
from lowmem_grpo.training.trainer import Trainer  # noqa: E402
from tests.training.conftest import TINY_LLAMA, toy_rows, write_jsonl  # noqa: E402

N_ROWS, P, C, V = 8, 5, 6, 32


def fixed_batch() -> Batch:
    """2 prompts x 4 completions, left-padded prompts and completions of different lengths."""
    g = torch.Generator().manual_seed(123)
    prompt_ids = torch.randint(6, V, (2, P), generator=g).repeat_interleave(4, 0)  # (8, P)
    prompt_mask = torch.ones(N_ROWS, P, dtype=torch.bool)
    prompt_mask[4:, :2] = False  # the second prompt is shorter
    completion_ids = torch.randint(6, V, (N_ROWS, C), generator=g)
    lengths = torch.tensor([6, 3, 5, 2, 6, 4, 1, 5])
    completion_mask = torch.arange(C)[None, :] < lengths[:, None]
    advantages = torch.randn(N_ROWS, generator=g)
    advantages[2] = 0.0  # a skipped row (skip_zero_advantage), on rank 0 of 2
    return Batch(prompt_ids.masked_fill(~prompt_mask, 0), prompt_mask, completion_ids, completion_mask,
                 lengths == C, advantages)


def main(out: str, loss_type: str, strategy: str, *overrides: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(work / f"train{rank}.jsonl", toy_rows(16))
    items = {"model.config": json.dumps(TINY_LLAMA), "model.tokenizer": "none", "data.train_file": train,
             "num_generations": 4, "max_prompt_length": 8, "max_completion_length": C,
             "per_device_train_batch_size": N_ROWS // world, "max_steps": 3, "learning_rate": 1e-2,
             "optimizer": "adamw", "max_grad_norm": 0.5, "loss_type": loss_type, "strategy": strategy,
             "reward_funcs": "[tests.training.conftest:label_reward]", "output_dir": str(work / "run"),
             "progress_bar": "false", "save_steps": 0, "device": "cpu", "ddp_timeout": 120}
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()] + list(overrides))
    trainer = Trainer(cfg)
    n = N_ROWS // world
    mine = fixed_batch().rows(rank * n, (rank + 1) * n)
    if trainer.ref is not None:  # beta > 0: the reference (shared by the ranks of the node) gives ref_logp
        mine.ref_logp = trainer.ref.logprobs(mine, temperature=1.0, micro_batch=n)
        maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
        (work / f"reference-shared-rank{rank}").write_text(str("lowmem-grpo-reference-" in maps))
        mapped = {word for word in maps.split() if "lowmem-grpo-reference-" in word}
        (work / f"reference-file-rank{rank}").write_text(" ".join(sorted(mapped)))  # which node's copy
    norms = []
    for _ in range(3):
        trainer.generation = GenerationBatch(mine, 0, {}, 0.0)
        norms.append(trainer.optimizer_step()["grad_norm"])
    state = trainer.full_state_dict()
    if rank == 0:
        torch.save({"params": state, "grad_norms": norms}, work / "params.pt")
    distributed.stop()  # as the CLI does at the end of a run
    if world > 1:
        distributed.end_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
