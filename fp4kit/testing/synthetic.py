"""Synthetic checkpoints with real layer shapes, for benchmarks (docs/BENCHMARKS.md).

The checkpoint is laid out like Qwen3-30B-A3B's: per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` in bf16,
q/k/v/o with 32 heads, 4 KV heads and head_dim 128, q/k norms, the ``mlp.gate`` router, embeddings and lm_head,
sharded with a ``model.safetensors.index.json``. Only the vocabulary is small, to keep the size down. Every name and
shape is planned first, then each tensor is drawn from its own seeded generator and written at its offset, so the
files stream to disk with a few tensors in memory, and the bytes do not depend on how many threads draw them.

``write_synthetic`` does the same for any family from a config.json (``published_config`` holds the layer shapes of
released models): the names, shapes and dtypes are what transformers' class of the family writes with
``save_pretrained`` (its model built on the meta device, the checkpoint conversion reverted), so the release's on-disk
layout comes from transformers, not from names spelled here.

``repeat_first_layer`` turns a (quantized) one-layer checkpoint into one of N identical layers, so that benchmarks
and memory tests of the NVFP4 commands reach realistic sizes without quantizing every layer.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families import qwen3_moe
from fp4kit.families.base import layer_of
from fp4kit.io.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointReader, PlannedTensor, ShardWriter

WEIGHT_STD = 0.02
NORM_STD = 0.1
REAL_SHARD_BYTES = 4 * 10**9  # Qwen3-30B-A3B ships 16 shards of ~4 GB


QWEN3 = qwen3_moe.FAMILY.grammar


@dataclass(frozen=True)
class Qwen3MoeDims:
    num_layers: int
    hidden: int = 2048
    moe_intermediate: int = 768
    num_experts: int = 128
    top_k: int = 8
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 8192


def qwen3_moe_config(dims: Qwen3MoeDims) -> dict:
    """config.json as Qwen3-30B-A3B ships it, with these dimensions."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "decoder_sparse_step": 1,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "hidden_size": dims.hidden,
        "initializer_range": 0.02,
        "intermediate_size": 3 * dims.hidden,
        "max_position_embeddings": 40960,
        "max_window_layers": dims.num_layers,
        "mlp_only_layers": [],
        "moe_intermediate_size": dims.moe_intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": dims.num_heads,
        "num_experts": dims.num_experts,
        "num_experts_per_tok": dims.top_k,
        "num_hidden_layers": dims.num_layers,
        "num_key_value_heads": dims.num_kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": dims.vocab_size,
    }


def _layer_plan(layer: int, dims: Qwen3MoeDims) -> list[PlannedTensor]:
    bf16, p = torch.bfloat16, f"model.layers.{layer}."
    experts = QWEN3.experts_of(f"{p}mlp")
    q_width, kv_width = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    tensors = [
        PlannedTensor(p + "input_layernorm.weight", bf16, (dims.hidden,)),
        PlannedTensor(p + "self_attn.q_proj.weight", bf16, (q_width, dims.hidden)),
        PlannedTensor(p + "self_attn.k_proj.weight", bf16, (kv_width, dims.hidden)),
        PlannedTensor(p + "self_attn.v_proj.weight", bf16, (kv_width, dims.hidden)),
        PlannedTensor(p + "self_attn.o_proj.weight", bf16, (dims.hidden, q_width)),
        PlannedTensor(p + "self_attn.q_norm.weight", bf16, (dims.head_dim,)),
        PlannedTensor(p + "self_attn.k_norm.weight", bf16, (dims.head_dim,)),
        PlannedTensor(p + "post_attention_layernorm.weight", bf16, (dims.hidden,)),
        PlannedTensor(QWEN3.router_weights(experts)[0], bf16, (dims.num_experts, dims.hidden)),
    ]
    w13_shape, w2_shape = (dims.moe_intermediate, dims.hidden), (dims.hidden, dims.moe_intermediate)
    for e in range(dims.num_experts):
        for proj, name in zip(QWEN3.projections, QWEN3.expert_linears(experts, e), strict=True):
            tensors.append(PlannedTensor(f"{name}.weight", bf16, w2_shape if proj == QWEN3.down else w13_shape))
    return tensors


