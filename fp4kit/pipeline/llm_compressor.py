"""llm-compressor recipes read as fp4kit recipes (`fp4kit run LLMC.yaml`, `fp4kit recipe convert`).

llm-compressor's recipe format (its ``llmcompressor.recipe.Recipe.from_dict``): top-level ``<name>_stage`` mappings
of ``<group>_modifiers`` mappings of ``ModifierClass: {arguments}``. Its quantization modifiers become fp4kit's
quantize step: ``QuantizationModifier`` is round to nearest (``mse`` with an MSE weight observer), ``GPTQModifier``
is GPTQ; ``scheme`` NVFP4 / NVFP4A16, ``targets``, ``ignore``, ``dampening_frac`` and the weight observer carry over.
What fp4kit cannot honour is said in one line each (a note), or refused where honouring it was the point (a scheme
fp4kit does not write, a target or ignore by class name). fp4kit's top-level keys (``model``, ``family``, its steps)
may sit beside the stages; ``family`` is found from the model's config.json when absent.
"""

from __future__ import annotations

import re
from typing import Any

from fp4kit.errors import Fp4kitError

STAGE, GROUP = "_stage", "_modifiers"
SCHEMES = {"NVFP4": "nvfp4", "NVFP4A16": "nvfp4a16"}
METHODS = {"QuantizationModifier": "rtn", "GPTQModifier": "gptq"}
MSE_OBSERVERS = ("mse", "memoryless_mse")
# llm-compressor's NVFP4 search over 0.8x-1.8x of each block's absmax (observers/mse.py): fp4kit's LOW:HIGH search
EXPANDED_MSE_OBSERVERS = {"nvfp4_expanded_mse": "0.8:1.8", "fouroversix": "0.8:1.8"}
MINMAX_OBSERVERS = ("minmax", "memoryless_minmax", "static_minmax")
GPTQ_BLOCK = 128  # fp4kit's GPTQ block (QuantizeOptions.gptq_block_size)
# bookkeeping and speed settings of llm-compressor's modifiers: no bearing on the checkpoint a one-shot run writes
NO_EFFECT = ("index", "group", "start", "end", "update", "requires_calibration_data", "bypass_divisibility_checks",
             "batched_quantization", "offload_hessians", "sequential_update")
CLASS_NAME = re.compile(r"^[A-Z][A-Za-z0-9_]*$")  # `Linear`, `Qwen3MoeSparseMoeBlock`: a module class, not a name

KeyPath = tuple[str | int, ...]  # a key's place in the recipe: ('quant_stage', 'quant_modifiers', ...)


def is_llm_compressor_recipe(data: dict) -> bool:
    return any(isinstance(k, str) and k.endswith(STAGE) and isinstance(v, dict) for k, v in data.items())


class Translation:
    """An llm-compressor recipe's data as an fp4kit recipe's, with where each key came from and the notes."""

    def __init__(self, data: dict, lines: dict[KeyPath, int], file: str):
        self.source, self.source_lines, self.file = data, lines, file
        self.data: dict[str, Any] = {}
        self.lines: dict[KeyPath, int] = {}
        self.notes: list[str] = []

    def where(self, path: KeyPath) -> str:
        for end in range(len(path), -1, -1):
            if path[:end] in self.source_lines:
                return f"{self.file}:{self.source_lines[path[:end]]}"
        return self.file

    def note(self, path: KeyPath, text: str) -> None:
        self.notes.append(f"{self.where(path)}: {'.'.join(map(str, path))}: {text}")

    def error(self, path: KeyPath, text: str) -> Fp4kitError:
        return Fp4kitError(f"{self.where(path)}: {'.'.join(map(str, path))}: {text}")

    def set(self, key: str, value: Any, source: KeyPath) -> None:
        """quantize.KEY from ``source``, unless the recipe's own ``quantize`` mapping sets KEY."""
        own = self.source.get("quantize")
        if isinstance(own, dict) and key in own:
            return
        if not isinstance(self.data.get("quantize"), dict):
            self.data["quantize"] = {}
        self.data["quantize"][key] = value
        if source in self.source_lines:
            self.lines[("quantize", key)] = self.source_lines[source]


def translate(data: dict, lines: dict[KeyPath, int], file: str, fp4kit_keys: set[str]) -> Translation:
    """``data`` (an llm-compressor recipe, with the 1-based ``lines`` of its keys) as fp4kit recipe data."""
    out = Translation(data, lines, file)
    modifiers: list[tuple[KeyPath, str, dict]] = []
    for key, value in data.items():
        if key in fp4kit_keys:
            out.data[key] = value
            out.lines.update({p: n for p, n in lines.items() if p[:1] == (key,)})
        elif isinstance(key, str) and key.endswith(STAGE) and isinstance(value, dict):
            for group, entries in value.items():
                if not (isinstance(group, str) and group.endswith(GROUP) and isinstance(entries, dict)):
                    out.note((key, group), "not a modifier group (`*_modifiers`): not read")
                    continue
                for name, arguments in entries.items():
                    modifiers.append(((key, group, name), str(name), arguments if isinstance(arguments, dict) else {}))
        else:
            out.note((key,), "not an llm-compressor stage (`*_stage`) nor an fp4kit key: not read")
    quantizers = [m for m in modifiers if m[1] in METHODS]
    for path, name, _ in modifiers:
        if name not in METHODS:
            out.note(path, f"fp4kit runs no {name}: not honoured (the weights are quantized as they are)")
    if not quantizers:
        raise out.error((), f"no quantization modifier ({' or '.join(METHODS)}): nothing for fp4kit to run")
    if len(quantizers) > 1:
        raise out.error(quantizers[1][0], "a second quantization modifier: fp4kit runs one quantize step per recipe")
    _quantizer(out, *quantizers[0])
    return out


