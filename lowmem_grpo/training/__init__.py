"""The GRPO training loop and what it keeps between steps.

    trainer.py     Trainer: set-up, one optimizer step, and train() (the loop, top to bottom)
    setup.py       the Trainer's set-up, one function per concern (model, data, rewards, reference, ...)
    loss.py        the loss of one micro-batch as an nn.Module (what DDP and FSDP2 wrap)
    micro_batch.py a micro-batch's arithmetic: rows trained, loss scale and denominator, token counts
    generation.py  a generation batch: rollout -> rewards -> advantages -> old/reference log-probs
    step_modes.py  how a step's backwards become an update, per memory mode
    distributed.py torchrun: the ranks, the collectives the loop uses, DDP/FSDP2 wrapping
    context.py     RolloutContext: what rollouts and evaluations need, built once by the Trainer
    data.py, checkpoint.py, stopping.py, evaluate.py, metrics.py, trackers.py, plot.py, callbacks.py

May import the settings, the phase markers, the kernels, the policy, the rewards and the memory
modes; never the memory tools or the CLI. Design notes: docs/training.md
"""
