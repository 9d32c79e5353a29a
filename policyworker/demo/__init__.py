"""The main job: SFT warm-up then GRPO on a verifiable task."""
