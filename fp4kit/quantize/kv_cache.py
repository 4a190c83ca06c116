"""The FP8 KV cache (`quantize --kv-cache fp8`): which attention modules have a KV cache, and the hook on the keys and
values their attention computes, for calibration (their amax) and for `fp4kit eval` (quantized as vLLM caches them).

vLLM 0.33's ``Attention`` layer receives the keys after the projection, the key norm and RoPE, and the values after
the projection, and writes them to the cache divided by the layer's ``k_scale`` / ``v_scale``
(model_executor/layers/attention/attention.py; csrc/cache_kernels.cu). transformers' attention modules pass the same
tensors to their attention function (``ALL_ATTENTION_FUNCTIONS``), so the hook sits there: each hooked module gets a
config of its own whose attention implementation runs the hook and then the implementation the model was built with.
llm-compressor observes the same tensors (compressed-tensors' ``QuantizedKVCache``, at the cache update).

Full-attention layers only: the Gated DeltaNet layers of the Qwen hybrids have no KV cache, and MLA families (whose
cache is the compressed latent) are refused (``Family.mla_attention``).
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import Family

KV_CACHE_CHOICES = ("fp8",)
_HOOKED = "fp4kit_kv_hooked"
_ATTENTION_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.self_attn\.k_proj\.weight$")
# (keys, values) -> (keys, values) the attention then runs with
KvHook = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


def check_kv_cache(choice: str | None, family: Family | None = None) -> None:
    if choice is None:
        return
    if choice not in KV_CACHE_CHOICES:
        raise Fp4kitError(f"unknown --kv-cache {choice!r}; choose {' or '.join(KV_CACHE_CHOICES)}")
    if family is not None and family.mla_attention:
        raise Fp4kitError(f"--kv-cache {choice}: {family.name} has MLA attention, whose vLLM cache holds the "
                          "compressed latent and the rotary key under one scale, not keys and values; fp4kit does "
                          "not calibrate that scale")


def kv_cache_attention(names: Iterable[str], num_hidden_layers: int) -> list[str]:
    """The attention modules with a KV cache, from a checkpoint's tensor names: every decoder layer's ``self_attn``
    with a ``k_proj`` under the text model's prefix (that of ``embed_tokens``, as the layer-streaming model finds it),
    so no vision tower, MTP layer past ``num_hidden_layers`` or linear-attention layer."""
    names = list(names)
    embeds = [n for n in names if n.endswith("embed_tokens.weight") and "layers." not in n]
    text_prefix = embeds[0][: -len("embed_tokens.weight")] if len(embeds) == 1 else None
    found = []
    for name in names:
        match = _ATTENTION_KEY.match(name)
        if match and match["prefix"] == text_prefix and int(match["layer"]) < num_hidden_layers:
            found.append((int(match["layer"]), name[: -len(".k_proj.weight")]))
    return [attention for _, attention in sorted(found)]


def _hooked_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      *args: object, **kwargs: object) -> object:
    hook, attention = getattr(module, _HOOKED)
    replaced = hook(key, value)
    if replaced is not None:
        key, value = replaced
    return attention(module, query, key, value, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _HOOKED not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_HOOKED, _hooked_attention)


def attach_kv_hooks(layer: nn.Module, layer_prefix: str, checkpoint_name: Callable[[str], str],
                    hook_for: Callable[[str], KvHook | None]) -> list[str]:
    """Hook the keys and values of every attention module of ``layer`` (a decoder layer of transformers' class)
    that ``hook_for(checkpoint module name)`` gives a hook; returns the hooked modules' checkpoint names."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _register()
    hooked = []
    for name, module in layer.named_modules():
        if not (isinstance(getattr(module, "k_proj", None), nn.Linear) and hasattr(module, "config")):
            continue
        full = layer_prefix + checkpoint_name(name)
        hook = hook_for(full)
        if hook is None:
            continue
        built_with = module.config._attn_implementation
        if built_with in ALL_ATTENTION_FUNCTIONS:
            attention = ALL_ATTENTION_FUNCTIONS[built_with]
        else:  # eager: the modeling file's own
            attention = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if attention is None:
                raise Fp4kitError(f"{full}: cannot find the attention function of transformers' "
                                  f"{type(module).__name__} to hook its keys and values")
        config = copy.copy(module.config)
        config._attn_implementation = _HOOKED
        module.config = config
        setattr(module, _HOOKED, (hook, attention))
        hooked.append(full)
    return hooked


class KvAmaxRecorder:
    """Running amax of the keys and values of one decoder layer's attention modules, on the device until ``flush``."""

    def __init__(self, layer: nn.Module, layer_prefix: str, checkpoint_name: Callable[[str], str],
                 wanted: set[str]):
        self.amax: dict[str, torch.Tensor] = {}

        def hook_for(name: str) -> KvHook | None:
            if name not in wanted:
                return None

            def record(key: torch.Tensor, value: torch.Tensor) -> None:
                for part, x in ((kv_name(name, "k"), key), (kv_name(name, "v"), value)):
                    amax = x.detach().abs().amax().float()
                    self.amax[part] = torch.maximum(self.amax[part], amax) if part in self.amax else amax

            return record

        self.hooked = attach_kv_hooks(layer, layer_prefix, checkpoint_name, hook_for)

    def flush(self, into: dict[str, float]) -> None:
        for name, amax in self.amax.items():
            into[name] = float(amax)


def kv_name(attention: str, part: str) -> str:
    """The calibration record of ``attention``'s keys (``part`` k) or values (v)."""
    return f"{attention}.{part}_cache"


def kv_scales(attention: list[str], kv_amax: dict[str, float]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per attention module, its (k_scale, v_scale) from the calibrated amax; an error naming a module the
    calibration pass did not reach (its attention did not run through transformers' attention function)."""
    from fp4kit.fp8 import fp8_kv_scale

    scales = {}
    for name in attention:
        parts = [kv_name(name, p) for p in ("k", "v")]
        missing = [p for p in parts if p not in kv_amax]
        if missing:
            raise Fp4kitError(f"{name}: the calibration pass saw no keys or values of this attention module, so it "
                              "has no FP8 KV-cache scale")
        scales[name] = (fp8_kv_scale(kv_amax[parts[0]], parts[0]), fp8_kv_scale(kv_amax[parts[1]], parts[1]))
    return scales
