"""Command-line tools: `refit-check` and `export` (run through `python -m policyworker`)."""
