"""GPTQ with NVFP4 groups, and the per-layer quantizer of the calibrated methods (gptq, importance-weighted mse).

GPTQ (Frantar et al., as llm-compressor's GPTQModifier runs it) quantizes a weight W [N, K] column by column and
spreads each column's rounding error over the columns not yet quantized, through the inverse Hessian of the layer's
inputs H = sum x^T x, minimizing tr((W - Q) H (W - Q)^T). NVFP4 groups are the 16-blocks along K: when the pass
reaches a block's first column, that block's FP8 scale is chosen from the error-compensated weights (RTN, or the
mse search weighted by diag H), under a weight global scale fixed up front from the original weights (the one a
fused group shares). Activation order only in its static-group form (_static_act_order: the scales fixed from the
natural 16-blocks, so no permutation tensor is needed). Optionally (float_target) the target is not W but the
weights that map the quantized model's inputs to the float layer's outputs (GPTAQ). Everything runs batched over a
stack of independent weights [B, N, K] with their own Hessians [B, K, K] (a layer's experts), in fp32, on the
Hessians' device. The output is a plain NVFP4 tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor, _per_leading_index, encode_blocks, rtn_block_scale
from fp4kit.quantize.calibrate import LayerStatistics, LoadedLayer
from fp4kit.quantize.plan import QuantGroup, read_group_weights
from fp4kit.quantize.scale_search import (
    GPTQ_CODE_OFFSETS,
    ScaleSearch,
    group_global_mul,
    quantize_mse,
    round_e2m1_magnitude_,
    search_block_scales,
)

# stacked fp32 weights + Hessians per batched GPTQ call: bounds the pass's memory on wide layers (128 experts);
# on a GPU larger stacks mean fewer launches per column
MAX_BATCH_BYTES = {"cpu": 1 << 30, "cuda": 1 << 34}


@dataclass
class GptqOptions:
    damp: float = 0.01  # added to H's diagonal, as a fraction of its mean
    block_size: int = 128  # columns per lazy-update block (a multiple of 16)
    mse_scales: bool = True  # block scales by the diag-H-weighted mse search, else round-to-nearest
    min_tokens: int = 32  # routed experts that saw fewer calibration tokens fall back to mse
    search: ScaleSearch | None = None  # the range search for the mse block scales (and the fallbacks' mse)
    # asymmetric calibration (GPTAQ): weight alpha of the float-target correction, 0 = plain GPTQ (see float_target)
    asymmetric: float = 0.0
    # static-group activation order: columns by descending diag H, block scales fixed up front (_static_act_order)
    act_order: bool = False


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 [B, K, K] after GPTQ's conditioning: a channel that saw no input (zero
    diagonal) gets a unit diagonal (its column is rounded, its error goes nowhere), then damp x mean diag is added.
    Where the factorization still fails, the damping grows tenfold, up to three times."""
    h = hessian.to(torch.float32).clone()
    diagonal = h.diagonal(dim1=-2, dim2=-1)
    diagonal[diagonal == 0] = 1.0
    mean = diagonal.mean(dim=-1, keepdim=True)
    for attempt in range(4):
        damped = h.clone()
        damped.diagonal(dim1=-2, dim2=-1).add_(mean * damp * 10**attempt)
        lower, info = torch.linalg.cholesky_ex(damped)
        if not bool((info != 0).any()):
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if not bool((info != 0).any()):
                return upper
    raise Fp4kitError("GPTQ: a Hessian is not positive definite even with 1000x the damping; raise --gptq-damp")


