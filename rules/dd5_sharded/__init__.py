"""DD5xx: sharded training (FSDP, FSDP2, tensor parallelism on DTensor, distributed checkpoints)."""
