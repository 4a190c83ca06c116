"""`fp4kit layout`: an NVFP4 checkpoint -> the same checkpoint with every MoE layer in one backend's kernel layout.

Each MoE layer's per-expert tensors (`<experts>.{e}.{gate,up,down}_proj.*`, either dialect, read through
fp4kit.formats.detect) are stacked into canonical w13 [E, 2I, H] ([w1; w3]) and w2 [E, H, I], handed to the backend's
pure transform (fp4kit.layouts), and written as `<experts>.<kernel argument name>`; every other tensor is copied
byte for byte, and `fp4kit_layout.json` records what a loader needs (docs/layouts.md, "Layout checkpoints").

Streaming: a reader thread reads the next layer while the main thread transforms this one, straight into the
output shards' pages (mapped; shards are planned up front), and a writer thread copies the other tensors, so about
two layers are in memory whatever the model's size.
Every shape constraint is checked for all layers before anything is written; the output directory is atomic.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import group_experts, layer_of
from fp4kit.formats.detect import QuantizedCheckpoint, QuantModule, config_files, open_checkpoint
from fp4kit.io.checkpoint import PlannedTensor, ShardWriter, copy_side_files
from fp4kit.io.output import atomic_directory
from fp4kit.io.streaming import BackgroundWriter, prefetched
from fp4kit.layouts import StackedExperts, cutlass, layout_refusal
from fp4kit.layouts.manifest import MANIFEST, layer_entry, manifest
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor
from fp4kit.registry import backends

BACKENDS: dict[str, ModuleType] = backends()
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
QUEUE_DEPTH = 1  # jobs waiting per queue: a layer of a 235B model is ~1 GB, so about five are in memory


@dataclass
class LayoutOptions:
    backend: str
    act_dtype: str = "bf16"
    cutlass_flavor: str = "flashinfer"
    max_shard_bytes: int = 5 * 10**9
    overwrite: bool = False

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise Fp4kitError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.act_dtype not in ACT_DTYPES:
            raise Fp4kitError(f"unknown activation dtype {self.act_dtype!r}; choose bf16 or fp16")
        if self.cutlass_flavor not in cutlass.KERNEL:
            raise Fp4kitError(f"unknown CUTLASS flavor {self.cutlass_flavor!r}; choose flashinfer or vllm")
        self.transform_options()  # the backend refuses options it cannot run with

    def transform_options(self) -> dict[str, object]:
        """Keyword options of the backend's transform / describe / check_shapes (its ``layout_options``)."""
        return BACKENDS[self.backend].layout_options(ACT_DTYPES[self.act_dtype], self.cutlass_flavor)


@dataclass(frozen=True)
class MoELayer:
    layer: int
    experts: str  # module path of the routed experts, e.g. model.layers.3.mlp.experts
    members: tuple[tuple[QuantModule, QuantModule, QuantModule], ...]  # per expert: gate, up, down
    hidden: int
    intermediate: int
    has_input_scales: bool

    @property
    def num_experts(self) -> int:
        return len(self.members)

    def tensor_name(self, argument: str) -> str:
        return f"{self.experts}.{argument}"

    def sources(self) -> set[str]:
        return {n for ms in self.members for m in ms for n in (m.packed, m.block_scale, m.global_scale, m.input_scale)
                if n}


@dataclass
class LayoutReport:
    backend: str
    moe_layers: int
    num_experts: int
    passthrough_tensors: int
    input_bytes: int
    output_bytes: int
    output_files: list[str]
    seconds: float
    # experts modules whose per-expert gate/up input scales the kernel cannot hold and which got the layer's max
    collapsed_input_scales: list[str] = field(default_factory=list)