def float_target(weight: torch.Tensor, cross: torch.Tensor, upper: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weights GPTQ should approximate so that the quantized layer, reading the quantized model's inputs X
    (rows x), matches the float layer on the float model's inputs X_f: min_Q sum ||x_f W^T - x Q^T||^2 =
    const + tr((W' - Q) H (W' - Q)^T) with H = X^T X and W' = W X_f^T X H^-1 = W + W D H^-1, D = (X_f - X)^T X
    (``cross``, [B, K, K]). H^-1 is the damped one GPTQ uses (``upper``: its Cholesky factor, H^-1 = U^T U), i.e. a
    ridge solution; ``alpha`` scales the correction (1: the least-squares target; GPTAQ's reference code uses 0.25).
    weight [B, N, K] fp32."""
    correction = torch.bmm(torch.bmm(torch.bmm(weight, cross.to(weight)), upper.transpose(-1, -2)), upper)
    return weight + alpha * correction


def _lazy_block(
    w1: torch.Tensor, u1: torch.Tensor, importance: torch.Tensor, global_f32: torch.Tensor, mse_scales: bool,
    search: ScaleSearch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One lazy block of the pass, columns [W] of weights w1 [B, N, W] (updated in place) against its diagonal
    block u1 [B, W, W] of the factor: the scaled rounding errors [B, N, W], each column as the pass rounded it
    [B, N, W] (encoding it gives the codes used) and the fp32 block scales [B, N, W/16]. Shapes are static and no
    value leaves the device, so a CUDA graph can replay it."""
    batch, rows, width = w1.shape
    global_rows = global_f32.reshape(batch, 1)
    errors = torch.empty_like(w1)
    compensated = torch.empty_like(w1)
    scales = torch.empty((batch, rows, width // BLOCK), dtype=torch.float32, device=w1.device)
    for g in range(0, width, BLOCK):
        block = w1[:, :, g : g + BLOCK]
        amax = block.abs().amax(dim=-1, keepdim=True)  # finite: checked up front
        if mse_scales:
            scale = search_block_scales(block, global_f32, importance[:, g : g + BLOCK], amax, GPTQ_CODE_OFFSETS,
                                        search)
        else:
            scale = rtn_block_scale(amax, _per_leading_index(global_f32, 3))
        scale = scale.squeeze(-1)  # [B, N]
        scales[:, :, g // BLOCK] = scale
        divisor = scale / global_rows
        group_end = g + BLOCK
        for j in range(g, group_end):
            column = w1[:, :, j]
            compensated[:, :, j] = column
            error = _column_error(column, divisor, u1[:, j, j])
            errors[:, :, j] = error
            # the rest of this 16-block absorbs the error at once (row-independent rank-1 update) ...
            if j + 1 < group_end:
                w1[:, :, j + 1 : group_end] -= error.unsqueeze(-1) * u1[:, j, j + 1 : group_end].unsqueeze(1)
        # ... the rest of the lazy block once per 16-block (the columns after it: the caller, once per lazy block)
        if group_end < width:
            w1[:, :, group_end:] -= torch.bmm(errors[:, :, g:group_end], u1[:, g:group_end, group_end:])
    return errors, compensated, scales


def _column_error(column: torch.Tensor, divisor: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """GPTQ's step for one column [B, N]: round it to FP4 under its block divisor and return the rounding error over
    the Cholesky factor's diagonal entry ``pivot`` [B], which the later columns absorb."""
    q = round_e2m1_magnitude_(column.abs() / divisor).mul_(divisor).copysign_(column)
    return (column - q) / pivot.unsqueeze(-1)


def _static_act_order(w: torch.Tensor, hessian: torch.Tensor, importance: torch.Tensor, global_f32: torch.Tensor,
                      options: GptqOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ over the columns of w [B, N, K] in descending diag H order (act-order), with every 16-block's scale
    chosen up front from w in its natural order (static groups), so the output is a plain NVFP4 tensor: no
    permutation is stored, the order only changes which columns absorb which errors. Returns the columns as the pass
    rounded them (natural order) and the fp32 block scales [B, N, K/16]."""
    batch, rows, k = w.shape
    if options.mse_scales:
        scales = search_block_scales(w, global_f32, importance, None, GPTQ_CODE_OFFSETS, options.search)
    else:
        scales = rtn_block_scale(w.unflatten(-1, (-1, BLOCK)).abs().amax(dim=-1), _per_leading_index(global_f32, 3))
    divisors = (scales / global_f32.reshape(batch, 1, 1)).repeat_interleave(BLOCK, dim=-1)
    order = torch.argsort(importance, dim=-1, descending=True, stable=True)
    by_column = order[:, None, :].expand(batch, rows, k)
    w = w.gather(-1, by_column)
    divisors = divisors.gather(-1, by_column)
    hessian = hessian.to(torch.float32).gather(1, order[:, :, None].expand(batch, k, k))
    upper = _inverse_hessian_factor(hessian.gather(2, order[:, None, :].expand(batch, k, k)), options.damp)
    compensated = torch.empty_like(w)
    for start in range(0, k, options.block_size):
        end = min(start + options.block_size, k)
        w1 = w[:, :, start:end]
        errors = torch.empty_like(w1)
        for j in range(end - start):
            c = start + j
            column = w1[:, :, j]
            compensated[:, :, c] = column
            error = _column_error(column, divisors[:, :, c], upper[:, c, c])
            errors[:, :, j] = error
            if c + 1 < end:
                w1[:, :, j + 1 :] -= error.unsqueeze(-1) * upper[:, c, c + 1 : end].unsqueeze(1)
        if end < k:
            w[:, :, end:] -= torch.bmm(errors, upper[:, start:end, end:])
    natural = torch.empty_like(compensated).scatter_(-1, by_column, compensated)
    return natural, scales


@dataclass
class _Graphed:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # w1, u1, importance, global scales: copied in before each replay
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LazyBlocks:
    """Runs _lazy_block; on a GPU each shape's second call captures it as a CUDA graph that later calls replay.
    A lazy block is ~1000 small kernels, so eager the pass is bound by their launches; the replay runs the same
    kernels (same bytes) without the host in the loop. The first call runs eagerly (it also warms up the kernels
    and the allocator before capture)."""

    def __init__(self, graphs: bool = True) -> None:
        self.graphs = graphs
        self._graphs: dict[tuple, _Graphed] = {}
        self._seen: set[tuple] = set()

    def __call__(self, w1: torch.Tensor, u1: torch.Tensor, importance: torch.Tensor, global_f32: torch.Tensor,
                 mse_scales: bool, search: ScaleSearch | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (tuple(w1.shape), w1.device, mse_scales, search)
        if not self.graphs or w1.device.type != "cuda" or key not in self._seen:
            self._seen.add(key)
            return _lazy_block(w1.clone(), u1, importance, global_f32, mse_scales, search)
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = self._graphs[key] = self._capture(w1, u1, importance, global_f32, mse_scales, search)
        for static, value in zip(graphed.inputs, (w1, u1, importance, global_f32), strict=True):
            static.copy_(value)
        graphed.graph.replay()
        return graphed.outputs

    @staticmethod
    def _capture(w1: torch.Tensor, u1: torch.Tensor, importance: torch.Tensor, global_f32: torch.Tensor,
                 mse_scales: bool, search: ScaleSearch | None) -> _Graphed:
        inputs = tuple(t.clone() for t in (w1, u1, importance, global_f32))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = _lazy_block(inputs[0].clone(), inputs[1], inputs[2], inputs[3], mse_scales, search)
        return _Graphed(graph, inputs, outputs)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    global_mul: torch.Tensor,
    options: GptqOptions | None = None,
    blocks: LazyBlocks | None = None,
    cross: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """GPTQ-quantize a stack weight [B, N, K] with Hessians [B, K, K] and fp32 multiplier global scales [B].
    ``blocks``: the lazy-block runner to reuse (its CUDA graphs) across calls with the same shapes. ``cross``
    [B, K, K] with ``options.asymmetric`` > 0: quantize toward the float target (float_target) instead of W."""
    options = options or GptqOptions()
    blocks = blocks or LazyBlocks()
    if options.block_size % BLOCK:
        raise Fp4kitError(f"GPTQ block size {options.block_size} is not a multiple of {BLOCK}")
    device = hessian.device
    w = weight.to(device=device, dtype=torch.float32).clone()
    batch, rows, k = w.shape
    if k % BLOCK:
        raise ValueError(f"last dimension {k} is not a multiple of {BLOCK}")
    if not torch.isfinite(w).all():
        raise Fp4kitError("NaN or Inf in a weight to be quantized")
    importance = hessian.diagonal(dim1=-2, dim2=-1).to(torch.float32).clamp(min=0)
    upper = _inverse_hessian_factor(hessian, options.damp)
    if cross is not None and options.asymmetric > 0:
        w = float_target(w, cross.to(device=device, dtype=torch.float32), upper, options.asymmetric)
        if not torch.isfinite(w).all():
            raise Fp4kitError("GPTQ: the asymmetric target is not finite; raise --gptq-damp")
    global_f32 = global_mul.to(device=device, dtype=torch.float32)
    if options.act_order:
        compensated, scales = _static_act_order(w, hessian, importance, global_f32, options)
        divisor = scales / global_f32.reshape(batch, 1, 1)
        packed = encode_blocks(compensated.unflatten(-1, (-1, BLOCK)), divisor)
        return NVFP4Tensor(packed.cpu(), scales.to(torch.float8_e4m3fn).cpu(), (1.0 / global_f32.double()).cpu())
    compensated = torch.empty_like(w)
    scales = torch.empty((batch, rows, k // BLOCK), dtype=torch.float32, device=device)
    for start in range(0, k, options.block_size):
        end = min(start + options.block_size, k)
        errors, block_compensated, block_scales = blocks(
            w[:, :, start:end], upper[:, start:end, start:end], importance[:, start:end], global_f32,
            options.mse_scales, options.search)
        compensated[:, :, start:end] = block_compensated
        scales[:, :, start // BLOCK : end // BLOCK] = block_scales
        if end < k:
            w[:, :, end:] -= torch.bmm(errors, upper[:, start:end, end:])
    divisor = scales / global_f32.reshape(batch, 1, 1)
    packed = encode_blocks(compensated.unflatten(-1, (-1, BLOCK)), divisor)
    return NVFP4Tensor(packed.cpu(), scales.to(torch.float8_e4m3fn).cpu(), (1.0 / global_f32.double()).cpu())


def gptq_objective(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """tr((W - Q) H (W - Q)^T) for [N, K] weights: the layer-output squared error GPTQ minimizes."""
    delta = (weight.to(torch.float64) - quantized.to(torch.float64))
    return torch.einsum("nk,kl,nl->", delta, hessian.to(torch.float64), delta)


@dataclass
class _Unit:
    """Rows of one group that read one input: quantized together against one Hessian."""

    group: int  # index into the layer's groups
    members: list[int]  # member indices in the group
    weight: torch.Tensor  # [rows, K], the members' rows concatenated
    global_mul: torch.Tensor  # fp32 0-d, the group's
    hessian: torch.Tensor | None  # [K, K] (gptq) or [K] diag (mse); None: no statistics
    tokens: int
    cross: torch.Tensor | None = None  # [K, K] (asymmetric calibration: LayerStatistics.cross)


@dataclass
class LayerQuantizer:
    """Quantizes the groups of each layer as the calibration pass reaches it
    (fp4kit.quantize.calibrate.calibrate_quantized) with ``method`` gptq or mse (importance-weighted by diag H), hands
    each group's NVFP4 tensors to ``emit``, and returns the dequantized weights for the propagating forward. Routed
    experts with fewer than ``min_tokens`` calibration tokens, and modules the pass saw no input for, fall back to mse
    (weighted when any token came)."""

    reader: CheckpointReader
    groups_by_layer: dict[int, list[QuantGroup]]
    method: str
    emit: Callable[[QuantGroup, list[NVFP4Tensor]], None]
    device: torch.device
    exact_fp32_global_scale: bool = False
    gptq: GptqOptions = field(default_factory=GptqOptions)
    native: bool = True  # bf16 weights on the CPU through the C mse loop (same bytes)
    fallbacks: list[str] = field(default_factory=list)  # modules that fell back to mse
    lazy_blocks: LazyBlocks = field(default_factory=LazyBlocks)  # CUDA graphs reused from layer to layer
    done: set[int] = field(default_factory=set)  # id() of the groups quantized

    def __call__(self, index: int, layer: LoadedLayer, stats: LayerStatistics) -> dict[str, torch.Tensor]:
        groups = [g for g in self.groups_by_layer.get(index, [])
                  if all(c.linear.module.startswith(stats.layer_prefix) for c in g.members)]
        units: list[_Unit] = []
        weights_of: list[list[torch.Tensor]] = []
        for g, group in enumerate(groups):
            weights = self._group_weights(group, layer)
            weights_of.append(weights)
            global_mul = group_global_mul(weights, self.exact_fp32_global_scale)
            units.extend(self._units(g, group, weights, global_mul, stats))
        results: dict[tuple[int, int], NVFP4Tensor] = {}  # (group, first member) -> the unit's tensor
        gptq_units, mse_units = [], []
        for unit in units:
            names = [groups[unit.group].members[m].linear.module for m in unit.members]
            usable = unit.hessian is not None and unit.tokens >= self._min_tokens(groups[unit.group], unit)
            if self.method == "gptq" and usable and unit.hessian.dim() == 2:
                gptq_units.append(unit)
            else:
                if self.method == "gptq" or not usable:
                    self.fallbacks.extend(names)
                mse_units.append(unit)
        for batch in _batches(gptq_units, MAX_BATCH_BYTES.get(self.device.type, 1 << 30)):
            cross = None
            if self.gptq.asymmetric > 0 and all(u.cross is not None for u in batch):
                cross = torch.stack([u.cross for u in batch])
            stacked = gptq_quantize(torch.stack([u.weight for u in batch]), torch.stack([u.hessian for u in batch]),
                                    torch.stack([u.global_mul for u in batch]), self.gptq, self.lazy_blocks, cross)
            for b, unit in enumerate(batch):
                results[(unit.group, unit.members[0])] = NVFP4Tensor(stacked.packed[b], stacked.block_scale[b],
                                                                     stacked.global_scale_div[b])
        for unit in mse_units:
            importance = None
            if unit.hessian is not None and unit.tokens > 0:
                importance = unit.hessian.diagonal() if unit.hessian.dim() == 2 else unit.hessian
            q = quantize_mse(unit.weight.to(self.device), unit.global_mul, importance, self.native, self.gptq.search)
            results[(unit.group, unit.members[0])] = NVFP4Tensor(q.packed.cpu(), q.block_scale.cpu(),
                                                                 q.global_scale_div)
        replacements: dict[str, torch.Tensor] = {}
        for g, group in enumerate(groups):
            quantized = self._split(g, group, weights_of[g], units, results)
            self.emit(group, quantized)
            self.done.add(id(group))
            for c, q in zip(group.members, quantized, strict=True):
                # dequantized where the layer runs: on a GPU the host neither computes nor holds fp32 weights
                on_device = NVFP4Tensor(q.packed.to(self.device), q.block_scale.to(self.device), q.global_scale_div)
                replacements[c.linear.module] = on_device.dequantize()
        return replacements

    def _group_weights(self, group: QuantGroup, layer: LoadedLayer) -> list[torch.Tensor]:
        """The group's [N, K] weights on the quantizer's device: the loaded layer's own where it holds them exactly
        (LoadedLayer.source_weight; already on the device), so the layer is not read from the checkpoint a second
        time; else read (and dequantized) again, as the plan says."""
        held = [layer.source_weight(c.linear.module, c.linear.source, self.reader.info(c.linear.source.tensor))
                for c in group.members]
        if all(w is not None for w in held):
            return [w.contiguous() for w in held]  # type: ignore[union-attr]
        weights = read_group_weights(self.reader, group)
        if self.device.type != "cpu":  # concatenated, stacked and searched there: the host holds one group
            weights = [w.to(self.device) for w in weights]
        return weights

    def _min_tokens(self, group: QuantGroup, unit: _Unit) -> int:
        return self.gptq.min_tokens if group.members[unit.members[0]].expert is not None else 1

    def _units(self, g: int, group: QuantGroup, weights: list[torch.Tensor], global_mul: torch.Tensor,
               stats: LayerStatistics) -> list[_Unit]:
        """Consecutive members that share one statistic (q/k/v, an expert's gate/up) form one unit."""
        units: list[_Unit] = []
        for m, (c, w) in enumerate(zip(group.members, weights, strict=True)):
            hessian = stats.hessians.get(c.linear.module)
            if units and hessian is not None and units[-1].hessian is hessian:
                units[-1].members.append(m)
                units[-1].weight = torch.cat([units[-1].weight, w])
                continue
            units.append(_Unit(g, [m], w, global_mul, hessian, stats.tokens.get(c.linear.module, 0),
                               stats.cross.get(c.linear.module)))
        return units

    @staticmethod
    def _split(g: int, group: QuantGroup, weights: list[torch.Tensor], units: list[_Unit],
               results: dict[tuple[int, int], NVFP4Tensor]) -> list[NVFP4Tensor]:
        quantized: list[NVFP4Tensor] = []
        for unit in (u for u in units if u.group == g):
            q = results[(g, unit.members[0])]
            sizes = [weights[m].shape[0] for m in unit.members]
            for packed, scale in zip(q.packed.split(sizes), q.block_scale.split(sizes), strict=True):
                quantized.append(NVFP4Tensor(packed, scale, q.global_scale_div))
        return quantized


def _batches(units: list[_Unit], max_bytes: int) -> list[list[_Unit]]:
    """Units of one weight shape, stacked up to ``max_bytes`` of fp32 weights and Hessians."""
    by_shape: dict[tuple[int, ...], list[_Unit]] = {}
    for unit in units:
        by_shape.setdefault(tuple(unit.weight.shape), []).append(unit)
    batches = []
    for shape, same in by_shape.items():
        per_unit = 4 * (shape[0] * shape[1] * 2 + shape[1] * shape[1] * 3)
        size = max(1, max_bytes // per_unit)
        batches.extend(same[i : i + size] for i in range(0, len(same), size))
    return batches
