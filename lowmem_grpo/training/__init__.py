"""The GRPO training loop and what it keeps between steps.

    trainer.py     Trainer: set-up, one optimizer step, and train() (the loop, top to bottom)
    loss.py        the loss of one micro-batch as an nn.Module (what DDP and FSDP2 wrap)
    distributed.py torchrun: the ranks, the collectives the loop uses, DDP/FSDP2 wrapping
    generation.py  a generation batch: rollout -> rewards -> advantages -> old/reference log-probs
    stopping.py    Ctrl-C/SIGTERM handling and save-on-error around the loop
    data.py        prompt data: loading, tokenizing and checking prompts, the resumable sampler
    checkpoint.py  save_pretrained checkpoints plus the state that makes resume exact
    metrics.py     metrics.jsonl, completions.jsonl, TensorBoard
    evaluate.py    greedy evaluation on held-out prompts (also every eval_steps during train)
    trackers.py    report_to backends: TensorBoard, W&B, trackio
    plot.py        run.png: the run's metrics as one picture

May import the settings, the phase markers, the kernels, the policy, the rewards and the memory
modes; never the memory tools or the CLI.
"""
