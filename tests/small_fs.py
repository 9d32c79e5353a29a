"""Saves and refits on file systems that are too small, for `test_faults.py`. Run in a
private mount namespace where DIR and /dev/shm are small tmpfs mounts:

    unshare -m sh -c 'mount -t tmpfs -o size=256k tmpfs DIR && \
        mount -t tmpfs -o size=64k tmpfs /dev/shm && python tests/small_fs.py MODEL DIR ROOMY'

Prints one JSON line: each case's error (type and message) and what DIR and /dev/shm hold after.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_worker

from policyworker.generation.process import GenerationProcess


def attempt(fn) -> dict[str, str]:
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": "", "message": ""}


def main() -> None:
    model, small, roomy = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    worker = make_worker(model)
    out: dict[str, object] = {}
    # into folders the save makes: a failed save removes them again
    out["sync"] = attempt(lambda: worker.save_checkpoint(small / "a" / "w1", small / "a" / "o1"))
    out["after_sync"] = os.listdir(small)
    out["hf"] = attempt(lambda: worker.save_hf_pretrained(small / "b" / "hf"))
    out["after_hf"] = os.listdir(small)

    def async_save() -> None:
        worker.save_checkpoint(small / "w2", small / "o2", async_save=True)
        worker.finalize_async_save()

    out["async"] = attempt(async_save)
    out["after_async"] = os.listdir(small)
    out["roomy"] = attempt(lambda: worker.save_checkpoint(roomy / "w", roomy / "o"))
    info = worker.prepare_refit_info()

    for path, shared in (("direct", True), ("buffers", False)):
        with GenerationProcess(str(model), info, shared_staging=shared, timeout_s=3.0) as gen:
            gen.begin_refit_ipc(worker.get_zmq_address())
            out[f"trainer_{path}"] = attempt(worker.stream_weights_via_ipc_zmq)
            out[f"engine_{path}"] = attempt(gen.end_refit)
    out["after_refit"] = [f for f in os.listdir("/dev/shm") if f.startswith("policyworker")]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
