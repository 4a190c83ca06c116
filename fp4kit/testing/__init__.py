"""Tiny fixtures and synthetic checkpoints for tests and benchmarks (built from configs, never weights)."""
