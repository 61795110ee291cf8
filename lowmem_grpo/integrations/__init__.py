"""Drop-ins for other trainers' users: `lowmem_grpo.integrations.trl.GRPOTrainer` (TRL's GRPOTrainer on our
fused head and rollout engine). Each module imports its trainer library, which lowmem-grpo itself does not
depend on (pip install '.[bench]' brings TRL)."""
