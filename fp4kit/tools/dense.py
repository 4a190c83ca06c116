"""An NVFP4 checkpoint seen as a dense one, and `fp4kit convert --to bf16`.

``DenseView`` answers like a ``CheckpointReader`` of the unquantized model: every NVFP4 Linear is dequantized from
the canonical form (fp4kit/nvfp4.py) under its HF name ``<module>.weight``, every other tensor reads as stored. Routed
experts take the family's own on-disk layout, the one transformers' loader expects: one module per expert, or for
the families whose HF checkpoints fuse them (``Family.hf_fused_experts``: Qwen3-VL-MoE, Llama-4) the K-major fused
``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H].

``dequantize_checkpoint`` writes that view out in BF16, one tensor at a time: a weight-only emulation of the
quantized model (input scales are dropped: activations are not quantized) that any HF tool loads, without
transformers' NVFP4 loader (transformers 5.17's ``DecompressExperts`` drops each expert's weight_global_scale, so
NVFP4 MoE checkpoints load into garbage).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fp4kit.families.base import layer_of
from fp4kit.formats.detect import Fp8Module, QuantizedCheckpoint, QuantModule, open_checkpoint
from fp4kit.io.checkpoint import PlannedTensor, ShardWriter, TensorInfo, copy_side_files
from fp4kit.io.output import atomic_directory, check_destination
from fp4kit.layouts.directory import MoELayer, find_moe_layers
from fp4kit.quantize.provenance import PROVENANCE_NAME
from fp4kit.tools.convert_report import ConvertReport

TARGET = "bf16"


class DenseView:
    """Dense tensors of a quantized checkpoint: NVFP4 (and a mixed-precision checkpoint's FP8) weights dequantized to
    ``dtype``, the rest as stored."""

    def __init__(self, ckpt: QuantizedCheckpoint, dtype: torch.dtype = torch.bfloat16):
        self.ckpt, self.dtype = ckpt, dtype
        self.fused: dict[str, tuple[MoELayer, str]] = {}
        in_fused: set[str] = set()
        self.grammar = ckpt.grammar
        if ckpt.family is not None and ckpt.family.hf_fused_experts:
            for layer in find_moe_layers(ckpt):
                for leaf in self.grammar.fused_tensors:
                    self.fused[self.grammar.fused_tensor(layer.experts, leaf)] = (layer, leaf)
                in_fused.update(m.name for members in layer.members for m in members)
        self.modules: dict[str, QuantModule] = {f"{m.name}.weight": m for m in ckpt.modules if m.name not in in_fused}
        self.fp8: dict[str, Fp8Module] = {m.weight: m for m in ckpt.fp8_modules}
        self._passthrough = set(ckpt.passthrough)

    def names(self) -> list[str]:
        return [*self.ckpt.passthrough, *self.modules, *self.fused, *self.fp8]

    def __contains__(self, name: str) -> bool:
        return name in self.modules or name in self.fused or name in self.fp8 or name in self._passthrough

    def info(self, name: str) -> TensorInfo | PlannedTensor:
        if name in self.modules:
            m = self.modules[name]
            return PlannedTensor(name, self.dtype, (m.out_features, m.in_features))
        if name in self.fp8:
            f = self.fp8[name]
            return PlannedTensor(name, self.dtype, (f.out_features, f.in_features))
        if name in self.fused:
            layer, leaf = self.fused[name]
            gate_up = leaf == self.grammar.fused_gate_up
            shape = (layer.hidden, 2 * layer.intermediate) if gate_up else (layer.intermediate, layer.hidden)
            return PlannedTensor(name, self.dtype, (layer.num_experts, *shape))
        return self.ckpt.reader.info(name)

    def read(self, name: str) -> torch.Tensor:
        if name in self.modules:
            return self.ckpt.read_weight(self.modules[name]).dequantize(self.dtype)
        if name in self.fused:
            return self._read_fused(name)
        if name in self.fp8:
            return self.ckpt.read_fp8(self.fp8[name])[0].dequantize(self.dtype)
        return self.ckpt.reader.read(name)

    def _read_fused(self, name: str) -> torch.Tensor:
        layer, leaf = self.fused[name]
        info = self.info(name)
        out = torch.empty(info.shape, dtype=self.dtype)
        for e, (gate, up, down) in enumerate(layer.members):
            if leaf != self.grammar.fused_gate_up:  # canonical [N, K] -> K-major columns
                out[e] = self.ckpt.read_weight(down).dequantize(self.dtype).t()
                continue
            for proj, module in zip(self.grammar.w13, (gate, up), strict=True):
                start, stop, step = self.grammar.gate_up_rows(proj, module.out_features)
                out[e, :, start:stop:step] = self.ckpt.read_weight(module).dequantize(self.dtype).t()
        return out


def dequantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 10**9,
    progress: Callable[[int, int], None] | None = None,
    dtype: torch.dtype = torch.bfloat16,
):
    """Write NVFP4 checkpoint ``src`` as a dense checkpoint into ``dst`` (created atomically): dequantized weights in
    ``dtype`` (BF16 for `convert --to bf16`; float32 keeps the dequantized values exact), other tensors as stored."""
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    with open_checkpoint(src, mixed=True) as ckpt:
        check_destination(src, dst, overwrite)
        view = DenseView(ckpt, dtype)
        names = sorted(view.names(), key=lambda n: (-1 if layer_of(n) is None else layer_of(n), n))
        planned = [PlannedTensor(n, view.info(n).dtype, tuple(view.info(n).shape)) for n in names]
        notes = []
        if ckpt.scheme == "nvfp4":
            notes.append("W4A4 checkpoint: input scales dropped, the dense model does not quantize activations "
                         "(fp4kit eval does)")
        with atomic_directory(dst) as work:
            writer = ShardWriter(work, planned, max_shard_bytes, metadata={"producer": "fp4kit"})
            done = 0
            try:
                for name in names:
                    tensor = view.read(name)
                    writer.write(name, tensor)
                    done += tensor.numel() * tensor.element_size()
                    if progress:
                        progress(done, writer.total_bytes)
            except BaseException:
                writer.abort()
                raise
            writer.finish()
            config = dict(ckpt.config)
            config.pop("quantization_config", None)
            (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            copy_side_files(src, work, skip={PROVENANCE_NAME})  # it describes SRC's dialect
    return ConvertReport(
        source_dialect=ckpt.dialect, target_dialect=TARGET, scheme=ckpt.scheme,
        family=ckpt.family.name if ckpt.family else "unknown", quantized_modules=len(ckpt.modules),
        fused_tensors=len(view.fused), passthrough_tensors=len(ckpt.passthrough), exact_scales_recorded=0,
        input_bytes=sum(info.nbytes for info in ckpt.reader.tensors.values()), output_bytes=writer.total_bytes,
        output_files=writer.files, seconds=time.perf_counter() - start, notes=notes,
    )
