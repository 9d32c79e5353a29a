"""Version-pinned patches that let megatron-core run where it was not written to: `cpu` (megatron-core
0.19 assumes CUDA in a handful of places; nothing of it runs on a machine with a GPU) and
`checkpoint` (its dist-checkpointing writer's results queue, while a save is planned)."""

from policyworker.compat.checkpoint import in_process_write_results
from policyworker.compat.cpu import apply_cpu_patches

__all__ = ["apply_cpu_patches", "in_process_write_results"]
