"""Activation statistics for W4A4 NVFP4, one decoder layer in memory at a time (README.md, `fp4kit quantize`).

The pass runs the layer-streaming text model (fp4kit/quantize/layer_model.py): embeddings and every layer's
arguments from one forward of the meta-device model, then each decoder layer loaded from SRC, run over every
calibration hidden state through transformers' own decoder-layer class, and dropped.

Statistics per layer:
- every ``nn.Linear``: amax of its input in that forward (attention, dense MLPs, shared experts);
- every routed expert, over *all* tokens of the layer (llm-compressor's ``moe_calibrate_all_experts`` semantics):
  gate/up input amax = amax of the MoE block's input (post-attention-norm hidden states); for Llama-4, whose
  router score multiplies the expert input, token t reaches expert e as ``h_t * sigmoid(logit_te)``, what it
  would receive had it been routed there. down_proj input amax = amax of ``act(gate) * up`` of those inputs;
- routing counts under the real top-k, read from the router transformers ran.
The hidden states passed on are the layer's own output, i.e. the real router and top-k.

``calibrate_quantized`` is the pass of the calibrated quantization methods (gptq, activation-weighted mse): per
layer it collects input second moments (per routed expert from the tokens routed to it), lets the caller quantize
the layer, and passes on the outputs of the quantized layer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.base import Family, SourceRef
from fp4kit.families.grammar import ExpertGrammar
from fp4kit.families.moe_modules import MoEModules
from fp4kit.io import memory
from fp4kit.io.checkpoint import CheckpointReader, TensorInfo, read_config
from fp4kit.io.sources import dequantized_view
from fp4kit.nvfp4 import fake_quantize_activation
from fp4kit.progress import step
from fp4kit.quantize.kv_cache import KvAmaxRecorder
from fp4kit.quantize.layer_model import LayerArguments, TextModel, checkpoint_dtype, layer_inputs, text_model

LayerCallback = Callable[[int, list[torch.Tensor]], None]

# --dtype: the calibration forward's compute dtype; auto picks it from the checkpoint and the hardware (compute_dtype)
COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
# oneDNN's ISA caps (its documented ONEDNN_MAX_CPU_ISA, formerly DNNL_MAX_CPU_ISA) below AVX512_CORE_BF16: no bf16
# instructions for its GEMMs, whatever the CPU has
_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls on ``device`` run at least about as fast as fp32 ones: on CUDA, and on a CPU with bf16
    instructions (AVX512-BF16 or AMX) that torch's oneDNN GEMMs may use. Without them torch's bf16 GEMM is an
    emulation or a scalar fallback, several to tens of times slower than fp32 (docs/quality_methods.md, Speed)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    isa_cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    try:
        units = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # False where oneDNN is capped below AVX512
    except (AttributeError, RuntimeError):  # a torch build without these probes (or without oneDNN)
        return False
    return units and onednn and isa_cap not in _ISAS_WITHOUT_BF16


def compute_dtype(choice: str, device: torch.device, config: dict) -> torch.dtype:
    """The calibration forward's dtype for ``--dtype`` ``choice``: bf16 or fp32 as asked; auto: the checkpoint's
    dtype (config.json) where ``device`` computes it fast (fast_bf16), else fp32."""
    if choice not in COMPUTE_DTYPES:
        raise Fp4kitError(f"unknown --dtype {choice!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    chosen = COMPUTE_DTYPES[choice]
    if chosen is not None:
        return chosen
    stored = checkpoint_dtype(config)
    if stored == torch.float32 or device.type == "cuda" or (stored == torch.bfloat16 and fast_bf16(device)):
        return stored
    return torch.float32


@dataclass
class CalibrationResult:
    input_amax: dict[str, float] = field(default_factory=dict)  # output module name -> amax of its input
    routing_counts: dict[int, list[int]] = field(default_factory=dict)  # layer -> tokens routed to each expert
    # amax of the keys and values each attention module's KV cache holds (fp4kit.quantize.kv_cache.kv_name)
    kv_amax: dict[str, float] = field(default_factory=dict)


class _LayerHooks:
    """Hooks on one loaded decoder layer: ``_linear_hook(name)`` before every wanted Linear, and per MoE block, once its
    router has run and the block has returned, ``_on_moe(experts path, experts, hidden [T, H], logits, top ids)``.
    ``close`` removes them."""

    def __init__(self, text: TextModel, layer: nn.Module, index: int, modules: set[str] | None):
        self.layer_prefix = f"{text.prefix}layers.{index}."
        self.scales_input = text.scales_input
        self.moe, self.grammar = text.moe, text.grammar
        self.modules = modules
        self.router_output: tuple | None = None
        self.handles = []
        self.moe_experts: list[nn.Module] = []
        for name, module in layer.named_modules():
            path = self.layer_prefix + self.moe.checkpoint_name(name)
            if isinstance(module, nn.Linear) and self._wanted(path):
                self.handles.append(module.register_forward_pre_hook(self._linear_hook(path)))
            experts = self.moe.experts(module)
            if experts is not None:
                self.moe_experts.append(experts)
                self.handles.append(self.moe.router(module).register_forward_hook(self._router_hook))
                self.handles.append(module.register_forward_hook(self._moe_hook(path, experts)))

    def _wanted(self, name: str) -> bool:
        return self.modules is None or name in self.modules

    def _linear_hook(self, name: str) -> Callable:
        raise NotImplementedError

    def _on_moe(self, path: str, experts: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                top_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def _router_hook(self, module: nn.Module, args: tuple, output: tuple) -> None:
        self.router_output = output

    def _moe_hook(self, block_name: str, experts: nn.Module):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            hidden = args[0].reshape(-1, args[0].shape[-1])
            assert self.router_output is not None
            logits, top_ids = self.moe.router_choice(self.router_output, module)
            self._on_moe(f"{block_name}.{self.moe.experts_attribute}", experts, hidden, logits, top_ids)

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _AmaxRecorder(_LayerHooks):
    """Running input amax of every Linear and routed expert of one layer, kept on the device until ``flush``."""

    def __init__(self, text: TextModel, layer: nn.Module, index: int, modules: set[str] | None):
        self.amax: dict[str, torch.Tensor] = {}
        self.counts: torch.Tensor | None = None
        super().__init__(text, layer, index, modules)
        self.num_experts = self.moe.num_experts(self.moe_experts[-1]) if self.moe_experts else None

    def _update(self, name: str, amax: torch.Tensor) -> None:
        amax = amax.detach().float()
        self.amax[name] = torch.maximum(self.amax[name], amax) if name in self.amax else amax

    def _linear_hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self._update(name, args[0].abs().amax())

        return hook

    def _on_moe(self, path: str, experts: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                top_ids: torch.Tensor) -> None:
        counts = torch.bincount(top_ids.reshape(-1), minlength=logits.shape[-1])
        self.counts = counts if self.counts is None else self.counts + counts
        self._expert_amax(path, experts, hidden, logits)

    @torch.no_grad()
    def _expert_amax(self, path: str, experts: nn.Module, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        num_experts = self.moe.num_experts(experts)
        names = [self.grammar.expert_linears(path, e) for e in range(num_experts)]
        if self.modules is not None and not any(n in self.modules for triple in names for n in triple):
            return
        hidden_amax = hidden.abs().amax()
        product = _Product(hidden, self.moe.w13(experts, 0))
        for e, (gate_name, up_name, down_name) in enumerate(names):
            weight = self.moe.w13(experts, e)
            if self.scales_input:  # what Llama4TextMoe feeds expert e: h * sigmoid(logit), cast like its router
                x = hidden * torch.sigmoid(logits[:, e : e + 1].float()).to(hidden.dtype)
                x_amax = x.abs().amax()
            else:
                x, x_amax = hidden, hidden_amax
            gate, up = product(x, weight).chunk(2, dim=-1)
            self._update(gate_name, x_amax)
            self._update(up_name, x_amax)
            self._update(down_name, self.moe.gated(experts, e, gate, up).abs().amax())

    def flush(self, result: CalibrationResult, index: int) -> None:
        self.close()
        for name, amax in self.amax.items():
            if self._wanted(name):
                result.input_amax[name] = float(amax)
        if self.counts is not None:
            result.routing_counts[index] = [int(c) for c in self.counts.cpu()]
        elif self.num_experts is not None:  # a rank given no batch (fp4kit.quantize.distributed): none routed here
            result.routing_counts[index] = [0] * self.num_experts


class _Product:
    """x @ weight.T in x's dtype, for one layer's experts in turn (one shape). Half-precision matmuls on CPUs without
    bf16 units are several times slower than fp32 ones: there, multiply in fp32 and round the product once, as a bf16
    GEMM with fp32 accumulation does, in fp32 buffers reused from expert to expert, so that the loop allocates and
    frees nothing of a weight's size (freed buffers of a few MB stay resident in glibc's heaps)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor):
        self.fp32 = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
        if self.fp32:
            self.x, self.x_source = torch.empty(x.shape, dtype=torch.float32), None
            self.weight = torch.empty(weight.shape, dtype=torch.float32)
            self.out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
            self.rounded = torch.empty(self.out.shape, dtype=x.dtype)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.fp32:
            return nn.functional.linear(x, weight)
        if x is not self.x_source:  # the same hidden states for every expert but Llama-4's
            self.x.copy_(x)
            self.x_source = x
        self.weight.copy_(weight)
        torch.mm(self.x, self.weight.t(), out=self.out)
        return self.rounded.copy_(self.out)


