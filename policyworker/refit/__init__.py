"""Refit: the weights of the policy to a generation engine (layout, transports, receivers)."""
