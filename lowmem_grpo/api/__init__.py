"""The Python API, in TRL's shape, for notebooks and scripts:

    from lowmem_grpo import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_func, "numeric_answer"],
                          args=GRPOConfig(output_dir="runs/x", learning_rate=1e-6, max_steps=100),
                          train_dataset=rows)
    trainer.train()

    config.py          GRPOConfig: the recipe's settings as dataclass fields, checked by the CLI's code
    config_fields.py   its fields, generated from config/schema.py (fields_source.py; `make api-fields`)
    trainer.py         GRPOTrainer: TRL's surface over the command line's Trainer (`trainer.loop`)

The CLI and the API train identically (tests/test_api.py checks it weight for weight).
"""

from ..training.callbacks import TrainerCallback
from .config import GRPOConfig
from .trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerCallback"]