def find_moe_layers(ckpt: QuantizedCheckpoint) -> list[MoELayer]:
    """Every MoE layer whose routed experts are all NVFP4, checked complete and consistent in shape. Routed experts
    that are all FP8 (a mixed-precision checkpoint) are no such layer; FP8 experts beside NVFP4 ones in a layer are an
    error, as the fused NVFP4 MoE kernels take one scheme per layer."""
    grammar = ckpt.grammar
    grouped = group_experts(((module.name, module) for module in ckpt.modules), grammar)
    fp8 = group_experts(((module.name, module) for module in ckpt.fp8_modules), grammar)
    for experts in grouped.keys() & fp8.keys():
        module = next(iter(fp8[experts][min(fp8[experts])].values()))
        raise Fp4kitError(f"{module.name}: a {module.scheme} routed expert in a layer of NVFP4 experts; the fused "
                          f"NVFP4 MoE kernels take every expert of a layer in NVFP4")
    family, text_config = ckpt.family, ckpt.family.text_config(ckpt.config) if ckpt.family else {}
    layers = [_moe_layer(experts, found, family.layer_index(experts + ".", text_config) if family else
                         layer_of(experts + "."), grammar.projections) for experts, found in grouped.items()]
    seen: dict[int, str] = {}
    for layer in layers:
        if seen.setdefault(layer.layer, layer.experts) != layer.experts:
            raise Fp4kitError(f"layer {layer.layer} has experts under two modules: {seen[layer.layer]} and "
                              f"{layer.experts}")
    if ckpt.family is not None:
        expected = ckpt.family.num_experts(ckpt.family.text_config(ckpt.config))
        for layer in layers:
            if layer.num_experts != expected:
                raise Fp4kitError(f"{layer.experts}: {layer.num_experts} quantized experts, config.json says "
                                  f"{expected}")
    return sorted(layers, key=lambda lay: lay.layer)


def _moe_layer(experts: str, found: dict[int, dict[str, QuantModule]], layer: int | None,
               projections: tuple[str, str, str]) -> MoELayer:
    if layer is None:
        raise Fp4kitError(f"{experts}: routed experts outside a `layers.N` module")
    if sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise Fp4kitError(f"{experts}: expert {missing[0]} is not an NVFP4 module (experts must be 0..E-1)")
    members = []
    for e in sorted(found):
        lacking = [p for p in projections if p not in found[e]]
        if lacking:
            raise Fp4kitError(f"{experts}.{e}: {lacking[0]} is not NVFP4-quantized; every expert needs gate, up "
                              f"and down in NVFP4")
        members.append(tuple(found[e][p] for p in projections))
    gate = members[0][0]
    hidden, intermediate = gate.in_features, gate.out_features
    expected = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
    for modules in members:
        for module, shape in zip(modules, expected, strict=True):
            if (module.out_features, module.in_features) != shape:
                raise Fp4kitError(f"{module.name}: [{module.out_features}, {module.in_features}], expected "
                                  f"{list(shape)} like expert 0's (H={hidden}, I={intermediate})")
    with_input = {m.input_scale is not None for ms in members for m in ms}
    if len(with_input) != 1:
        raise Fp4kitError(f"{experts}: some expert projections have input scales and others do not")
    return MoELayer(layer, experts, tuple(members), hidden, intermediate, with_input.pop())  # type: ignore[arg-type]


def check_layers(layers: list[MoELayer], options: LayoutOptions) -> None:
    """Every constraint the backend puts on shapes and scales, for all layers, before anything is written."""
    backend = BACKENDS[options.backend]
    shape_options = options.transform_options()
    for layer in layers:
        if why := layout_refusal(backend, layer.num_experts, layer.hidden, layer.intermediate,
                                 not layer.has_input_scales, **shape_options):
            raise Fp4kitError(f"{layer.experts}: {why}")


