"""The layer-streaming text model: a checkpoint's decoder layers built with transformers' own classes and run one at
a time, one layer's weights in memory (the passes of `fp4kit quantize` calibration, `fp4kit eval` and audit).

``text_model`` builds the text model on the meta device from config.json, so it costs no memory, with its embeddings
and rotary embedding loaded. ``layer_inputs`` runs one forward of it with every decoder layer replaced by a recorder:
the embeddings and, per layer, the exact arguments the full model passes (rotary embeddings, causal or chunked masks,
position ids; M-RoPE ids for the vision-language families). ``TextModel.load_layer`` then gives a layer its weights
from the reader in the layout transformers keeps in memory (per-expert tensors stacked into the fused [E, 2I, H]
parameter, transposed fused tensors transposed back, exactly as transformers' loader does; the family's
``MoEModules`` and grammar say which tensors those are), and ``drop_layer`` lets it go.
"""

from __future__ import annotations

import copy
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import Family, LayerCall
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.families.moe_modules import MoEModules
from fp4kit.io.checkpoint import CheckpointReader

READ_THREADS = 8  # concurrent expert reads while a layer loads
# (layer args, layer kwargs) per decoder layer, per batch shape
LayerArguments = dict[tuple[int, ...], dict[int, tuple[tuple, dict]]]


class _StopForward(Exception):
    pass


class _LayerArguments(nn.Module):
    """Stands in for decoder layer ``index``: records what the model passes it; the last one ends the forward."""

    def __init__(self, index: int, last: bool, store: dict[int, tuple[tuple, dict]], inputs: list[torch.Tensor],
                 layer_call: LayerCall | None = None):
        super().__init__()
        self.index, self.last, self.store, self.inputs = index, last, store, inputs
        self.layer_call = layer_call

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        if self.index == 0:
            self.inputs.append(hidden_states)
        self.store[self.index] = (args, kwargs)
        if self.last:
            raise _StopForward
        return self.layer_call.stand_in_output(hidden_states) if self.layer_call else hidden_states


@dataclass
class TextModel:
    """A checkpoint's text model, its decoder layers loaded one at a time (``load_layer``, ``drop_layer``)."""

    model: nn.Module  # on the meta device except the embeddings and the rotary embedding
    layers: list[nn.Module | None]  # the decoder layers, on meta until their turn
    prefix: str  # checkpoint name prefix of the text model, e.g. "model.language_model."
    keep_fp32: tuple[str, ...]
    scales_input: bool  # Llama-4: the router score multiplies the expert input
    family: Family
    moe: MoEModules  # how the family's transformers classes hold the MoE block
    layer_call: LayerCall | None = None  # the family's decoder layers are not hidden -> hidden (GLM-5)

    @property
    def grammar(self) -> ExpertGrammar:
        return self.family.grammar

    def layer_prefix(self, index: int) -> str:
        """Checkpoint name prefix of decoder layer ``index``'s modules, e.g. "model.layers.3."."""
        return f"{self.prefix}layers.{index}."

    def load_layer(self, reader: CheckpointReader, index: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Decoder layer ``index`` with its weights from ``reader`` (any reader of dense tensors), in ``dtype`` (its
        keep-in-fp32 modules in fp32) on ``device``, in eval mode."""
        layer = self.layers[index]
        assert layer is not None
        state = _layer_state_dict(reader, layer, self.layer_prefix(index), device, self)
        for key, tensor in state.items():
            keep_fp32 = any(f".{pattern}." in f".{key}." for pattern in self.keep_fp32)
            state[key] = tensor.to(device, torch.float32 if keep_fp32 and dtype.itemsize < 4 else dtype).contiguous()
        layer.load_state_dict(state, assign=True, strict=True)
        return layer.eval()

    def drop_layer(self, index: int) -> None:
        """Let decoder layer ``index`` go (its weights with it)."""
        self.layers[index] = None


def hf_config(config: dict):
    """transformers' config object of a config.json (as ``AutoConfig.from_pretrained`` builds it from the file)."""
    from transformers import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[config["model_type"]]
    except KeyError:
        raise Fp4kitError(f"config.json: transformers does not know model_type {config.get('model_type')!r}") from None
    return config_class.from_dict(copy.deepcopy(config))


def text_model(reader: CheckpointReader, config: dict, family: Family, dtype: torch.dtype, device: torch.device,
               root: str | Path) -> TextModel:
    """The text model of the checkpoint ``reader`` reads (config.json ``config``, of ``family``), on the meta device
    but its embeddings (from ``reader``, in ``dtype``) and rotary embedding; ``root`` names it in messages."""
    import transformers

    if not family.streams_layers:
        raise Fp4kitError(f"{root}: fp4kit does not stream {family.name}'s transformers decoder layers yet: W4A4 "
                          "calibration (--scheme nvfp4), --method gptq and eval need them (data-free --scheme "
                          "nvfp4a16 with --method rtn or mse does not)")
    text_config = hf_config(config).get_text_config()
    embed_names = [n for n in reader.names() if n.endswith("embed_tokens.weight") and "layers." not in n]
    if len(embed_names) != 1:
        raise Fp4kitError(f"{root}: cannot find the text model's embed_tokens.weight (found {embed_names})")
    prefix = embed_names[0][: -len("embed_tokens.weight")]
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(text_config)
    model.eval()
    model.rotary_emb = type(model.rotary_emb)(config=model.config).to(device)
    embedding = reader.read(embed_names[0]).to(device, dtype)
    model.embed_tokens.load_state_dict({"weight": embedding}, assign=True)
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) + tuple(
        getattr(model, "_keep_in_fp32_modules", None) or ()
    )
    scales_input = family.routing(family.text_config(config)).scales_input
    layer_call = family.layer_call() if family.layer_call else None
    if layer_call:
        layer_call.adapt(list(model.layers))
    return TextModel(model, list(model.layers), prefix, keep, scales_input, family, family.moe_modules(), layer_call)


