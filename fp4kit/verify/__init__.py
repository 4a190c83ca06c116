"""Verification: reference MoE, fp4kit's own kernels, checks that a checkpoint + layout computes the source model."""
