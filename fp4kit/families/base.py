"""What every model family shares: tensor roles, fused-group detection, fused-expert expansion.

A family module only states what differs (model types, where the text config lives, expert count, default
ignores, routing). Everything here works from tensor names and shapes read from the checkpoint header.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from fp4kit.errors import Fp4kitError

if TYPE_CHECKING:
    from fp4kit.families.routing import RoutingSpec
    from fp4kit.io.sources import QuantizedLinear

T = TypeVar("T")

# Modules that a kernel fuses and that must therefore share one weight global scale. MLA's q_a_proj and
# kv_a_proj_with_mqa are vLLM's fused_qkv_a_proj (vllm/model_executor/models/deepseek_v2.py).
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # a routed expert's Linears, in w13 (gate, up) then w2 order
# beside a layer's `experts`: the router (Qwen3 / GLM / DeepSeek `gate`, Llama-4 `router`), GLM's and DeepSeek's
# selection bias, the shared expert (GLM / DeepSeek `shared_experts`, Qwen3 / Llama-4 `shared_expert`)
ROUTER_MODULES = ("gate", "router")
ROUTER_BIAS = "gate.e_score_correction_bias"
SHARED_EXPERT_MODULES = ("shared_experts", "shared_expert")
# a router or gate module, wherever it is (routers and Qwen's shared-expert gate), which engines keep unquantized
ROUTER_RE = re.compile(r"(\.mlp\.gate|\.feed_forward\.router|shared_expert_gate|\.router)$")
# an attention's query projection (fused or not); ``attn`` is the attention module
ATTENTION_QUERY_RE = re.compile(r"^(?P<attn>.*\.(self_attn|attention))\.(q_proj|qkv_proj)$")
LAYER_RE = re.compile(r"^(?P<prefix>.*?layers)\.(?P<layer>\d+)\.")
EXPERT_RE = re.compile(r"\.experts\.(?P<expert>\d+)\.")
COMMON_IGNORE = (r"(^|\.)lm_head$",)
# 2-D weights that are not Linear layers (embeddings, position tables, norms with 2-D weights).
NOT_LINEAR = re.compile(r"(embed|embedding|norm)[^.]*$")


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
    # The family's HF checkpoints store routed experts fused and K-major: `experts.gate_up_proj` [E, H, 2I] (gate in
    # the first I columns) and `experts.down_proj` [E, I, H]; the others store one module per expert.
    hf_fused_experts: bool = False

    def default_ignore(self, config: dict) -> list[str]:
        return [*COMMON_IGNORE, *self.ignore(config)]

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
        found: dict[str, set[int]] = {}  # experts module -> expert indices on disk
        for name, shape in shapes.items():
            expert = expert_of(name)
            leaf = name.rsplit(".", 1)[-1]
            fused = leaf in FUSED_EXPERT_TENSORS and len(shape) == 3 and ".experts." in f".{name}"
            if expert is None and not fused:
                continue
            layer = layer_of(name)
            if layer is not None and layer >= layers + extra:
                raise Fp4kitError(f"{name}: layer {layer}, but {where} has num_hidden_layers {layers}")
            if fused:
                if shape[0] != experts:
                    raise Fp4kitError(f"{name}: {shape[0]} experts on disk, {where} says {experts}")
                continue
            head = name[: EXPERT_RE.search(name).start()]  # type: ignore[union-attr]
            found.setdefault(head, set()).add(expert)
            proj = name.rsplit(".", 2)[-2]
            expected = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
            if leaf == "weight" and proj in expected and len(shape) == 2 and shape != expected[proj]:
                raise Fp4kitError(f"{name}: shape {list(shape)}, {where} implies {list(expected[proj])} "
                                  f"(hidden_size {hidden}, intermediate {inter})")
        for head, indices in found.items():
            if max(indices) >= experts:
                raise Fp4kitError(f"{head}.experts: expert {max(indices)} on disk, {where} says {experts} experts")
            if len(indices) != experts:
                missing = next(i for i in range(experts) if i not in indices)
                raise Fp4kitError(f"{head}.experts: {len(indices)} experts on disk (expert {missing} missing), "
                                  f"{where} says {experts}")
        return text_config


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
    proj: str  # gate_proj, up_proj or down_proj

    @property
    def fused(self) -> str:
        return fused_projection(self.proj)


def fused_projection(proj: str) -> str:
    """The kernels' name of an expert projection: gate and up form w13 (one input, one weight scale), down is w2."""
    return "w13" if proj in FUSED_SIBLINGS[1] else "w2"


