"""SGLang's own pure-python quantization-config code, imported for the oracle tests (tests/test_sglang_*.py).

SGLang is installed without its dependencies (`pip install --no-deps -r .ci/sglang-oracle.txt`: sglang==0.5.23 and
the pure-python module its imports need, as .ci/run does). Its package imports torchvision (image processors) and
sentencepiece (a tokenizer class) at import time, neither of which CI installs (torchvision's wheels are built
against one torch build and CI keeps torch's CPU build): stand-in modules satisfy those imports while SGLang is
imported, and its image-processor registrations go to an inert AutoImageProcessor; the config parsing
under test never touches them. SGLang's registrations with transformers' Auto classes are undone afterwards, so the
rest of the session builds fixtures with transformers' own config classes. Without SGLang the tests skip with the
reason; with FP4KIT_REQUIRE_ORACLES=1 (CI) they fail instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from types import ModuleType

import pytest

SGLANG_VERSION = "0.5.23"
INSTALL = "pip install --no-deps -r .ci/sglang-oracle.txt (SGLang and the module its imports need)"
STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.functional",
             "torchvision.transforms.v2.functional", "torchvision.io", "torchvision.ops", "sentencepiece")


def _unavailable(why: str) -> None:
    if os.environ.get("FP4KIT_REQUIRE_ORACLES"):
        pytest.fail(f"FP4KIT_REQUIRE_ORACLES is set but {why}", pytrace=False)
    pytest.skip(f"{why}; install it with {INSTALL}", allow_module_level=True)


class _StandIn(ModuleType):
    """A module whose every public attribute is an inert class (only names used at import time are asked)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _ImageProcessorRegistry:
    """Stands in for transformers' AutoImageProcessor (which needs torchvision) while SGLang registers its image
    processors at import time."""

    @classmethod
    def register(cls, *args: object, **kwargs: object) -> None:
        pass


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return True
    return False


def _auto_registries() -> list:
    """transformers' Auto* name -> class mappings that ``register`` calls extend (their ``_extra_content``), of the
    Auto modules imported so far (importing more here would change what SGLang's import then sees)."""
    prefix = "transformers.models.auto."
    return [value for name, module in list(sys.modules.items()) if name.startswith(prefix) and module is not None
            for value in list(vars(module).values()) if isinstance(getattr(value, "_extra_content", None), dict)]


def sglang_module(name: str) -> ModuleType:
    """``sglang.<name>``, or skip (fail in CI) when SGLang 0.5.23 cannot be imported."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        installed = version("sglang")
    except PackageNotFoundError:
        _unavailable("SGLang is not installed")
    if installed != SGLANG_VERSION:
        _unavailable(f"SGLang {installed} is installed, the oracles pin {SGLANG_VERSION}")
    if f"sglang.{name}" in sys.modules:
        return sys.modules[f"sglang.{name}"]
    import torch

    if not torch.cuda.is_available():
        # SGLang imports triton: on the CPU the rest of the suite runs Triton's interpreter, which must be switched
        # on before triton is first imported (fp4kit/verify/backends.py)
        from fp4kit.verify.backends import enable_triton_interpreter

        enable_triton_interpreter()
    import transformers
    import transformers.utils.import_utils as import_utils

    registries = _auto_registries()
    registered = {id(r): dict(r._extra_content) for r in registries}
    stand_ins = [s for s in STAND_INS if s.split(".")[0] not in sys.modules and _missing(s.split(".")[0])]
    for stub in stand_ins:
        sys.modules[stub] = _StandIn(stub)
    backend = import_utils.BACKENDS_MAPPING["torchvision"]
    image_processor = transformers.__dict__.get("AutoImageProcessor")
    if stand_ins:
        import_utils.BACKENDS_MAPPING["torchvision"] = (lambda: True, backend[1])
        transformers.AutoImageProcessor = _ImageProcessorRegistry
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"sglang.{name}")
    except ImportError as exc:
        _unavailable(f"sglang.{name} does not import ({exc})")
    finally:
        import_utils.BACKENDS_MAPPING["torchvision"] = backend
        if image_processor is None:
            transformers.__dict__.pop("AutoImageProcessor", None)
        else:
            transformers.AutoImageProcessor = image_processor
        for registry in _auto_registries():  # SGLang registers its own config classes (kimi_k2 among them)
            registry._extra_content.clear()
            registry._extra_content.update(registered.get(id(registry), {}))
        for stub in stand_ins:
            sys.modules.pop(stub, None)
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return module
