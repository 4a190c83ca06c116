"""The registered checkpoint dialects and layout backends: one line each, by name.

Everything that offers a choice of dialect or backend (detection, convert, quantize, shard, inspect, layout, the
CLI's and recipes' choices) takes it from here. The tables name modules rather than import them, so the CLI can list
the choices without importing torch; ``dialect`` / ``backend`` import on first use.

A dialect module defines ``DIALECT``, an instance of fp4kit.formats.base.Dialect. A backend module implements the
layout protocol of fp4kit/layouts/__init__.py.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fp4kit.formats.base import Dialect

DIALECTS = {
    "compressed-tensors": "fp4kit.formats.compressed_tensors",
    "modelopt": "fp4kit.formats.modelopt",
}
BACKENDS = {
    "trtllm": "fp4kit.layouts.trtllm",
    "cutlass": "fp4kit.layouts.cutlass",
    "marlin": "fp4kit.layouts.marlin",
}
DEFAULT_DIALECT = "compressed-tensors"  # what quantize, convert's recipes and the CLI write unless told
DIALECT_NAMES = tuple(DIALECTS)
BACKEND_NAMES = tuple(BACKENDS)


def dialect(name: str) -> Dialect:
    from fp4kit.errors import Fp4kitError

    if name not in DIALECTS:
        raise Fp4kitError(f"unknown dialect {name!r}; choose one of {', '.join(DIALECTS)}")
    return importlib.import_module(DIALECTS[name]).DIALECT


def dialects() -> list[Dialect]:
    """Every registered dialect, in registration order (the order detection tries them)."""
    return [dialect(name) for name in DIALECTS]


def backend(name: str) -> ModuleType:
    from fp4kit.errors import Fp4kitError

    if name not in BACKENDS:
        raise Fp4kitError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def backends() -> dict[str, ModuleType]:
    return {name: backend(name) for name in BACKENDS}