def _layer_state_dict(reader: CheckpointReader, layer: nn.Module, prefix: str, device: torch.device,
                      text: TextModel) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers from the checkpoint, in the shapes the module holds them (fused experts
    stacked on ``device``, the rest where the reader puts them)."""
    state: dict[str, torch.Tensor] = {}
    for key, expected in layer.state_dict().items():
        name = prefix + text.moe.checkpoint_name(key)
        parts = text.moe.stacked_parts(key, text.grammar)
        if name in reader:
            tensor = reader.read(name)
        elif parts is not None:
            tensor = _stack_experts(reader, name, expected, device, parts, text.grammar, text.moe.bmm)
        else:
            tensor = None
        if tensor is None:
            raise Fp4kitError(f"checkpoint lacks {name}, which transformers' {type(layer).__name__} needs")
        # transformers' loader transposes fused expert tensors whose shape is not the module's (Transpose check_dims)
        if tensor.shape != expected.shape and tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected.shape:
            tensor = tensor.transpose(1, 2)
        if tensor.shape != expected.shape:
            raise Fp4kitError(f"{name}: shape {list(tensor.shape)}, transformers expects {list(expected.shape)}")
        state[key] = tensor
    return state


def _stack_experts(reader: CheckpointReader, name: str, expected: torch.Tensor, device: torch.device,
                   parts: tuple[str, ...], grammar: ExpertGrammar, bmm: bool = False) -> torch.Tensor | None:
    """Per-expert checkpoint tensors read straight into the fused parameter transformers holds ([E, 2I, H] as
    cat(gate, up) per expert, or [E, H, I]; ``bmm``: [E, H, 2I], [E, I, H]; gate and up interleaved where the grammar
    says so), allocated on ``device``: the host holds only the experts in flight. Experts are read by a few threads
    (reads and finiteness checks release the GIL)."""
    experts = name.rsplit(".", 1)[0]
    names = [[f"{grammar.expert_linear(experts, e, part)}.weight" for part in parts] for e in range(expected.shape[0])]
    if not all(n in reader for per_expert in names for n in per_expert):
        return None
    # the widest of the experts' dtypes: a mixed-precision checkpoint's kept (bf16) experts beside dequantized fp32
    # ones must not round the latter to bf16
    dtype = functools.reduce(torch.promote_types, {reader.info(n).dtype for per_expert in names for n in per_expert})
    fused = torch.empty(expected.shape, dtype=dtype, device=device)

    @torch.inference_mode()  # per thread: the fused tensor may be an inference tensor of the caller's
    def place(e: int) -> None:
        target = fused[e].t() if bmm else fused[e]  # [N_total, K]
        for part_name, n in zip(parts, names[e], strict=True):
            part = reader.read(n)
            start, stop, step = (grammar.gate_up_rows(part_name, part.shape[0]) if len(parts) == 2
                                 else (0, part.shape[0], 1))  # gate rows then up rows, or interleaved (gpt-oss)
            rows = target[start:stop:step]
            if part.shape != rows.shape:
                raise Fp4kitError(f"{n}: shape {list(part.shape)} does not fit transformers' {name} "
                                  f"{list(expected.shape)}")
            rows.copy_(part)

    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(names)), thread_name_prefix="fp4kit-read") as pool:
        list(pool.map(place, range(len(names))))
    return fused


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype config.json names (bf16 if it names none)."""
    text = config.get("text_config") or config
    name = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return getattr(torch, str(name), torch.bfloat16) if name else torch.bfloat16


def layer_inputs(text: TextModel, token_ids: torch.Tensor, batch_size: int,
                 batch_share: tuple[int, int] = (0, 1)) -> tuple[list[torch.Tensor], LayerArguments]:
    """Embedded hidden states per batch of ``token_ids`` [S, L], and per batch shape the arguments the model passes
    each layer. ``batch_share`` (rank, world): only batches b with b % world == rank."""
    hidden_batches: list[torch.Tensor] = []
    layer_args: LayerArguments = {}
    count = len(text.layers)
    rank, world = batch_share
    for start in range(batch_size * rank, token_ids.shape[0], batch_size * world):
        store: dict[int, tuple[tuple, dict]] = {}
        text.model.layers = nn.ModuleList(
            [_LayerArguments(i, i == count - 1, store, hidden_batches, text.layer_call) for i in range(count)]
        )
        try:
            text.model(input_ids=token_ids[start : start + batch_size], use_cache=False)
        except _StopForward:
            pass
        except (RuntimeError, ValueError) as exc:  # e.g. a rope config that does not fit the head dimension
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            model = type(text.model).__name__
            raise Fp4kitError(f"transformers' {model} cannot run this config.json: {message}") from None
        layer_args.setdefault(tuple(hidden_batches[-1].shape), store)
    return hidden_batches, layer_args
