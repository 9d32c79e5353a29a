"""Where the training state lives: device or host, moved whole, with memory telemetry."""