def kernel_tensors(layer: MoELayer, options: LayoutOptions) -> dict[str, PlannedTensor]:
    """Argument name -> planned output tensor, found by transforming one all-zero expert of the layer's shape:
    every kernel tensor is [E, ...], so only the leading dimension changes."""
    hidden, inter = layer.hidden, layer.intermediate

    def zero(rows: int, cols: int) -> NVFP4Tensor:
        return NVFP4Tensor(torch.zeros(1, rows, cols // 2, dtype=torch.uint8),
                           torch.zeros(1, rows, cols // BLOCK, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.ones(1, dtype=torch.float64))

    one = torch.ones(1, dtype=torch.float64)
    sample = BACKENDS[options.backend].transform(zero(2 * inter, hidden), zero(hidden, inter), one, one,
                                                 **options.transform_options())
    return {arg: PlannedTensor(layer.tensor_name(arg), t.dtype, (layer.num_experts, *t.shape[1:]))
            for arg, t in sample.items()}


def read_layer(ckpt: QuantizedCheckpoint, layer: MoELayer,
               recycled: queue.SimpleQueue | None = None) -> StackedExperts:
    """The layer's canonical stacked w13 / w2 and per-expert input divisors (None for weight-only checkpoints).

    ``recycled`` holds stacked tensors (packed13, scale13, packed2, scale2) of layers done with: reading into them
    instead of fresh buffers spares faulting in ~E * 3 * H * I * 9/16 bytes of new pages per layer."""
    num, hidden, inter = layer.num_experts, layer.hidden, layer.intermediate
    shapes = ((num, 2 * inter, hidden // 2), (num, 2 * inter, hidden // BLOCK), (num, hidden, inter // 2),
              (num, hidden, inter // BLOCK))
    buffers = None
    with contextlib.suppress(queue.Empty):
        buffers = recycled.get_nowait() if recycled is not None else None
    if buffers is None or [tuple(b.shape) for b in buffers] != list(shapes):
        buffers = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in
                        zip(shapes, (torch.uint8, torch.float8_e4m3fn) * 2, strict=True))
    packed13, scale13, packed2, scale2 = buffers
    global13, global2, input13, input2 = (torch.empty(num, dtype=torch.float64) for _ in range(4))
    for e, (gate_module, up_module, down_module) in enumerate(layer.members):
        # straight into the stacked tensors: no per-tensor buffer, no second copy of the layer
        gate = ckpt.read_weight_into(gate_module, packed13[e, :inter], scale13[e, :inter])
        up = ckpt.read_weight_into(up_module, packed13[e, inter:], scale13[e, inter:])
        global2[e] = ckpt.read_weight_into(down_module, packed2[e], scale2[e])
        gate_in, up_in, down_in = (None if m.input_scale is None else ckpt.divisor(m.input_scale)
                                   for m in (gate_module, up_module, down_module))
        _require_shared(f"{layer.experts}.{e}", "weight global", gate, up)
        _require_shared(f"{layer.experts}.{e}", "input", gate_in, up_in)
        global13[e] = gate
        if layer.has_input_scales:
            input13[e], input2[e] = gate_in, down_in
    return StackedExperts(NVFP4Tensor(packed13, scale13, global13), NVFP4Tensor(packed2, scale2, global2),
                          input13 if layer.has_input_scales else None, input2 if layer.has_input_scales else None)


def _require_shared(expert: str, what: str, gate: torch.Tensor | None, up: torch.Tensor | None) -> None:
    if gate is not None and up is not None and not torch.equal(gate, up):
        raise Fp4kitError(f"{expert}: gate and up have different {what} scales ({float(gate):.6g} vs "
                          f"{float(up):.6g}); fused w13 kernels hold one per expert, so the layout would change "
                          f"the model")


def _jobs(ckpt: QuantizedCheckpoint, layers: list[MoELayer]) -> list[MoELayer | str]:
    """Output order = source file order; a layer takes the place of its first source tensor."""
    owner = {name: layer for layer in layers for name in layer.sources()}
    infos = sorted(ckpt.reader.tensors.values(), key=lambda i: (str(i.file), i.begin))
    jobs: list[MoELayer | str] = []
    placed: set[int] = set()
    for info in infos:
        layer = owner.get(info.name)
        if layer is None:
            jobs.append(info.name)
        elif layer.layer not in placed:
            placed.add(layer.layer)
            jobs.append(layer)
    return jobs


def layout_checkpoint(src: str | Path, dst: str | Path, options: LayoutOptions,
                      progress: Callable[[int, int], None] | None = None) -> LayoutReport:
    """Write ``src`` with every MoE layer in ``options.backend``'s kernel layout into ``dst`` (created atomically)."""
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    options.validate()
    backend, transform_options = BACKENDS[options.backend], options.transform_options()
    with open_checkpoint(src, mixed=True) as ckpt:  # FP8 Linears travel as stored, like kept ones
        layers = find_moe_layers(ckpt)
        if not layers:
            raise Fp4kitError(f"{src}: no MoE layer with NVFP4 routed experts (`{ckpt.grammar.hint}`)")
        check_layers(layers, options)
        jobs = _jobs(ckpt, layers)
        reader = ckpt.reader
        planned = {layer.layer: kernel_tensors(layer, options) for layer in layers}
        plan = [t for job in jobs for t in (planned[job.layer].values() if isinstance(job, MoELayer)
                                            else [PlannedTensor(job, reader.info(job).dtype, reader.info(job).shape)])]
        input_bytes = sum(info.nbytes for info in reader.tensors.values())
        entries: dict[str, dict] = {}
        with atomic_directory(dst, src, options.overwrite) as work:
            writer = ShardWriter(work, plan, options.max_shard_bytes, metadata={"producer": "fp4kit",
                                                                                 "fp4kit.layout": options.backend})
            background = BackgroundWriter(writer, QUEUE_DEPTH)
            done = 0
            recycled: queue.SimpleQueue = queue.SimpleQueue()

            def produce(job: object) -> object:
                if not isinstance(job, MoELayer):
                    return reader.read(job)  # type: ignore[arg-type]
                canonical = read_layer(ckpt, job, recycled)
                # describe runs here, beside the reads, because it can cost a pass over the layer (Marlin's factor)
                return canonical, backend.describe(*canonical.arguments(), **transform_options)

            try:
                for job, data in prefetched(jobs, produce, QUEUE_DEPTH):
                    if isinstance(job, MoELayer):
                        canonical, meta = data  # type: ignore[misc]
                        # computed straight into the output file's pages (no buffer per kernel tensor to fault in,
                        # no second copy by pwrite); the writer only records what is already in place
                        out = {arg: t for arg in planned[job.layer]
                               if (t := writer.destination(job.tensor_name(arg))) is not None}
                        tensors = backend.transform(*canonical.arguments(), **transform_options, out=out)
                        if len(out) == len(tensors):  # every result is in the output file: the source is free
                            w13, w2 = canonical.w13, canonical.w2
                            recycled.put((w13.packed, w13.block_scale, w2.packed, w2.block_scale))
                            del w13, w2
                        del out, canonical, data
                        entries[str(job.layer)] = layer_entry(job.experts, planned[job.layer], meta)
                        background.put({job.tensor_name(arg): t for arg, t in tensors.items()})
                        del tensors
                        done += sum(reader.info(n).nbytes for n in job.sources())
                    else:
                        background.put({job: data})
                        done += reader.info(job).nbytes
                    if progress:
                        progress(done, input_bytes)
                background.close()
            except BaseException:
                with contextlib.suppress(BaseException):  # the first error is the one to report
                    background.close()
                writer.abort()
                raise
            writer.finish()
            for name in ("config.json", *config_files()):
                if (src / name).is_file():
                    shutil.copy2(src / name, work / name)
            copy_side_files(src, work)
            document = manifest(options.backend, transform_options, ACT_DTYPES[options.act_dtype], ckpt, entries)
            (work / MANIFEST).write_text(json.dumps(document, indent=2) + "\n")
    collapsed = [entry["module"] for entry in document["layers"].values()
                 if entry["options"].get("collapsed_input_scales13")]
    return LayoutReport(options.backend, len(layers), layers[0].num_experts, len(jobs) - len(layers), input_bytes,
                        writer.total_bytes, writer.files, time.perf_counter() - start, collapsed)
