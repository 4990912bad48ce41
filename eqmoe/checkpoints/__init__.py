"""Checkpoint formats: Hugging Face safetensors folders."""
