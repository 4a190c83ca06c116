"""What every model family shares: tensor roles, fused-group detection, fused-expert expansion.

A family module only states what differs (model types, where the text config lives, expert count, default
ignores, routing). Everything here works from tensor names and shapes read from the checkpoint header.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from fp4kit.errors import Fp4kitError
from fp4kit.families.activation import SILU, ExpertActivation
from fp4kit.families.grammar import DEFAULT, ExpertGrammar

if TYPE_CHECKING:
    from fp4kit.families.moe_modules import MoEModules
    from fp4kit.families.routing import RoutingSpec
    from fp4kit.io.sources import QuantizedLinear

T = TypeVar("T")

# Modules that a kernel fuses and that must therefore share one weight global scale: q/k/v, an MLP's or expert's
# gate/up (the grammar's w13), and MLA's q_a_proj and kv_a_proj_with_mqa, vLLM's fused_qkv_a_proj
# (vllm/model_executor/models/deepseek_v2.py).
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), DEFAULT.w13, ("q_a_proj", "kv_a_proj_with_mqa"))
# fused siblings that vLLM serves as one Linear of another name, which its packed_modules_mapping does not list (so
# a per-module quantization config must name it itself): MLA's fused_qkv_a_proj (deepseek_v2.py)
ENGINE_FUSED_NAMES = {("q_a_proj", "kv_a_proj_with_mqa"): "fused_qkv_a_proj"}
FUSED_EXPERT_TENSORS = DEFAULT.fused_tensors
EXPERT_PROJS = DEFAULT.projections  # a routed expert's Linears, in w13 (gate, up) then w2 order
# a router or gate module, wherever it is (routers and Qwen's shared-expert gate), which engines keep unquantized
ROUTER_RE = re.compile(r"(\.mlp\.gate|\.feed_forward\.router|shared_expert_gate|\.router)$")
# an attention's query projection (fused or not); ``attn`` is the attention module
ATTENTION_QUERY_RE = re.compile(r"^(?P<attn>.*\.(self_attn|attention))\.(q_proj|qkv_proj)$")
LAYER_RE = re.compile(r"^(?P<prefix>.*?layers)\.(?P<layer>\d+)\.")
COMMON_IGNORE = (r"(^|\.)lm_head$",)
# 2-D weights that are not Linear layers (embeddings, position tables, norms with 2-D weights).
NOT_LINEAR = re.compile(r"(embed|embedding|norm)[^.]*$")


class LayerCall(Protocol):
    """How the layer-streaming passes call a family's transformers decoder layers that are not hidden -> hidden
    (GLM-5's carry state from layer to layer): what the stand-ins of the recording forward return to the model's
    layer loop, and ``adapt``, which makes each decoder layer hidden -> hidden (patching its forward in place)."""

    def stand_in_output(self, hidden_states: object) -> object: ...

    def adapt(self, layers: list) -> None: ...


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    text_config: Callable[[dict], dict]
    num_experts: Callable[[dict], int]
    routing: Callable[[dict], RoutingSpec]
    ignore: Callable[[dict], list[str]]  # regexes on module names, on top of COMMON_IGNORE
    moe_intermediate: Callable[[dict], int] = field(default=lambda tc: int(tc["moe_intermediate_size"]))
    # ModelOpt's HF export keeps this family's fused experts fused, with one scale per layer and projection.
    modelopt_fused_experts: bool = False
    # decoder layers on disk past num_hidden_layers (GLM's MTP layers)
    extra_layers: Callable[[dict], int] = field(default=lambda tc: 0)
    # name prefix of an MTP block stored outside the decoder layers (the Qwen hybrids' `mtp.`), which the family's
    # transformers class does not load
    mtp_prefix: str | None = None
    # The family's HF checkpoints store routed experts fused and K-major: `experts.gate_up_proj` [E, H, 2I] (gate in
    # the first I columns) and `experts.down_proj` [E, I, H]; the others store one module per expert.
    hf_fused_experts: bool = False
    # the names of the family's MoE block on disk (experts, projections, fused tensors, router, shared expert)
    grammar: ExpertGrammar = DEFAULT
    # the routed experts' activation between their GEMMs (SwiGLU but for gpt-oss)
    activation: Callable[[dict], ExpertActivation] = field(default=lambda tc: SILU)
    # how transformers' classes of the family hold and run its MoE block (fp4kit.families.moe_modules, torch)
    moe_modules: Callable[[], MoEModules] = field(default=lambda: _fused_experts())
    # a new one per streamed model, for decoder layers that are not hidden -> hidden; None: they are
    layer_call: Callable[[], LayerCall] | None = None
    # transformers' decoder layers of the family load one at a time from the checkpoint's names
    # (quantize.layer_model: W4A4 calibration, gptq, eval); False: those refuse the family
    streams_layers: bool = True
    # `quantize --method awq` folds activation-aware scales into the decoder layer's producers (fp4kit.quantize.awq:
    # RMSNorms that multiply by their weight -> q/k/v and the router plus experts, v -> o, up -> down); False: no
    # mapping is defined for the family's layers and the method refuses it
    awq_folds: bool = False
    # the key of an FP8 release's own quantization_config under which an engine reads NVFP4 routed experts beside
    # the release's FP8 Linears (quantize --source-config); None: no engine reads such a form for the family
    source_config_moe_key: str | None = None
    # MLA attention (DeepSeek's): vLLM caches the compressed latent and the rotary key under one scale, not keys and
    # values (model_executor/layers/attention/mla_attention.py), so `quantize --kv-cache fp8` refuses the family
    mla_attention: bool = False

    def layer_index(self, name: str, text_config: dict) -> int | None:
        """``layer_of``, with the layers of an MTP block outside the decoder layers (``mtp_prefix``) numbered after
        them, num_hidden_layers + N, as vLLM's drafters number them (qwen3_next_mtp.py: mtp_start_layer_idx)."""
        if self.mtp_prefix is not None and name.startswith(self.mtp_prefix):
            # the block's layers as `layers.N.` (the Qwen hybrids' `mtp.layers.0.`) or `N.` (DeepSeek-V4's `mtp.0.`)
            rest = name[len(self.mtp_prefix):]
            layer = layer_of(rest) if not rest[:1].isdigit() else layer_of("layers." + rest)
            return None if layer is None else int(text_config["num_hidden_layers"]) + layer
        return layer_of(name)

    def default_ignore(self, config: dict, mtp: str = "keep") -> list[str]:
        """COMMON_IGNORE, the family's ignores and, for an MTP block outside the decoder layers, that block: whole
        (``mtp`` "keep"), or all but its routed experts ("quantize")."""
        kept = [*COMMON_IGNORE, *self.ignore(config)]
        if self.mtp_prefix is not None:
            block = "^" + re.escape(self.mtp_prefix)
            routed = rf"(?!(layers\.)?\d+\.\w+\.{re.escape(self.grammar.experts)}\.\d+\.)"  # its layers' experts
            kept.append(block if mtp == "keep" else block + routed)
        elif mtp != "keep":
            raise Fp4kitError(f"--mtp {mtp}: {self.name} has no MTP block outside its decoder layers (its MTP layers, "
                              "if any, are `layers.N` past num_hidden_layers: choose them with --ignore)")
        return kept

    def check_config(self, config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
        """The text config, after checking the sizes fp4kit reads from it (positive integers) against the routed
        experts on disk: their layers exist, each MoE layer has exactly the configured experts, of the configured
        shapes. Returns the text config."""
        text_config = self.text_config(config)
        where = "config.json" + ("" if text_config is config else " text_config")
        if not isinstance(text_config, dict):
            raise Fp4kitError("config.json: text_config is not an object")
        try:
            sizes = {"hidden_size": text_config["hidden_size"], "num_hidden_layers": text_config["num_hidden_layers"],
                     "vocab_size": text_config["vocab_size"], "num_experts_per_tok": text_config.get(
                         "num_experts_per_tok", 1)}
            experts, inter = self.num_experts(text_config), self.moe_intermediate(text_config)
            extra = self.extra_layers(text_config)
            routing = self.routing(text_config)
        except KeyError as exc:
            raise Fp4kitError(f"{where} lacks {exc.args[0]!r}, which {self.name} needs") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise Fp4kitError(f"{where}: a size {self.name} needs is not a number ({exc})") from None
        except Fp4kitError as exc:  # the routing's own checks (top-k, groups)
            raise Fp4kitError(f"{where}: {exc}") from None
        for key, value in sizes.items():
            _positive_int(where, key, value)
        layers, hidden = sizes["num_hidden_layers"], sizes["hidden_size"]
        if not 0 <= extra <= layers:
            raise Fp4kitError(f"{where}: {extra} MTP layers for {layers} decoder layers")
        _positive_int(where, "number of routed experts", experts)
        _positive_int(where, "expert intermediate size", inter)
        _positive_int(where, "num_experts_per_tok", routing.top_k)
        if routing.top_k > experts or sizes["num_experts_per_tok"] > experts:
            raise Fp4kitError(f"{where}: num_experts_per_tok {sizes['num_experts_per_tok']} exceeds the {experts} "
                              "routed experts")
        embeddings = [n for n in shapes if n.endswith("embed_tokens.weight") and "layers." not in n]
        if len(embeddings) == 1 and shapes[embeddings[0]] != (sizes["vocab_size"], hidden):
            raise Fp4kitError(f"{embeddings[0]}: shape {list(shapes[embeddings[0]])}, {where} implies "
                              f"[{sizes['vocab_size']}, {hidden}] (vocab_size, hidden_size)")
        found: dict[str, set[int]] = {}  # experts container -> expert indices on disk
        grammar = self.grammar
        for name, shape in shapes.items():
            split = grammar.split_expert(name)
            fused = grammar.is_fused_tensor(name, len(shape))
            if split is None and not fused:
                continue
            layer = layer_of(name)
            if layer is not None and layer >= layers + extra:
                raise Fp4kitError(f"{name}: layer {layer}, but {where} has num_hidden_layers {layers}")
            if fused:
                if shape[0] != experts:
                    raise Fp4kitError(f"{name}: {shape[0]} experts on disk, {where} says {experts}")
                continue
            assert split is not None
            experts_module, expert, rest = split
            found.setdefault(experts_module, set()).add(expert)
            proj, _, leaf = rest.rpartition(".")
            expected = {grammar.gate: (inter, hidden), grammar.up: (inter, hidden), grammar.down: (hidden, inter)}
            if leaf == "weight" and proj in expected and len(shape) == 2 and shape != expected[proj]:
                raise Fp4kitError(f"{name}: shape {list(shape)}, {where} implies {list(expected[proj])} "
                                  f"(hidden_size {hidden}, intermediate {inter})")
        for experts_module, indices in found.items():
            if max(indices) >= experts:
                raise Fp4kitError(f"{experts_module}: expert {max(indices)} on disk, {where} says {experts} experts")
            if len(indices) != experts:
                missing = next(i for i in range(experts) if i not in indices)
                raise Fp4kitError(f"{experts_module}: {len(indices)} experts on disk (expert {missing} missing), "
                                  f"{where} says {experts}")
        return text_config


def _fused_experts() -> MoEModules:
    from fp4kit.families.moe_modules import FUSED_EXPERTS

    return FUSED_EXPERTS


def _positive_int(where: str, key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Fp4kitError(f"{where}: {key} is {value!r}, not a positive integer")


@dataclass(frozen=True)
class SourceRef:
    """Where a Linear's [N, K] weight comes from: a whole 2-D tensor, or one expert of a fused 3-D one."""

    tensor: str
    expert: int | None = None
    span: tuple[int, int] | None = None  # range of output features (gate or up) inside the fused matrix
    transposed: bool = False  # the expert's matrix is stored [K, N] rather than [N, K]
    quantized: QuantizedLinear | None = None  # the source stores it quantized (FP8 block, packed INT): dequantize
    step: int = 1  # every step-th feature of the span (gpt-oss interleaves gate and up)


@dataclass(frozen=True)
class Linear:
    module: str  # output module name, e.g. model.layers.0.mlp.experts.3.gate_proj
    source: SourceRef
    out_features: int
    in_features: int


@dataclass(frozen=True)
class Candidate:
    linear: Linear
    layer: int | None
    expert: int | None
    parent: str  # module path without the last component: siblings share it


@dataclass(frozen=True)
class ExpertModule:
    """A routed expert's Linear, ``{experts}.{expert}.{proj}`` (e.g. model.layers.3.mlp.experts.7.gate_proj)."""

    experts: str  # the experts container: model.layers.3.mlp.experts
    expert: int
    proj: str  # the grammar's gate, up or down (gate_proj, up_proj or down_proj by default)
    grammar: ExpertGrammar = DEFAULT

    @property
    def fused(self) -> str:
        """w13 (gate, up) or w2 (down)."""
        return self.grammar.kernel_projection(self.proj)

    @property
    def is_down(self) -> bool:
        return self.proj == self.grammar.down

    @property
    def fused_leaf(self) -> str:
        """The fused-on-disk tensor (gate_up_proj or down_proj by default) holding this projection."""
        return self.grammar.fused_leaf(self.proj)


def fused_projection(proj: str, grammar: ExpertGrammar = DEFAULT) -> str:
    """The kernels' name of an expert projection: gate and up form w13 (one input, one weight scale), down is w2."""
    return grammar.kernel_projection(proj)


def expert_module(module: str, grammar: ExpertGrammar = DEFAULT) -> ExpertModule | None:
    """The routed expert a module name (without a tensor suffix) belongs to, or None."""
    split = grammar.split_expert(module)
    if split is None or "." in split[2]:
        return None
    return ExpertModule(split[0], split[1], split[2], grammar)


def routed_expert(module: str, grammar: ExpertGrammar = DEFAULT) -> ExpertModule | None:
    """Like ``expert_module``, for the Linears of a routed expert only (the grammar's projections)."""
    expert = expert_module(module, grammar)
    return expert if expert is not None and expert.proj in grammar.projections else None


def expert_tensor(name: str, grammar: ExpertGrammar = DEFAULT) -> tuple[ExpertModule, str] | None:
    """The routed expert a per-expert tensor name belongs to, and the rest of the name after its projection (its
    leaf: weight, weight_packed, input_scale, ...); None when the name is not under an expert. The projection is
    whatever follows the expert index, which callers check against the grammar's projections."""
    split = grammar.split_expert(name)
    if split is None:
        return None
    proj, _, leaf = split[2].partition(".")
    return ExpertModule(split[0], split[1], proj, grammar), leaf


def group_experts(items: Iterable[tuple[str, T]],
                  grammar: ExpertGrammar = DEFAULT) -> dict[str, dict[int, dict[str, T]]]:
    """(module name, value) pairs of routed-expert Linears as {experts module: {expert: {proj: value}}}, in the
    order first seen; other modules are left out."""
    grouped: dict[str, dict[int, dict[str, T]]] = {}
    for module, value in items:
        expert = routed_expert(module, grammar)
        if expert is not None:
            grouped.setdefault(expert.experts, {}).setdefault(expert.expert, {})[expert.proj] = value
    return grouped


def moe_block(experts: str, grammar: ExpertGrammar = DEFAULT) -> str:
    """The MoE block that holds a routed experts module (model.layers.3.mlp.experts -> model.layers.3.mlp): its
    router and shared expert live there."""
    return grammar.moe_block(experts)


def router_weights(experts: str, grammar: ExpertGrammar = DEFAULT) -> list[str]:
    """Where the router weight of an experts module may be, in the order to try (the grammar's routers)."""
    return grammar.router_weights(experts)


def router_bias_name(experts: str, grammar: ExpertGrammar = DEFAULT) -> str:
    """The router's selection bias (GLM's and DeepSeek's `e_score_correction_bias`) of an experts module."""
    return grammar.router_bias_name(experts)


def shared_expert_modules(experts: str, grammar: ExpertGrammar = DEFAULT) -> list[str]:
    """Where the shared expert of an experts module may be (the grammar's shared experts), in the order to try."""
    return grammar.shared_expert_modules(experts)


def _siblings(grammar: ExpertGrammar) -> tuple[tuple[str, ...], ...]:
    """FUSED_SIBLINGS, plus the grammar's expert gate/up where they are not gate_proj / up_proj (MiniMax's w1 / w3;
    its dense MLPs, if it had any, would still be gate_proj / up_proj)."""
    return FUSED_SIBLINGS if grammar.w13 == DEFAULT.w13 else (*FUSED_SIBLINGS, grammar.w13)


def _sibling_set(leaf: str, grammar: ExpertGrammar = DEFAULT) -> int | None:
    return next((i for i, members in enumerate(_siblings(grammar)) if leaf in members), None)


def weight_scale_group(module: str, grammar: ExpertGrammar = DEFAULT) -> str:
    """Modules whose weights a kernel fuses share this key, and must share one weight global scale: q/k/v of one
    attention, gate/up of one MLP or expert; any other module is a group of its own."""
    parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
    sibling = _sibling_set(leaf, grammar)
    return module if sibling is None else f"{parent}#{sibling}"


def input_scale_group(module: str, grammar: ExpertGrammar = DEFAULT) -> str:
    """Modules that read one activation and so share one input scale: a layer's routed experts per projection (w13
    or w2: the kernels quantize the hidden states once for every expert, and EP then needs no all-reduce), and the
    fused groups of ``weight_scale_group``."""
    expert = expert_module(module, grammar)
    return f"{expert.experts}#{expert.fused}" if expert else weight_scale_group(module, grammar)


def largest_amax(stores: str) -> Callable[..., T]:
    """The input-scale policy's choice within one ``input_scale_group``: the value of largest amax, so no member's
    activations clip (and EP ranks agree). ``stores``: what the values are, ``"amax"`` or ``"divisor"`` (the
    largest) or ``"multiplier"`` (448*6/amax: the smallest). Works on floats and on 0-d tensors (``key=float``)."""
    if stores not in ("amax", "divisor", "multiplier"):
        raise ValueError(f"scale values are an amax, a divisor or a multiplier, not {stores!r}")
    return min if stores == "multiplier" else max


def layer_of(name: str) -> int | None:
    m = LAYER_RE.match(name)
    return int(m.group("layer")) if m else None


def expert_of(name: str, grammar: ExpertGrammar = DEFAULT) -> int | None:
    split = grammar.split_expert(name)
    return split[1] if split else None


def linear_candidates(shapes: dict[str, tuple[int, ...]], text_config: dict, moe_intermediate: int,
                      grammar: ExpertGrammar = DEFAULT) -> list[Candidate]:
    """Every Linear weight in the checkpoint, with fused [E, H, 2I] / [E, I, H] expert tensors split per expert."""
    found: list[Candidate] = []
    hidden = int(text_config["hidden_size"])
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2 and not NOT_LINEAR.search(name[: -len(".weight")]):
            module = name[: -len(".weight")]
            parent = module.rsplit(".", 1)[0] if "." in module else ""
            linear = Linear(module, SourceRef(name), shape[0], shape[1])
            found.append(Candidate(linear, layer_of(name), expert_of(name, grammar), parent))
        elif grammar.is_fused_tensor(name, len(shape)):
            found.extend(_split_fused(name, shape, hidden, moe_intermediate, grammar))
    return found


def _split_fused(name: str, shape: tuple[int, ...], hidden: int, inter: int,
                 grammar: ExpertGrammar) -> list[Candidate]:
    """Split [E, H, 2I] / [E, I, H] (HF checkpoints: K-major, "transposed") or [E, 2I, H] / [E, H, I] (what
    transformers 5 saves for some models) per expert. When H == 2I the shapes cannot tell: the HF layout wins."""
    experts_path, leaf = name.rsplit(".", 1)
    dims = tuple(shape[1:])
    gate_up = leaf == grammar.fused_gate_up
    if gate_up:
        out_features, in_features = inter, hidden
        parts = [(p, grammar.gate_up_rows(p, inter)) for p in grammar.w13]
    else:
        out_features, in_features = hidden, inter
        parts = [(grammar.down, None)]
    fused_out = 2 * inter if gate_up else out_features
    if dims == (in_features, fused_out):
        transposed = True
    elif dims == (fused_out, in_features):
        transposed = False
    else:
        raise Fp4kitError(
            f"{name}: shape {list(shape)} fits neither [E, {in_features}, {fused_out}] nor [E, {fused_out}, "
            f"{in_features}] (hidden={hidden}, intermediate={inter} from config.json)"
        )
    found = []
    for e in range(shape[0]):
        parent = f"{experts_path}.{e}"
        for proj, rows in parts:
            span, step = (None, 1) if rows is None else (rows[:2], rows[2])
            linear = Linear(f"{parent}.{proj}", SourceRef(name, e, span, transposed, step=step), out_features,
                            in_features)
            found.append(Candidate(linear, layer_of(name), e, parent))
    return found


def fused_groups(selected: list[Candidate], grammar: ExpertGrammar = DEFAULT) -> list[list[Candidate]]:
    """Group q/k/v and gate/up siblings (those selected, by ``weight_scale_group``) so they share a global scale,
    each group in its sibling order; others stand alone."""
    by_group: dict[str, list[Candidate]] = {}
    groups: list[list[Candidate]] = []
    for cand in selected:
        key = weight_scale_group(cand.linear.module, grammar)
        if key == cand.linear.module:
            groups.append([cand])
            continue
        if key not in by_group:
            by_group[key] = []
            groups.append(by_group[key])
        by_group[key].append(cand)
    order = {name: i for names in _siblings(grammar) for i, name in enumerate(names)}
    for group in groups:
        group.sort(key=lambda c: order.get(c.linear.module.rsplit(".", 1)[-1], 0))
    return groups


def sub_config(config: dict, key: str = "text_config") -> dict:
    return config.get(key) or config


def fused_siblings(modules: list[str], grammar: ExpertGrammar = DEFAULT) -> list[list[str]]:
    """Module names grouped as ``fused_groups`` groups candidates (by ``weight_scale_group``), each group in its
    sibling order, groups in the order of their first member."""
    groups: dict[str, list[str]] = {}
    for module in modules:
        groups.setdefault(weight_scale_group(module, grammar), []).append(module)

    def position(module: str) -> int:
        leaf = module.rsplit(".", 1)[-1]
        sibling = _sibling_set(leaf, grammar)
        return 0 if sibling is None else _siblings(grammar)[sibling].index(leaf)

    return [sorted(group, key=position) for group in groups.values()]


def engine_fused_name(modules: list[str]) -> str | None:
    """The name an engine serves fused siblings ``modules`` under where no packed-module mapping gives it
    (``ENGINE_FUSED_NAMES``), e.g. ``model.layers.0.self_attn.fused_qkv_a_proj``; None for any other group."""
    parents = {m.rsplit(".", 1)[0] for m in modules}
    leaves = sorted(m.rsplit(".", 1)[-1] for m in modules)
    fused = next((name for parts, name in ENGINE_FUSED_NAMES.items() if sorted(parts) == leaves), None)
    return f"{parents.pop()}.{fused}" if fused and len(parents) == 1 else None
