"""Checkpoints: Hugging Face export (distributed checkpoints are a later issue)."""
