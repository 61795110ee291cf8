"""lowmem-grpo: LoRA-free, low-memory GRPO for small LLMs on 8 GB GPUs.

The package, bottom to top (each layer imports only the ones above it in this list):

    lowmem_grpo.kernels   fused loss-head ops (the top-level `kernels/` folder of the source tree)
    config, phases        the settings tree; the step's phase markers for the profiler
    policy/               loading the model, generation, the no-grad log-prob passes
    rewards/              reward functions: TRL's signature, built-ins, loading, calling
    memory_modes/         bf16 + stochastic rounding, optimizer in backward, reference off the GPU,
                          activation offload, optimizer construction
    training/             the GRPO loop: Trainer, generation batches, data, checkpoints, metrics, eval
    memory/               memory tools: track(), the profiler, the planner and its layer probe, presets
    cli/                  `lowmem-grpo train|eval|plan|profile`
"""

__version__ = "0.1.0"
