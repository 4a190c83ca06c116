"""NVFP4 checkpoint dialects: each module maps the canonical form to its tensor names and config, and back."""
