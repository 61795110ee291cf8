"""The optimizer and its memory modes: what makes full-parameter GRPO fit an 8 GB card, each switched on
by the config.

    sr_adamw.py               bf16 weights whose 8-bit AdamW updates land (stochastic rounding)
    optimizer_in_backward.py  each parameter stepped in its grad hook, its gradient freed at once
    offload.py                the same, with the optimizer states and the update in host RAM
    host_ram.py               the offloaded optimizer's host RAM arithmetic and start-up check
    update_thread.py          the offloaded optimizer's update on a worker thread
    host_adamw.py             fused CPU AdamW kernels for the host step (host_adamw.cpp, host_adamw_fp32.cpp,
                              host_grad_norm.cpp, host_pool.cpp)
    optimizers.py             building the configured optimizer (and LR schedule) from these

May import the settings (lowmem_grpo.config, lowmem_grpo.ranges), the phase markers (lowmem_grpo.phases)
and the pinned host arena (lowmem_grpo.host_arena). Design notes: docs/memory-modes.md
"""
