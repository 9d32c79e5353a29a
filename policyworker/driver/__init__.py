"""The driver: a `Policy` over one worker process per rank (local processes or Ray actors)."""
