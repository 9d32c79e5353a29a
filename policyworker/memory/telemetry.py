"""Memory figures at phase boundaries: one DEBUG line per phase, and the same numbers on demand.

The line resets the allocator's peak counter, so each line's peak is the high-water mark since
the previous line. Resetting is visible to anyone else reading the counter, so nothing is sampled
or reset while DEBUG is off: the telemetry then costs one `isEnabledFor` check.
"""

from __future__ import annotations

import logging
import os

import torch

from policyworker.memory.residency import Residency, Where

log = logging.getLogger(__name__)

GiB = 1024**3


def memory_stats(residency: Residency) -> dict[str, object]:
    """Allocator figures (bytes; 0 on CPU), the memory the device reports in use (on CPU: this
    process's resident memory), and where the training state is."""
    device = residency.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocator = {
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "device_used_bytes": total - free,  # includes NCCL's and other processes' memory
        }
    else:
        allocator = dict.fromkeys(("allocated_bytes", "reserved_bytes", "peak_allocated_bytes"), 0)
        allocator["device_used_bytes"] = _resident_bytes()
    placed = residency.bytes_by_place()
    return {
        **allocator,
        "state_on_device_bytes": placed[Where.DEVICE],
        "state_on_host_bytes": placed[Where.HOST],
        "host_buffer_bytes": residency.host_buffer_bytes(),
        **{f"{name}_on": str(where) for name, where in residency.where().items()},
    }


def log_memory(tag: str, residency: Residency) -> None:
    """One DEBUG line of `memory_stats` after phase `tag`; then a new peak interval starts."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    s = memory_stats(residency)
    log.debug(
        "memory after %s: allocated %.2f GiB, reserved %.2f GiB, peak %.2f GiB, device used "
        "%.2f GiB; state on device %.2f GiB, on host %.2f GiB (params %s, grads %s, optimizer %s)",
        tag,
        *(int(s[k]) / GiB for k in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes")),
        int(s["device_used_bytes"]) / GiB,
        int(s["state_on_device_bytes"]) / GiB,
        int(s["state_on_host_bytes"]) / GiB,
        s["params_on"],
        s["grads_on"],
        s["optimizer_on"],
    )
    if residency.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(residency.device)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        return 0
