"""Synthetic Qwen3-MoE checkpoints with real layer shapes, for benchmarks (docs/BENCHMARKS.md).

The checkpoint is laid out like Qwen3-30B-A3B's: per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` in bf16,
q/k/v/o with 32 heads, 4 KV heads and head_dim 128, q/k norms, the ``mlp.gate`` router, embeddings and lm_head,
sharded with a ``model.safetensors.index.json``. Only the vocabulary is small, to keep the size down. Every name and
shape is planned first, then each tensor is drawn from its own seeded generator and written at its offset, so the
files stream to disk with a few tensors in memory, and the bytes do not depend on how many threads draw them.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.checkpoint import INDEX_NAME, SINGLE_NAME, PlannedTensor, ShardWriter

WEIGHT_STD = 0.02
NORM_STD = 0.1
REAL_SHARD_BYTES = 4 * 10**9  # Qwen3-30B-A3B ships 16 shards of ~4 GB


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
        PlannedTensor(p + "mlp.gate.weight", bf16, (dims.num_experts, dims.hidden)),
    ]
    for e in range(dims.num_experts):
        expert = f"{p}mlp.experts.{e}."
        tensors.append(PlannedTensor(expert + "gate_proj.weight", bf16, (dims.moe_intermediate, dims.hidden)))
        tensors.append(PlannedTensor(expert + "up_proj.weight", bf16, (dims.moe_intermediate, dims.hidden)))
        tensors.append(PlannedTensor(expert + "down_proj.weight", bf16, (dims.hidden, dims.moe_intermediate)))
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
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    plan = qwen3_moe_tensor_plan(dims)
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
    (directory / "config.json").write_text(json.dumps(qwen3_moe_config(dims), indent=2) + "\n")
    return directory