def _patterns(out: Translation, path: KeyPath, value: Any, drop: tuple[str, ...] = ()) -> list[str]:
    """llm-compressor target strings as fp4kit's module-name regexes: ``re:X`` matches from the name's start
    (re.match), a plain string is a whole module name."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise out.error(path, f"expected a string or a list of strings, got {value!r}")
    regexes = []
    for item in items:
        if item in drop:
            continue
        if item.startswith("re:"):
            regexes.append(f"^(?:{item[3:]})")
        elif CLASS_NAME.match(item):
            raise out.error(path, f"{item!r} is a module class: fp4kit selects modules by name (use 're:...')")
        else:
            regexes.append(f"^{re.escape(item)}$")
    return regexes


def _scheme(out: Translation, path: KeyPath, arguments: dict) -> tuple[str, Any]:
    scheme, targets = arguments.get("scheme"), arguments.get("targets", "Linear")
    if isinstance(scheme, dict) and len(scheme) == 1:  # {NVFP4: [targets]}
        (scheme, targets), = scheme.items()
    if scheme is None:
        what = "config_groups: fp4kit reads a preset scheme" if "config_groups" in arguments else "no scheme"
        raise out.error((*path, "scheme"), f"{what}; use scheme: NVFP4 or NVFP4A16")
    if not isinstance(scheme, str) or scheme.upper() not in SCHEMES:
        raise out.error((*path, "scheme"), f"{scheme!r}: fp4kit writes {' and '.join(SCHEMES)} only")
    return SCHEMES[scheme.upper()], targets


def _observer(arguments: dict, kind: str) -> str | None:
    observers = arguments.get("observer") or {}
    return observers.get(kind) if isinstance(observers, dict) and observers.get(kind) else arguments.get(
        {"weights": "weight_observer", "input": "input_observer", "output": "output_observer"}[kind])


def _quantizer(out: Translation, path: KeyPath, name: str, arguments: dict) -> None:
    gptq = name == "GPTQModifier"
    scheme, targets = _scheme(out, path, arguments)
    out.set("scheme", scheme, (*path, "scheme"))
    method = METHODS[name]
    regexes = _patterns(out, (*path, "targets"), targets, drop=("Linear",))
    if regexes:
        out.set("targets", regexes, (*path, "targets"))
    if arguments.get("ignore"):
        out.set("ignore", _patterns(out, (*path, "ignore"), arguments["ignore"]), (*path, "ignore"))
    weight = _observer(arguments, "weights")
    if isinstance(weight, str):  # llm-compressor's registry takes either spelling
        weight = weight.lower().replace("-", "_")
    if weight in EXPANDED_MSE_OBSERVERS:
        out.set("mse_range", EXPANDED_MSE_OBSERVERS[weight], (*path, "weight_observer"))
    if weight in MSE_OBSERVERS or weight in EXPANDED_MSE_OBSERVERS:
        if gptq:
            out.set("gptq_scales", "mse", (*path, "weight_observer"))
        else:
            method = "mse"
    elif weight in MINMAX_OBSERVERS:
        if gptq:
            out.set("gptq_scales", "rtn", (*path, "weight_observer"))
    elif weight is not None:
        out.note((*path, "weight_observer"), f"{weight}: not honoured (fp4kit's weight scales: round to nearest, "
                                             f"or the mse search)")
    out.set("method", method, path)
    inputs = _observer(arguments, "input")
    if inputs is not None and inputs not in MINMAX_OBSERVERS:
        out.note((*path, "input_observer"), f"{inputs}: not honoured (fp4kit's input scales: the calibration "
                                            f"data's largest value)")
    if _observer(arguments, "output") is not None:
        out.note((*path, "output_observer"), "not honoured (fp4kit quantizes no outputs)")
    for key, value in arguments.items():
        where = (*path, key)
        if key in ("scheme", "targets", "ignore", "observer", "weight_observer", "input_observer",
                   "output_observer", "config_groups") or key in NO_EFFECT or key.endswith("_"):
            continue
        if gptq and key == "dampening_frac":
            if value is not None:
                out.set("gptq_damp", value, where)
        elif gptq and key == "block_size":
            if value != GPTQ_BLOCK:
                out.note(where, f"{value}: not honoured (fp4kit's GPTQ updates in blocks of {GPTQ_BLOCK} columns)")
        elif gptq and key == "actorder":
            if value is not None:
                out.note(where, f"{value}: not honoured (fp4kit's GPTQ quantizes the columns in their order)")
        elif key == "sequential_targets":
            out.note(where, "fp4kit calibrates one decoder layer at a time, whatever this names")
        elif key == "kv_cache_scheme":
            if _fp8_per_tensor(value):
                out.set("kv_cache", "fp8", where)
            elif value is not None:
                out.note(where, f"not honoured (fp4kit calibrates a per-tensor FP8 KV cache only: {_short(value)})")
        else:
            out.note(where, f"unknown to fp4kit: not honoured ({_short(value)})")


def _fp8_per_tensor(value: Any) -> bool:
    """Whether an llm-compressor ``kv_cache_scheme`` is the per-tensor static FP8 one `--kv-cache fp8` writes."""
    return (isinstance(value, dict) and value.get("num_bits") == 8 and value.get("type") == "float"
            and value.get("strategy", "tensor") in ("tensor", None) and not value.get("dynamic", False)
            and value.get("symmetric", True))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