def qwen3_moe_tensor_plan(dims: Qwen3MoeDims) -> list[PlannedTensor]:
    """Every tensor of the checkpoint, in file order: embeddings, the decoder layers, final norm, lm_head."""
    bf16 = torch.bfloat16
    plan = [PlannedTensor("model.embed_tokens.weight", bf16, (dims.vocab_size, dims.hidden))]
    for layer in range(dims.num_layers):
        plan.extend(_layer_plan(layer, dims))
    plan.append(PlannedTensor("model.norm.weight", bf16, (dims.hidden,)))
    plan.append(PlannedTensor("lm_head.weight", bf16, (dims.vocab_size, dims.hidden)))
    return plan


def random_tensor(planned: PlannedTensor, seed: int) -> torch.Tensor:
    """Normal weights (std 0.02); norm weights 1 + N(0, 0.1), as trained norms look."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(planned.shape, generator=generator, dtype=planned.dtype)
    if planned.name.endswith("norm.weight"):
        return values.mul_(NORM_STD).add_(1.0)
    return values.mul_(WEIGHT_STD)


def _write_index_if_single(directory: Path, writer: ShardWriter) -> None:
    # ShardWriter writes an index only for several shards; real checkpoints of this family always carry one.
    if writer.files == [SINGLE_NAME]:
        weight_map = {name: SINGLE_NAME for name in sorted(writer.slots)}
        index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


# Layer shapes of released models, from their published config.json (transformers 5.17's configuration classes of
# these model types default to the same values). Only the vocabulary and the vision tower's depth are cut, to keep
# the files small; ``published_config`` sets the layer count.
PUBLISHED: dict[str, dict] = {
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
            "rms_norm_eps": 1e-06, "vocab_size": 8192, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        },
        "vision_config": {"depth": 1, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 2304},
    },
    # every layer MoE (the release's first 3 are dense): the shapes measured are the MoE layers'
    "glm-5": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "tie_word_embeddings": False,
        "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "intermediate_size": 12288,
        "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "first_k_dense_replace": 0, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-05, "vocab_size": 8192,
        "max_position_embeddings": 202752,
    },
}


def published_config(model: str, num_layers: int, **text_overrides: object) -> dict:
    """config.json of a ``PUBLISHED`` model with ``num_layers`` decoder layers (a Qwen hybrid's layer types in the
    release's pattern, three linear-attention layers then one full-attention; with fewer than four layers, the last is
    full attention, so both kinds are there) and any text-config key overridden (e.g. a smaller expert count)."""
    config = json.loads(json.dumps(PUBLISHED[model]))
    text = config.get("text_config", config)
    text.update(text_overrides, num_hidden_layers=num_layers)
    interval = text.pop("full_attention_interval", None)
    if interval:
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
        text["layer_types"] = kinds
    if "first_k_dense_replace" in text:
        first_dense = int(text["first_k_dense_replace"])
        text["mlp_layer_types"] = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    return config


def release_tensor_plan(config: dict) -> list[PlannedTensor]:
    """Every tensor a checkpoint of ``config`` holds on disk, in name order: transformers' class of its first
    architecture, built on the meta device in bf16 (what the class keeps in fp32 stays fp32), its state dict mapped
    back to the checkpoint's names by the reverse of transformers' conversion mapping, as ``save_pretrained`` does
    (per-expert tensors for the families whose releases store them so)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = transformers.AutoConfig.for_model(**config)
    model_class = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = model_class._from_config(hf_config, dtype=torch.bfloat16)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    return [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in state.items()]


def write_synthetic(path: str | os.PathLike, config: dict, seed: int = 0, max_shard_bytes: int = REAL_SHARD_BYTES,
                    threads: int = 2) -> Path:
    """Write a checkpoint of ``config`` (config.json, shards, index; the tensors of ``release_tensor_plan``, seeded
    as ``random_tensor``) into ``path`` and return it."""
    return _write_plan(Path(path), release_tensor_plan(config), config, seed, max_shard_bytes, threads)


