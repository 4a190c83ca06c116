"""Quantization: the plan, calibration, the methods (rtn, mse, gptq) and the quantize command's library API.

``from fp4kit.quantize import QuantizeOptions, quantize_checkpoint`` is the entry point."""

__all__ = ["QuantizeOptions", "QuantizeReport", "quantize_checkpoint"]


def __getattr__(name: str) -> object:
    # resolved on first use: importing a submodule of this package must not import the whole command
    if name in __all__:
        from fp4kit.quantize import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
