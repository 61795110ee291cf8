"""Memory modes: what makes full-parameter GRPO fit an 8 GB card, each switched on by the config.

    sr_adamw.py               bf16 weights whose 8-bit AdamW updates land (stochastic rounding)
    optimizer_in_backward.py  each parameter stepped in its grad hook, its gradient freed at once
    offload.py                the same, with the optimizer states and the update in host RAM
    host_arena.py             pinned host buffers as views of one block of exactly the planned size
    reference.py              the reference model in CPU RAM, run on the CPU or streamed to the GPU
    activation_offload.py     checkpointed layer inputs to pinned host memory on a side stream
    optimizers.py             building the configured optimizer (and LR schedule) from these

May import the settings (lowmem_grpo.config), the phase markers (lowmem_grpo.phases), the kernels and
the policy; never the training loop, the memory tools or the CLI.
"""
