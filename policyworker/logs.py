"""Third-party noise kept out of a user's run: the notices megatron-core, torch and transformers
print on every start (missing Transformer Engine/Apex/absl, deprecations of what we do not use,
experimental modules, progress bars of tiny loads) are filtered where megatron-core is first
loaded: the command line, every worker process of the driver, and a `MegatronPolicyWorker` built in
a user's own script (torchrun). Only these messages are filtered; `POLICYWORKER_VERBOSE=1`
(inherited by the workers), or the command line's `--verbose`, shows them again.
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "POLICYWORKER_VERBOSE"

_WARNINGS = (  # regular expressions of warnings' messages, each printed once per process
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"full scope is deprecated",
    r".* is experimental",
    r"MCore's async save is deprecated",
)
_LOG_LINES = {  # logger -> the start of each message of it to drop
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}


_quiet = False


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_third_party(verbose: bool | None = None) -> None:
    """Filter the known notices (unless `verbose`, default: the `POLICYWORKER_VERBOSE` env)."""
    if verbose is None:
        verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    global _quiet
    if verbose or _quiet:
        return
    _quiet = True  # once per process: the filters would stack
    for pattern in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, starts in _LOG_LINES.items():
        logging.getLogger(name).addFilter(_Drop(starts))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