def _write_plan(directory: Path, plan: list[PlannedTensor], config: dict, seed: int, max_shard_bytes: int,
                threads: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(directory, plan, max_shard_bytes, metadata={"producer": "fp4kit.synthetic"})

    def draw_and_write(index: int) -> None:
        planned = plan[index]
        writer.write(planned.name, random_tensor(planned, seed * 1_000_003 + index))

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for _ in pool.map(draw_and_write, range(len(plan))):
                pass
    except BaseException:
        writer.abort()
        raise
    writer.finish()
    _write_index_if_single(directory, writer)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_synthetic_qwen3_moe(
    path: str | os.PathLike,
    num_layers: int,
    hidden: int = 2048,
    moe_intermediate: int = 768,
    num_experts: int = 128,
    top_k: int = 8,
    seed: int = 0,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    vocab_size: int = 8192,
    max_shard_bytes: int = REAL_SHARD_BYTES,
    threads: int = 2,
) -> Path:
    """Write a bf16 Qwen3-MoE checkpoint (config.json, shards, index) into ``path`` and return it."""
    dims = Qwen3MoeDims(num_layers, hidden, moe_intermediate, num_experts, top_k, num_heads, num_kv_heads,
                        head_dim, vocab_size)
    return _write_plan(Path(path), qwen3_moe_tensor_plan(dims), qwen3_moe_config(dims), seed, max_shard_bytes,
                       threads)


_LAYER0 = re.compile(r"\blayers\.0\.")


def _per_layer(names: list[str], num_layers: int) -> list[str]:
    """Names of layer 0 (``...layers.0....``) once per layer; other names unchanged."""
    return [_LAYER0.sub(f"layers.{i}.", n) for n in names for i in (range(num_layers) if _LAYER0.search(n) else [0])]


def repeat_first_layer(src: str | os.PathLike, dst: str | os.PathLike, num_layers: int,
                       max_shard_bytes: int = REAL_SHARD_BYTES) -> Path:
    """Write ``src`` (a one-layer checkpoint) to ``dst`` with ``num_layers`` decoder layers, each a byte copy of its
    layer 0. config.json's layer counts, the ignore list of its ``quantization_config`` and ``hf_quant_config.json``'s
    exclude_modules follow; the shards' metadata is kept as is, so it must not name tensors."""
    src, directory = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("num_hidden_layers") != 1:
        raise Fp4kitError(f"{src}: repeat_first_layer needs a one-layer checkpoint")
    directory.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(src) as reader:
        if any(key not in ("format", "producer") for key in reader.metadata):
            raise Fp4kitError(f"{src}: shard metadata {sorted(reader.metadata)} may name tensors; not repeated")
        source = {}  # output name -> source name
        for name in reader.names():
            for i in range(num_layers) if layer_of(name) == 0 else [None]:
                source[name if i is None else _LAYER0.sub(f"layers.{i}.", name)] = name

        def order(name: str) -> tuple[int, int, str]:
            layer = layer_of(name)  # embeddings, then the layers, then the final norm and the head
            return (0, -1, name) if "embed" in name else (1, layer, name) if layer is not None else (2, 0, name)

        names = sorted(source, key=order)
        plan = [PlannedTensor(n, reader.info(source[n]).dtype, reader.info(source[n]).shape) for n in names]
        writer = ShardWriter(directory, plan, max_shard_bytes, metadata=dict(reader.metadata))
        try:
            for name in names:
                writer.write(name, reader.read(source[name]))
        except BaseException:
            writer.abort()
            raise
        writer.finish()
    _write_index_if_single(directory, writer)
    config["num_hidden_layers"] = num_layers
    if "max_window_layers" in config:
        config["max_window_layers"] = num_layers
    quant = config.get("quantization_config") or {}
    for key in ("ignore", "exclude_modules"):
        if isinstance(quant.get(key), list):
            quant[key] = _per_layer(quant[key], num_layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_quant = src / "hf_quant_config.json"
    if hf_quant.exists():
        data = json.loads(hf_quant.read_text())
        modules = data.get("quantization", {}).get("exclude_modules")
        if isinstance(modules, list):
            data["quantization"]["exclude_modules"] = _per_layer(modules, num_layers)
        (directory / "hf_quant_config.json").write_text(json.dumps(data, indent=4) + "\n")
    return directory
