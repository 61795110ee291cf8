"""lowmem-grpo: LoRA-free, low-memory GRPO for small LLMs on 8 GB GPUs.

The package, lowest layer first (a layer imports only layers listed before it; tests/test_layout.py):
    ranges, phases, host_arena   setting ranges; the profiler's phase markers; pinned host memory
    kernels/       the fused loss head (imports nothing else of the package but ranges)
    config/        the settings tree: schema, YAML recipes, `section.key=value` overrides, checks
    optim/         the optimizer: bf16 + stochastic rounding, in backward, offloaded to the host
    policy/        the model: loading, generation (rollouts), log-prob passes, the reference model
    rewards/       reward functions: TRL's signature, built-ins, loading, calling
    training/      the GRPO loop: Trainer, one step's arithmetic, data, checkpoints, metrics, eval
    memory/        memory tools: track(), the profiler, the planner and its layer probe, presets
    api/, cli/     the Python API in TRL's shape (GRPOConfig, GRPOTrainer); `lowmem-grpo ...`

`from lowmem_grpo import GRPOConfig, GRPOTrainer` loads the API (and torch) on first use only, so
`import lowmem_grpo` and `lowmem_grpo.kernels` stay light. The design: docs/index.md.
"""

import logging

__version__ = "0.1.0"


def _default_log_handler() -> None:
    """Library messages (resumed from, saved, held-out scores, ...) go through `logging`, under the
    `lowmem_grpo` logger. As transformers does for its own, that logger prints INFO and above to
    stderr by default, prefixed [lowmem-grpo], and does not propagate (no duplicates where the root
    logger has a handler). `logging.getLogger("lowmem_grpo").setLevel(logging.WARNING)` quiets it; to
    route it elsewhere, replace its handlers and set `propagate` back to True."""
    logger = logging.getLogger(__name__)
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[lowmem-grpo] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_default_log_handler()


_API = ("GRPOConfig", "GRPOTrainer", "TrainerCallback")


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
