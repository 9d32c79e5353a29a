"""Version-pinned patches that let megatron-core run where it was not written to.

Only `cpu` lives here today: megatron-core 0.19 assumes CUDA in a handful of places. Nothing in
this package does anything on a machine with a GPU.
"""

from policyworker.compat.cpu import apply_cpu_patches, cpu_patches_active

__all__ = ["apply_cpu_patches", "cpu_patches_active"]