@contextlib.contextmanager
def _layer_pass(src: Path, token_ids: torch.Tensor, device: str, batch_size: int, dtype: torch.dtype | None,
                batch_share: tuple[int, int], config: dict | None, family: Family | None) -> Iterator[tuple]:
    """What a layer-streaming pass over SRC starts from: (reader, text model, dtype, device, embedded hidden states per
    batch, per batch shape the arguments of every layer), after checking the token ids against the model.
    ``config`` / ``family``: SRC's config.json and family, when the caller has them (read and detected otherwise)."""
    src = Path(src)
    _check_calibration_arguments(token_ids, batch_size)
    config = read_config(src) if config is None else config
    family = detect(config) if family is None else family
    torch_device = torch.device(device)
    dtype = dtype or checkpoint_dtype(config)
    memory.bound_onednn_kernel_cache()
    # without it, freed buffers of a few MB pile up in glibc's heaps during a layer, differently from run to run
    with CheckpointReader(src) as stored, memory.large_frees_returned_to_os():
        # a quantized source's Linears (fp4kit.io.sources) come dequantized: fp32 products cast to the layer's dtype
        reader = dequantized_view(stored, config, dtype, torch_device)
        text = text_model(reader, config, family, dtype, torch_device, src)
        vocab_size = text.model.config.vocab_size
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise Fp4kitError(f"calibration token ids must lie in [0, vocab_size {vocab_size}), got "
                              f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        hidden_batches, layer_args = layer_inputs(text, token_ids.to(torch_device), batch_size, batch_share)
        yield reader, text, dtype, torch_device, hidden_batches, layer_args


@torch.inference_mode()
def calibrate(
    src: Path,
    token_ids: torch.Tensor,
    device: str = "cpu",
    batch_size: int = 8,
    modules: set[str] | None = None,
    dtype: torch.dtype | None = None,
    on_layer: LayerCallback | None = None,
    batch_share: tuple[int, int] = (0, 1),
    progress: Callable[[int, int], None] | None = None,
    config: dict | None = None,
    family: Family | None = None,
    kv_attention: set[str] | None = None,
) -> CalibrationResult:
    """Input amax of every Linear (``modules``: only those names) and routing counts, streaming SRC by layer; the
    amax of the keys and values of the attention modules ``kv_attention`` names (fp4kit.quantize.kv_cache).

    ``token_ids`` int64 [S, L]; ``dtype`` defaults to the checkpoint's (config.json), bf16 if it names none.
    ``on_layer(index, hidden_batches)`` sees each layer's output hidden states (tests compare them).
    ``batch_share`` (rank, world): run only batches b with b % world == rank, for fp4kit.quantize.distributed to
    combine. ``progress(done, total)`` counts batch forwards, layers x batches in all (called with 0 before the first);
    a Reporter also logs a line per layer (fp4kit.progress.step).
    ``config`` / ``family``: SRC's config.json and family when the caller has them.
    """
    result = CalibrationResult()
    with _layer_pass(src, token_ids, device, batch_size, dtype, batch_share, config, family) as (
            reader, text, dtype, torch_device, hidden_batches, layer_args):
        total, done = len(text.layers) * len(hidden_batches), 0
        if progress:
            progress(0, total)
        for index in range(len(text.layers)):
            layer = text.load_layer(reader, index, dtype, torch_device)
            recorder = _AmaxRecorder(text, layer, index, modules)
            kv = _kv_recorder(text, layer, index, kv_attention)
            for b, hidden in enumerate(hidden_batches):
                args, kwargs = layer_args[tuple(hidden.shape)][index]
                hidden_batches[b] = layer(hidden, *args, **kwargs)
                done += 1
                if progress:
                    progress(done, total)
            recorder.flush(result, index)
            if kv is not None:
                kv.flush(result.kv_amax)
            text.drop_layer(index)
            del layer, recorder
            memory.trim_freed_memory()
            step(progress, f"layer {index + 1}/{len(text.layers)}")
            if on_layer is not None:
                on_layer(index, hidden_batches)
    return result


def _kv_recorder(text: TextModel, layer: nn.Module, index: int, kv_attention: set[str] | None
                 ) -> KvAmaxRecorder | None:
    if not kv_attention:
        return None
    return KvAmaxRecorder(layer, text.layer_prefix(index), text.moe.checkpoint_name, kv_attention)


def _check_calibration_arguments(token_ids: torch.Tensor, batch_size: int) -> None:
    if token_ids.dim() != 2 or token_ids.dtype != torch.int64 or token_ids.numel() == 0:
        raise Fp4kitError(f"calibration token ids must be a non-empty int64 [samples, seq_len] tensor, got "
                          f"{token_ids.dtype}{list(token_ids.shape)}")
    if batch_size < 1:
        raise Fp4kitError(f"--batch-size must be at least 1, got {batch_size}")


@dataclass
class LayerStatistics:
    """Second moments of every quantized Linear's input in one layer, for GPTQ and importance-weighted MSE.

    ``hessians[module]``: sum over its input rows x of x^T x in fp32 ([K, K]; its diagonal [K] alone when only the
    diagonal was asked for). Modules reading the same input (q/k/v, an expert's gate/up) share one tensor object.
    Routed experts see only the tokens routed to them (Llama-4: scaled by the router score as its MoE does).
    ``tokens[module]``: the number of input rows.
    ``cross[module]`` (asymmetric calibration only): sum over the same rows of (x_float - x)^T x [K, K], x_float the
    row the float model's layer reads at that token (from the float model's hidden states), shared like hessians.
    """

    layer_prefix: str = ""  # checkpoint name prefix of the layer's modules, e.g. "model.layers.3."
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    cross: dict[str, torch.Tensor] = field(default_factory=dict)


def _no_routed_output(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.zeros_like(hidden_states)


class _SecondMomentRecorder(_LayerHooks):
    """Accumulates LayerStatistics over the batches of one layer's forward (hooks removed and the routed experts'
    computation restored by ``close``). The layer's output during that forward is not its real output."""

    def __init__(self, text: TextModel, layer: nn.Module, index: int, modules: set[str] | None, full: bool):
        super().__init__(text, layer, index, modules)
        self.full = full
        self.stats = LayerStatistics(self.layer_prefix)
        self.last_input: tuple[torch.Tensor, str] | None = None  # the input of the last hooked Linear
        self.stubbed: list[nn.Module] = []  # experts whose forward returns zeros until close
        # asymmetric calibration: while ``capturing``, the hooks keep each Linear's input (and each MoE block's)
        # of the float stream's batch by name, which the next (quantized stream's) batch pairs row by row
        self.capturing = False
        self.float_inputs: dict[str, torch.Tensor] | None = None
        # W4A4 GPTQ against fake-quantized inputs: module -> its static input divisor
        self.activation_divisors: dict[str, torch.Tensor] | None = None
        self._skip_routed_experts()

    def _skip_routed_experts(self) -> None:
        """The statistics forward's output is dropped (the quantized layer's forward gives the next layer its inputs)
        and the hooks compute each expert's products themselves, so transformers' routed-expert computation is
        skipped."""
        for experts in self.moe_experts:
            experts.forward = _no_routed_output
            self.stubbed.append(experts)

    @contextlib.contextmanager
    def float_batch(self) -> Iterator[dict[str, torch.Tensor]]:
        """Within: forwards run the layer's real routed experts and only capture inputs (the float stream's)."""
        for experts in self.stubbed:
            del experts.forward
        self.capturing, self.float_inputs = True, {}
        try:
            yield self.float_inputs
        finally:
            self.capturing = False
            for experts in self.stubbed:
                experts.forward = _no_routed_output

    def _add(self, names: list[str], x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        """Add rows x [T, K] to the statistics that ``names`` share (created on first use); ``x_float``: the float
        stream's rows at the same tokens (asymmetric calibration)."""
        x = x.reshape(-1, x.shape[-1]).float()
        if self.activation_divisors is not None and names[0] in self.activation_divisors and self.full:
            x = fake_quantize_activation(x, self.activation_divisors[names[0]])
        stats = self.stats
        if names[0] not in stats.hessians:
            k = x.shape[-1]
            shape = (k, k) if self.full else (k,)
            shared = torch.zeros(shape, dtype=torch.float32, device=x.device)
            for n in names:
                stats.hessians[n], stats.tokens[n] = shared, 0
            if self.float_inputs is not None and self.full:
                cross = torch.zeros(shape, dtype=torch.float32, device=x.device)
                for n in names:
                    stats.cross[n] = cross
        hessian = stats.hessians[names[0]]
        if self.full:
            hessian.addmm_(x.t(), x)
            if x_float is not None and names[0] in stats.cross:
                delta = x_float.reshape(x.shape).float() - x
                stats.cross[names[0]].addmm_(delta.t(), x)
        else:
            hessian.add_(x.square().sum(dim=0))
        for n in names:
            stats.tokens[n] += x.shape[0]

    def _linear_hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if self.capturing:
                self.float_inputs[name] = x  # type: ignore[index]
                return
            last = self.last_input
            self.last_input = (x, name)
            if last is not None and last[0] is x:  # q/k/v read one tensor: one shared statistic
                hessians = self.stats.hessians
                if name not in hessians:
                    hessians[name], self.stats.tokens[name] = hessians[last[1]], 0
                    if last[1] in self.stats.cross:
                        self.stats.cross[name] = self.stats.cross[last[1]]
                if hessians[name] is hessians[last[1]]:
                    self.stats.tokens[name] += x.reshape(-1, x.shape[-1]).shape[0]
                    return
            self._add([name], x, self.float_inputs.get(name) if self.float_inputs else None)

        return hook

    @torch.no_grad()
    def _on_moe(self, path: str, experts: nn.Module, hidden: torch.Tensor, logits: torch.Tensor,
                top_ids: torch.Tensor) -> None:
        if self.capturing:
            self.float_inputs[path] = hidden  # type: ignore[index]
            return
        hidden_float = self.float_inputs.get(path) if self.float_inputs else None
        num_experts = self.moe.num_experts(experts)
        routed = torch.zeros((num_experts, hidden.shape[0]), dtype=torch.bool, device=hidden.device)
        routed.scatter_(0, top_ids.t().to(torch.int64), True)
        # the tokens of each expert in ascending order, all experts' in one tensor: one device sync per layer
        expert_of, token_of = routed.nonzero(as_tuple=True)
        counts = torch.bincount(expert_of, minlength=num_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            tokens = token_of[start : start + count]
            start += count
            names = self.grammar.expert_linears(path, e)
            if not any(self._wanted(n) for n in names):
                continue
            if count == 0:
                for n in names:  # zero statistics: the expert is known, and known to have seen nothing
                    if n not in self.stats.hessians:
                        self._add([n], hidden[:0] if n != names[2] else hidden.new_zeros(
                            0, self.moe.intermediate(experts)))
                continue
            x = hidden[tokens]
            weight = self.moe.w13(experts, e)
            # the float stream's rows at the tokens the quantized stream routed here
            x_float = hidden_float[tokens] if hidden_float is not None else None
            if self.scales_input:  # what Llama4TextMoe feeds expert e: h * sigmoid(logit), cast like its router
                router_scale = torch.sigmoid(logits[tokens, e : e + 1].float()).to(x.dtype)
                x = x * router_scale
                x_float = x_float * router_scale if x_float is not None else None
            self._add(names[:2], x, x_float)
            gate, up = nn.functional.linear(x, weight).chunk(2, dim=-1)
            gated_float = None
            if x_float is not None:
                gate_float, up_float = nn.functional.linear(x_float, weight).chunk(2, dim=-1)
                gated_float = self.moe.gated(experts, e, gate_float, up_float)
            self._add(names[2:], self.moe.gated(experts, e, gate, up), gated_float)

    def close(self) -> LayerStatistics:  # type: ignore[override]
        super().close()
        for experts in self.stubbed:
            del experts.forward  # the class's forward again
        return self.stats


@dataclass
class LoadedLayer:
    """A decoder layer as the pass loaded it, with its Linears' [N, K] weights by checkpoint module name."""

    module: nn.Module
    prefix: str  # checkpoint name prefix of the layer's modules, e.g. "model.layers.3."
    moe: MoEModules
    grammar: ExpertGrammar
    # the layer's weights were changed after loading (an AWQ fold): they, not the checkpoint's, are to be quantized
    changed: bool = False

    def weight(self, name: str) -> torch.Tensor:
        """The [N, K] weight of module ``name`` as a view of the layer's parameters: an nn.Linear's weight, or a
        routed expert's gate rows, up rows (of transformers' fused gate-up tensor) or the down projection."""
        relative = self.moe.module_name(name[len(self.prefix):])
        head, _, leaf = relative.rpartition(".")
        experts_path, _, expert = head.rpartition(".")
        experts = self.module.get_submodule(experts_path) if expert.isdigit() and experts_path else None
        if experts is None or not self.moe.is_experts(experts):
            return self.module.get_submodule(relative).weight
        return self.moe.weight(experts, int(expert), leaf, self.grammar)

    def source_weight(self, name: str, source: SourceRef, stored: TensorInfo) -> torch.Tensor | None:
        """``weight(name)`` where it holds exactly the checkpoint's [N, K] weight of the Linear (``source``, stored as
        ``stored``), else None: the source stores it quantized or in another dtype, or it is one expert of a fused
        3-D tensor whose stored layout ([E, K, N] when ``source.transposed``) is not the module's ([E, K, N] for
        BMM experts) and whose last two dimensions are equal, so that _layer_state_dict loaded it as stored, as
        transformers' loader does."""
        weight = self.weight(name)
        if not self.changed and (source.quantized is not None or stored.dtype != weight.dtype):
            return None
        if source.expert is not None and source.transposed != self.moe.bmm and stored.shape[-1] == stored.shape[-2]:
            if self.changed:
                raise Fp4kitError(f"{name}: a square fused expert tensor whose layout the loaded layer cannot tell; "
                                  "its folded weights cannot be quantized")
            return None
        return weight

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Put [N, K] weights (by checkpoint module name) into the layer, cast to its parameters' dtype."""
        for name, weight in weights.items():
            target = self.weight(name)
            target.copy_(weight.to(target.dtype))


# index, the loaded layer, its statistics -> the weights to run the layer with from now on (module name -> [N, K])
LayerQuantizer = Callable[[int, LoadedLayer, LayerStatistics], dict[str, torch.Tensor]]
# index, the loaded layer, the text model, the layer's input hidden states per batch, the layers' arguments: changes
# the layer's weights in place before its statistics are collected (fp4kit.quantize.awq.AwqFolder)
LayerPreparer = Callable[[int, nn.Module, TextModel, list[torch.Tensor], LayerArguments], None]


@torch.inference_mode()
def calibrate_quantized(
    src: Path,
    token_ids: torch.Tensor,
    quantize_layer: LayerQuantizer,
    device: str = "cpu",
    batch_size: int = 8,
    modules: set[str] | None = None,
    full_hessians: bool = True,
    dtype: torch.dtype | None = None,
    on_layer: Callable[[int, CalibrationResult], None] | None = None,
    input_amax: bool = True,
    config: dict | None = None,
    family: Family | None = None,
    progress: Callable[[int, int], None] | None = None,
    kv_attention: set[str] | None = None,
    prepare_layer: LayerPreparer | None = None,
    float_targets: bool = False,
    activation_divisors: dict[str, torch.Tensor] | None = None,
) -> CalibrationResult:
    """The calibration pass of GPTQ and importance-weighted MSE, one layer in memory: per layer, one forward
    collects the input second moments (LayerStatistics) of ``modules``, ``quantize_layer`` quantizes the layer
    and returns its dequantized weights, which replace the layer's, and a second forward of the *quantized* layer
    gives the next layer's inputs (quantization errors propagate, as llm-compressor's sequential pipeline does) and
    the input amax and routing counts returned (for W4A4 input scales and routing statistics); ``on_layer(index,
    result)`` runs once a layer's are in ``result``. ``input_amax`` False (weight-only output): only the routing
    counts are recorded, which spares running every token through every expert. ``progress(done, total)`` counts
    decoder layers (called with 0 before the first; a Reporter also logs a line per layer). ``config`` / ``family``:
    as ``calibrate``'s. ``kv_attention``: the attention modules whose keys' and values' amax the quantized layer's
    forward records. ``prepare_layer``: changes each loaded layer before its statistics pass (AWQ's fold), and the
    quantizer then takes the layer's weights rather than the checkpoint's. ``float_targets`` (asymmetric
    calibration): a second stream of hidden states, the float model's, runs through each float layer beside the
    quantized one (one more forward per layer, memory flat in layers), and the statistics get the cross terms
    ``LayerStatistics.cross`` between the two streams' inputs.
    ``activation_divisors`` (W4A4, module -> static input divisor): the full second moments (and cross terms) are
    taken of the inputs fake-quantized as the W4A4 kernels will (per 16-block); the forwards themselves run
    unquantized."""
    result = CalibrationResult()
    with _layer_pass(src, token_ids, device, batch_size, dtype, (0, 1), config, family) as (
            reader, text, dtype, torch_device, hidden_batches, layer_args):
        float_batches = [h.clone() for h in hidden_batches] if float_targets else None
        if progress:
            progress(0, len(text.layers))
        for index in range(len(text.layers)):
            layer = text.load_layer(reader, index, dtype, torch_device)
            if prepare_layer is not None:
                prepare_layer(index, layer, text, hidden_batches, layer_args)
            recorder = _SecondMomentRecorder(text, layer, index, modules, full_hessians)
            recorder.activation_divisors = activation_divisors
            for b, hidden in enumerate(hidden_batches):
                args, kwargs = layer_args[tuple(hidden.shape)][index]
                if float_batches is not None:
                    with recorder.float_batch():
                        float_batches[b] = layer(float_batches[b], *args, **kwargs)
                layer(hidden, *args, **kwargs)
                recorder.float_inputs = None
            stats = recorder.close()
            del recorder
            loaded = LoadedLayer(layer, stats.layer_prefix, text.moe, text.grammar, changed=prepare_layer is not None)
            replacements = quantize_layer(index, loaded, stats)
            del stats
            loaded.set_weights(replacements)
            amax = _AmaxRecorder(text, layer, index, modules if input_amax else set())
            kv = _kv_recorder(text, layer, index, kv_attention)
            for b, hidden in enumerate(hidden_batches):
                args, kwargs = layer_args[tuple(hidden.shape)][index]
                hidden_batches[b] = layer(hidden, *args, **kwargs)
            amax.flush(result, index)
            if kv is not None:
                kv.flush(result.kv_amax)
            text.drop_layer(index)
            del layer, loaded, amax, replacements
            memory.trim_freed_memory()
            if on_layer is not None:
                on_layer(index, result)
            if progress:
                progress(index + 1, len(text.layers))
            step(progress, f"layer {index + 1}/{len(text.layers)}")
    return result