_EXPERT_MODULE = re.compile(r"^(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


def expert_module(module: str) -> ExpertModule | None:
    """The routed expert a module name (without a tensor suffix) belongs to, or None."""
    m = _EXPERT_MODULE.match(module)
    return ExpertModule(m["experts"], int(m["expert"]), m["proj"]) if m else None


def routed_expert(module: str) -> ExpertModule | None:
    """Like ``expert_module``, for the Linears of a routed expert only (EXPERT_PROJS)."""
    expert = expert_module(module)
    return expert if expert is not None and expert.proj in EXPERT_PROJS else None


def group_experts(items: Iterable[tuple[str, T]]) -> dict[str, dict[int, dict[str, T]]]:
    """(module name, value) pairs of routed-expert Linears as {experts module: {expert: {proj: value}}}, in the
    order first seen; other modules are left out."""
    grouped: dict[str, dict[int, dict[str, T]]] = {}
    for module, value in items:
        expert = routed_expert(module)
        if expert is not None:
            grouped.setdefault(expert.experts, {}).setdefault(expert.expert, {})[expert.proj] = value
    return grouped


def moe_block(experts: str) -> str:
    """The MoE block that holds a routed experts module (model.layers.3.mlp.experts -> model.layers.3.mlp): its
    router and shared expert live there."""
    return experts.removesuffix(".experts")


def router_weights(experts: str) -> list[str]:
    """Where the router weight of an experts module may be, in the order to try (ROUTER_MODULES)."""
    return [f"{moe_block(experts)}.{leaf}.weight" for leaf in ROUTER_MODULES]


def router_bias_name(experts: str) -> str:
    """The router's selection bias (GLM's and DeepSeek's `e_score_correction_bias`) of an experts module."""
    return f"{moe_block(experts)}.{ROUTER_BIAS}"


def shared_expert_modules(experts: str) -> list[str]:
    """Where the shared expert of an experts module may be (SHARED_EXPERT_MODULES), in the order to try."""
    return [f"{moe_block(experts)}.{leaf}" for leaf in SHARED_EXPERT_MODULES]


def weight_scale_group(module: str) -> str:
    """Modules whose weights a kernel fuses share this key, and must share one weight global scale: q/k/v of one
    attention, gate/up of one MLP or expert; any other module is a group of its own."""
    parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
    for i, members in enumerate(FUSED_SIBLINGS):
        if leaf in members:
            return f"{parent}#{i}"
    return module


def input_scale_group(module: str) -> str:
    """Modules that read one activation and so share one input scale: a layer's routed experts per projection (w13
    or w2: the kernels quantize the hidden states once for every expert, and EP then needs no all-reduce), and the
    fused groups of ``weight_scale_group``."""
    expert = expert_module(module)
    return f"{expert.experts}#{expert.fused}" if expert else weight_scale_group(module)


def layer_of(name: str) -> int | None:
    m = LAYER_RE.match(name)
    return int(m.group("layer")) if m else None


def expert_of(name: str) -> int | None:
    m = EXPERT_RE.search(name)
    return int(m.group("expert")) if m else None


def linear_candidates(shapes: dict[str, tuple[int, ...]], text_config: dict, moe_intermediate: int) -> list[Candidate]:
    """Every Linear weight in the checkpoint, with fused [E, H, 2I] / [E, I, H] expert tensors split per expert."""
    found: list[Candidate] = []
    hidden = int(text_config["hidden_size"])
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(".weight") and len(shape) == 2 and not NOT_LINEAR.search(name[: -len(".weight")]):
            module = name[: -len(".weight")]
            parent = module.rsplit(".", 1)[0] if "." in module else ""
            linear = Linear(module, SourceRef(name), shape[0], shape[1])
            found.append(Candidate(linear, layer_of(name), expert_of(name), parent))
        elif leaf in FUSED_EXPERT_TENSORS and len(shape) == 3 and ".experts." in f".{name}":
            found.extend(_split_fused(name, shape, hidden, moe_intermediate))
    return found


def _split_fused(name: str, shape: tuple[int, ...], hidden: int, inter: int) -> list[Candidate]:
    """Split [E, H, 2I] / [E, I, H] (HF checkpoints: K-major, "transposed") or [E, 2I, H] / [E, H, I] (what
    transformers 5 saves for some models) per expert. When H == 2I the shapes cannot tell: the HF layout wins."""
    experts_path, leaf = name.rsplit(".", 1)
    dims = tuple(shape[1:])
    if leaf == "gate_up_proj":
        out_features, in_features = inter, hidden
        parts = [("gate_proj", (0, inter)), ("up_proj", (inter, 2 * inter))]
    else:
        out_features, in_features = hidden, inter
        parts = [("down_proj", None)]
    fused_out = 2 * inter if leaf == "gate_up_proj" else out_features
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
        for proj, span in parts:
            linear = Linear(f"{parent}.{proj}", SourceRef(name, e, span, transposed), out_features, in_features)
            found.append(Candidate(linear, layer_of(name), e, parent))
    return found


def fused_groups(selected: list[Candidate]) -> list[list[Candidate]]:
    """Group q/k/v and gate/up siblings (those selected) so they share a global scale; others stand alone."""
    by_parent: dict[tuple[str, str], list[Candidate]] = {}
    groups: list[list[Candidate]] = []
    for cand in selected:
        leaf = cand.linear.module.rsplit(".", 1)[-1]
        sib = next((i for i, names in enumerate(FUSED_SIBLINGS) if leaf in names), None)
        if sib is None:
            groups.append([cand])
            continue
        key = (cand.parent, str(sib))
        if key not in by_parent:
            by_parent[key] = []
            groups.append(by_parent[key])
        by_parent[key].append(cand)
    order = {name: i for names in FUSED_SIBLINGS for i, name in enumerate(names)}
    for group in groups:
        group.sort(key=lambda c: order.get(c.linear.module.rsplit(".", 1)[-1], 0))
    return groups


def sub_config(config: dict, key: str = "text_config") -> dict:
    return config.get(key) or config
