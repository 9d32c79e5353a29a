"""The megatron-core version every patch in `compat/` was written against, checked once per patch."""

from __future__ import annotations

SUPPORTED_MCORE_PREFIX = "0.19."


def require_mcore(patch: str, recheck: str) -> None:
    """`RuntimeError` unless megatron-core is the version `patch` targets; `recheck`: what to
    read again in another version before moving the prefix."""
    import megatron.core

    version = megatron.core.__version__
    if not version.startswith(SUPPORTED_MCORE_PREFIX):
        raise RuntimeError(
            f"policyworker.compat.{patch} targets megatron-core {SUPPORTED_MCORE_PREFIX}x, found "
            f"{version}: re-check {recheck} against that version"
        )
