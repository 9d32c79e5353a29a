"""A generation engine (transformers) and the process that hosts it, refitted by the worker."""
