"""The model layer's error for a checkpoint it cannot build."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""
