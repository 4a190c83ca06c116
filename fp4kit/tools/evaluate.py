"""`fp4kit eval`: a quantized checkpoint's next-token distribution against its source, one decoder layer at a time.

Both models run the layer-streaming text model (fp4kit/quantize/layer_model.py): embeddings and every layer's
arguments from a forward of the meta-device text model, then each decoder layer built with transformers' own class,
loaded alone, run over every sample's hidden states and dropped. A quantized checkpoint is read through
``fp4kit.tools.dense.DenseView``: its NVFP4 weights dequantized from the canonical form, in the family's HF layout, so
the quantized layer loads exactly as the source's does. Hidden states of both models for all samples stay in memory;
weights of one layer at a time.

W4A4 checkpoints (input scales present) run with their activations quantized as the Blackwell kernels do: the
input of every quantized Linear and, per routed expert, the gate/up input and the down input are quantized per
16-block with the stored static global scale and dequantized again (``fake_quantize_activation`` of
fp4kit/nvfp4.py). Routed experts then run expert by expert (the eager loop of transformers' experts
class, with those two quantization points); weight-only checkpoints run transformers' experts unchanged.

Measured on the positions that have a next token (samples x (seq_len - 1)): mean KL(source || quantized) of the
final distributions, the cross-entropy of each model on the next token, top-1 agreement, and per layer the relative
error ||h_q - h_s|| / ||h_s|| of the layer's output hidden states over all tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.base import Family
from fp4kit.formats.detect import QuantizedCheckpoint, config_files, open_checkpoint
from fp4kit.fp8 import fake_quantize_fp8_activation, fake_quantize_fp8_kv
from fp4kit.io import memory
from fp4kit.io.checkpoint import CheckpointReader, read_config
from fp4kit.io.sources import DequantizedView, detect_source
from fp4kit.nvfp4 import fake_quantize_activation
from fp4kit.quantize.kv_cache import attach_kv_hooks

DTYPES = ("float32", "bfloat16")  # compute dtypes
LOGIT_ELEMENTS = 1 << 25  # fp32 logits per chunk of tokens (x2 models): bounded whatever the vocabulary
_COMPATIBLE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


@dataclass
class EvalResult:
    source: str
    checkpoint: str
    # nvfp4 (W4A4, activations emulated), nvfp4a16, dense (not quantized), a source format (fp8-block), or for a
    # mixed-precision checkpoint "mixed (<its schemes>)"
    scheme: str
    samples: int
    seq_len: int
    tokens: int  # positions scored: samples x (seq_len - 1)
    kl: float  # mean per token KL(source || quantized), nats
    ce_source: float
    ce_quantized: float
    top1: float  # share of positions where both models' argmax agree
    layers: list[float] = field(default_factory=list)  # per decoder layer: ||h_q - h_s|| / ||h_s||
    dtype: str = "float32"
    device: str = "cpu"
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def input_divisors(ckpt: QuantizedCheckpoint) -> dict[str, torch.Tensor]:
    """Module name -> float64 divisor of its static input global scale (empty for weight-only checkpoints)."""
    return {m.name: ckpt.divisor(m.input_scale) for m in ckpt.modules if m.input_scale is not None}


def fp8_activations(ckpt: QuantizedCheckpoint) -> dict[str, tuple[str, torch.Tensor | None]]:
    """FP8 module name -> (its scheme, the float64 input divisor of fp8-static or None)."""
    return {m.name: (m.scheme, ckpt.read_fp8(m)[1]) for m in ckpt.fp8_modules}


def _fp8_input_hook(scheme: str, divisor: torch.Tensor | None):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (fake_quantize_fp8_activation(args[0], scheme, divisor).to(args[0].dtype), *args[1:])

    return hook


def emulate_fp8(module: nn.Module, prefix: str, fp8: dict[str, tuple[str, torch.Tensor | None]],
                family: Family) -> set[str]:
    """Quantize the inputs of every FP8 Linear under ``module`` (checkpoint name ``prefix``) in place; returns the
    module names covered."""
    moe = family.moe_modules()
    covered: set[str] = set()
    for name, sub in module.named_modules():
        full = prefix + moe.checkpoint_name(name)
        if isinstance(sub, nn.Linear) and full in fp8:
            sub.register_forward_pre_hook(_fp8_input_hook(*fp8[full]))
            covered.add(full)
    return covered


def _fake_quantized(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    return fake_quantize_activation(x, divisor).to(x.dtype)


def _linear_input_hook(divisor: torch.Tensor):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (_fake_quantized(args[0], divisor), *args[1:])

    return hook


def emulate_w4a4(module: nn.Module, prefix: str, divisors: dict[str, torch.Tensor], family: Family) -> set[str]:
    """Quantize the activations of every quantized Linear and routed expert under ``module`` (whose checkpoint name
    is ``prefix``, e.g. "model.layers.3."), in place; returns the module names covered. The family's MoE modules
    (``Family.moe_modules``) say how its transformers experts class runs, and so which forward replaces it."""
    moe, grammar = family.moe_modules(), family.grammar
    covered: set[str] = set()
    for name, sub in module.named_modules():
        full = prefix + moe.checkpoint_name(name)
        if isinstance(sub, nn.Linear) and full in divisors:
            sub.register_forward_pre_hook(_linear_input_hook(divisors[full]))
            covered.add(full)
        if moe.is_experts(sub) and grammar.expert_linear(full, 0, grammar.gate) in divisors:
            div13, div2 = [], []
            for e in range(moe.num_experts(sub)):
                names = grammar.expert_linears(full, e)
                missing = [n for n in names if n not in divisors]
                if missing:
                    raise Fp4kitError(f"{missing[0]}: no input scale, other experts of the layer have one")
                if not torch.equal(divisors[names[0]], divisors[names[1]]):
                    raise Fp4kitError(f"{full}.{e}: gate and up have different input scales; the fused w13 kernels "
                                      f"quantize their one input with one")
                div13.append(divisors[names[0]])
                div2.append(divisors[names[2]])
                covered.update(names)
            sub.forward = moe.w4a4_forward(sub, div13, div2, _fake_quantized)
    return covered


def emulate_kv_cache(layer: nn.Module, prefix: str, checkpoint_name: Callable[[str], str],
                     kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The FP8 KV cache: every attention module of ``layer`` with scales attends over its keys and values written
    to the cache and read back as vLLM does (fp4kit.fp8.fake_quantize_fp8_kv); a module with scales that the layer
    does not run through transformers' attention function is an error."""
    def hook_for(name: str):
        if name not in kv_scales:
            return None
        k_scale, v_scale = kv_scales[name]

        def quantize(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (fake_quantize_fp8_kv(key, k_scale).to(key.dtype),
                    fake_quantize_fp8_kv(value, v_scale).to(value.dtype))

        return quantize

    hooked = set(attach_kv_hooks(layer, prefix, checkpoint_name, hook_for))
    missed = sorted(n for n in kv_scales if n.startswith(prefix) and n not in hooked)
    if missed:
        raise Fp4kitError(f"{missed[0]}: has KV-cache scales but is not an attention module of transformers' "
                          f"{type(layer).__name__}, so its KV cache cannot be emulated")


def _emulate_layer(layer: nn.Module, prefix: str, divisors: dict[str, torch.Tensor],
                   fp8: dict[str, tuple[str, torch.Tensor | None]], family: Family) -> None:
    covered = emulate_w4a4(layer, prefix, divisors, family)
    missed = sorted(n for n in divisors if n.startswith(prefix) and n not in covered)
    if missed:
        raise Fp4kitError(f"{missed[0]}: has an input scale but is neither a Linear nor a routed expert of "
                          f"transformers' {type(layer).__name__}, so its activations cannot be emulated")
    covered = emulate_fp8(layer, prefix, fp8, family)
    missed = sorted(n for n in fp8 if n.startswith(prefix) and n not in covered)
    if missed:
        raise Fp4kitError(f"{missed[0]}: an FP8 module that is not a Linear of transformers' {type(layer).__name__} "
                          f"(eval emulates FP8 Linears, not FP8 routed experts), so its activations cannot be emulated")


class _Model:
    """One side of the comparison: a dense, FP8-block, INT4 pack-quantized or NVFP4 checkpoint read as dense
    tensors (fp4kit.io.sources dequantizes the first two in fp32, fp4kit.tools.dense.DenseView NVFP4)."""

    def __init__(self, root: Path, stack: contextlib.ExitStack):
        from fp4kit.tools.dense import DenseView

        self.root = root
        self.config = read_config(root)
        self.family = detect(self.config)
        self.divisors: dict[str, torch.Tensor] = {}
        self.fp8: dict[str, tuple[str, torch.Tensor | None]] = {}
        self.kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # attention -> FP8 KV cache's scales
        self.reader: CheckpointReader | DenseView | DequantizedView
        stored = stack.enter_context(CheckpointReader(root))  # the directory's one reader
        source = detect_source(self.config, {n: (i.dtype, i.shape) for n, i in stored.tensors.items()})
        if source.quantized:
            self.scheme = source.name
            self.reader = DequantizedView(stored, source, torch.float32)
        elif _is_quantized(root, self.config, stored):
            ckpt = stack.enter_context(open_checkpoint(root, reader=stored, mixed=True))
            schemes = dict.fromkeys(ckpt.module_schemes().values())
            self.scheme = f"mixed ({' + '.join(schemes)})" if ckpt.mixed else ckpt.scheme
            self.divisors = input_divisors(ckpt)
            self.fp8 = fp8_activations(ckpt)
            self.kv_scales = {a: ckpt.read_kv_scales(a) for a in ckpt.kv_scales}
            if ckpt.kv_cache is not None:
                self.scheme += f" + {ckpt.kv_cache} KV cache"
            self.reader = DenseView(ckpt, torch.float32)
        else:
            self.scheme = "dense"
            self.reader = stored


def _is_quantized(root: Path, config: dict, reader: CheckpointReader) -> bool:
    from fp4kit.registry import dialects

    if config.get("quantization_config") or any((root / name).exists() for name in config_files()):
        return True
    return any(d.owns(n) for n in reader.names() for d in dialects())


def _check_compatible(source: _Model, quantized: _Model) -> None:
    texts = [m.family.text_config(m.config) for m in (source, quantized)]
    for key in _COMPATIBLE_KEYS:
        a, b = (text.get(key, m.config.get(key)) for text, m in zip(texts, (source, quantized), strict=True))
        if a != b:
            raise Fp4kitError(f"{quantized.root}/config.json: {key} {b!r}, the source's is {a!r}: not a quantization "
                              f"of {source.root}")


def _final(reader, text, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The final norm (loaded) and the lm_head weight; a tied lm_head is the embedding."""
    norm_name = f"{text.prefix}norm.weight"
    if norm_name not in reader:
        raise Fp4kitError(f"checkpoint lacks {norm_name}, the text model's final norm")
    norm = text.model.norm
    norm.load_state_dict({"weight": reader.read(norm_name).to(device, dtype)}, assign=True)
    heads = [n for n in reader.names() if n.endswith("lm_head.weight")]
    if len(heads) > 1:
        raise Fp4kitError(f"checkpoint holds several lm_head weights: {', '.join(heads)}")
    if heads:
        return norm.eval(), reader.read(heads[0]).to(device, dtype)
    if not getattr(text.model.config, "tie_word_embeddings", False):
        raise Fp4kitError("checkpoint lacks lm_head.weight and config.json does not tie it to the embeddings")
    return norm.eval(), text.model.embed_tokens.weight


def _lm_head_input(reader, divisors: dict[str, torch.Tensor], fp8: dict[str, tuple[str, torch.Tensor | None]]
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a quantized lm_head's input is quantized (None: not quantized, or W4A16)."""
    heads = [n[: -len(".weight")] for n in reader.names() if n.endswith("lm_head.weight")]
    if not heads:
        return None
    if heads[0] in fp8:
        scheme, divisor = fp8[heads[0]]
        return lambda x: fake_quantize_fp8_activation(x, scheme, divisor).to(x.dtype)
    if heads[0] in divisors:
        return lambda x: _fake_quantized(x, divisors[heads[0]])
    return None


def _token_chunks(count: int, vocab: int) -> Iterator[slice]:
    step = max(1, LOGIT_ELEMENTS // max(vocab, 1))
    for start in range(0, count, step):
        yield slice(start, min(start + step, count))


@torch.inference_mode()
def evaluate(
    src: str | Path,
    ckpt: str | Path,
    token_ids: torch.Tensor,
    device: str = "cpu",
    batch_size: int = 8,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    activations_only: bool = False,
) -> EvalResult:
    """Compare ``ckpt`` (NVFP4 of either dialect, or dense) with its source ``src`` on int64 ``token_ids`` [S, L].
    ``progress(done, total)`` counts batch forwards: per decoder layer one per batch of each model, then one
    scoring pass per batch. ``activations_only``: the quantized side runs the source's weights with the checkpoint's
    activation and KV-cache quantization, which measures the share of the KL that no choice of weights removes."""
    from fp4kit.quantize.layer_model import layer_inputs, text_model

    start = time.perf_counter()
    src, ckpt = Path(src), Path(ckpt)
    if token_ids.dim() != 2 or token_ids.dtype != torch.int64 or token_ids.shape[1] < 2 or token_ids.shape[0] < 1:
        raise Fp4kitError(f"eval token ids must be an int64 [samples, seq_len >= 2] tensor, got "
                          f"{token_ids.dtype}{list(token_ids.shape)}")
    if batch_size < 1:
        raise Fp4kitError(f"--batch-size must be at least 1, got {batch_size}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Fp4kitError(f"--device {device}: no CUDA device is available")
    torch_device = torch.device(device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(memory.large_frees_returned_to_os())
        memory.bound_onednn_kernel_cache()
        models = [_Model(src, stack), _Model(ckpt, stack)]
        _check_compatible(*models)
        if activations_only:
            models[1].reader = models[0].reader
            models[1].scheme += ", activations only (the source's weights)"
        source = models[0]  # both models are built from SRC's config.json
        texts = [text_model(m.reader, source.config, source.family, dtype, torch_device, src) for m in models]
        vocab_size = texts[0].model.config.vocab_size
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise Fp4kitError(f"eval token ids must lie in [0, vocab_size {vocab_size}), got "
                              f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        ids = token_ids.to(torch_device)
        inputs = [layer_inputs(text, ids, batch_size) for text in texts]
        hidden = [hidden_batches for hidden_batches, _ in inputs]
        layer_errors = []
        total, done = (2 * len(texts[0].layers) + 1) * len(hidden[0]), 0
        if progress:
            progress(0, total)
        for index in range(len(texts[0].layers)):
            for side, (model, text) in enumerate(zip(models, texts, strict=True)):
                layer = text.load_layer(model.reader, index, dtype, torch_device)
                if model.divisors or model.fp8:
                    _emulate_layer(layer, text.layer_prefix(index), model.divisors, model.fp8, text.family)
                if model.kv_scales:
                    emulate_kv_cache(layer, text.layer_prefix(index), text.moe.checkpoint_name, model.kv_scales)
                layer_args = inputs[side][1]
                for b, states in enumerate(hidden[side]):
                    args, kwargs = layer_args[tuple(states.shape)][index]
                    hidden[side][b] = layer(states, *args, **kwargs)
                    done += 1
                    if progress:
                        progress(done, total)
                text.drop_layer(index)
                del layer
                memory.trim_freed_memory()
            layer_errors.append(_relative_error(hidden[0], hidden[1]))
        finals = [_final(m.reader, text, dtype, torch_device) for m, text in zip(models, texts, strict=True)]
        head_inputs = [_lm_head_input(m.reader, m.divisors, m.fp8) for m in models]
        totals = torch.zeros(4, dtype=torch.float64)  # kl, ce source, ce quantized, top-1 agreements
        for b in range(len(hidden[0])):
            targets = ids[b * batch_size : (b + 1) * batch_size, 1:].reshape(-1)
            states = [h[b][:, :-1].reshape(-1, h[b].shape[-1]) for h in hidden]
            for chunk in _token_chunks(targets.numel(), vocab_size):
                logits = []
                for side, (norm, head) in enumerate(finals):
                    x = norm(states[side][chunk])
                    if head_inputs[side] is not None:
                        x = head_inputs[side](x)
                    logits.append(F.linear(x, head).float())
                totals += _scores(logits[0], logits[1], targets[chunk])
            done += 1
            if progress:
                progress(done, total)
    tokens = token_ids.shape[0] * (token_ids.shape[1] - 1)
    kl, ce_source, ce_quantized, agree = (totals / tokens).tolist()
    return EvalResult(str(src), str(ckpt), models[1].scheme, token_ids.shape[0], token_ids.shape[1], tokens, kl,
                      ce_source, ce_quantized, agree, layer_errors, str(dtype).removeprefix("torch."), device,
                      time.perf_counter() - start)


def _relative_error(source: list[torch.Tensor], quantized: list[torch.Tensor]) -> float:
    diff = sum(float((q.double() - s.double()).pow(2).sum()) for s, q in zip(source, quantized, strict=True))
    norm = sum(float(s.double().pow(2).sum()) for s in source)
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def _scores(source_logits: torch.Tensor, quantized_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sums over the tokens of [KL(source || quantized), CE source, CE quantized, argmax agreements]."""
    log_p = F.log_softmax(source_logits, dim=-1)
    log_q = F.log_softmax(quantized_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).sum()
    ce_source = F.nll_loss(log_p, targets, reduction="sum")
    ce_quantized = F.nll_loss(log_q, targets, reduction="sum")
    agree = (source_logits.argmax(-1) == quantized_logits.argmax(-1)).sum()
    return torch.stack([kl, ce_source, ce_quantized, agree]).double().cpu()
