"""fp4kit: BF16 MoE checkpoints to NVFP4 checkpoints that serving engines load and run correctly."""

__version__ = "0.1.0"
