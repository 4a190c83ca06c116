"""NVFP4 checkpoint dialects: one module per dialect (the protocol is fp4kit/formats/base.py, the list of them
fp4kit/registry.py), and ``detect``, which opens a checkpoint of any of them."""
