"""AWQ for NVFP4 (`fp4kit quantize --method awq|awq+gptq`): activation-aware per-input-channel scales folded into
the producer of each quantized Linear's input, so the output stays a plain checkpoint.

For every decoder layer, before its statistics pass (fp4kit.quantize.calibrate.calibrate_quantized's
``prepare_layer``), the layer runs on the first calibration batches (up to ``AWQ_TOKENS`` tokens) and, mapping by
mapping, a grid over alpha picks s = mean|x|^alpha (normalized by sqrt(max * min), rounded to powers of two) that
minimizes the error of the consumers' outputs with their weights W * s round-to-nearest quantized and their input
x / s (W4A4: x / s quantized per 16-block too). Then W' = W * s on every consumer's input channels and the producer
divided by s:

- ``input_layernorm`` -> q/k/v;
- ``v_proj`` -> ``o_proj``: v_proj's output rows divided by s; with grouped-query attention every query head of a
  key/value head reads that head's values, so o_proj's input channels get s repeated per query head (exact);
- ``post_attention_layernorm`` -> the router and every routed expert's gate/up (one vector, the MoE block's output
  error), or a dense MLP's gate/up; the router's weight is multiplied by s too, and stays unquantized;
- each expert's (or the dense MLP's) up rows -> its down projection (the gated product is linear in up).

Powers of two make the fold exact in any float format: norm weight / s, router weight * s and the layer's
activations scale without rounding, so the float model's outputs and the router's logits are unchanged bit for bit
(barring over- or underflow). The mappings follow llm-compressor's for Qwen3-MoE
(``llmcompressor/modifiers/transform/awq/mappings.py``), whose search skips v_proj -> o_proj under grouped-query
attention; fp4kit repeats the scale instead. Fused-group global scales, GPTQ and W4A4 input scales are all computed
afterwards, from the folded layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import Family
from fp4kit.families.grammar import DEFAULT
from fp4kit.nvfp4 import BLOCK, amax_of_divisor, fake_quantize_activation, global_scale_mul, rtn_block_scale
from fp4kit.quantize.layer_model import LayerArguments, TextModel
from fp4kit.quantize.scale_search import round_e2m1_magnitude_

AWQ_GRID = 20  # alpha = 0, 1/20, ..., 19/20 (llm-compressor's n_grid); alpha 0 is s = 1, the layer as it is
AWQ_TOKENS = 8192  # calibration tokens each layer's search runs on (the first batches)


def check_family(family: Family) -> None:
    """Refuse a family whose decoder layer has no defined producer -> consumer mapping (``Family.awq_folds``)."""
    if not family.awq_folds:
        raise Fp4kitError(f"--method awq: no AWQ mapping is defined for {family.name}'s decoder layers (its norms, "
                          "attention or MoE block do not have the Qwen3-MoE structure the fold needs); use gptq or mse")


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.round(torch.log2(scale)))


def _scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha per row of x_mean [B, K], normalized by sqrt(max * min) as llm-compressor's search does, as
    powers of two."""
    s = x_mean.clamp(min=1e-4).pow(alpha)
    s = s / (s.amax(dim=-1, keepdim=True) * s.amin(dim=-1, keepdim=True)).sqrt()
    return _pow2(s)


def _fake_quantize(stack: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest NVFP4 of a stack [B, N, K] of fp32 weights (entry b: one fused group's members concatenated,
    one global scale), dequantized: fp4kit.nvfp4.quantize's values, without packing codes."""
    blocks = stack.unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1)  # [B, N, K/16]
    global_mul = global_scale_mul(amax.flatten(1).amax(dim=1)).reshape(-1, 1, 1)
    divisor = (rtn_block_scale(amax, global_mul) / global_mul).unsqueeze(-1)
    return round_e2m1_magnitude_(blocks.abs() / divisor).mul_(divisor).copysign_(blocks).flatten(-2)


def _input(x: torch.Tensor, act: bool) -> torch.Tensor:
    """A consumer's input [B, T, K] as the scheme serves it: W4A4 quantizes it per 16-block, the global scale of
    entry b from its amax."""
    if not act:
        return x
    divisor = x.abs().amax(dim=(-2, -1)).double() / amax_of_divisor(1.0)
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor)).reshape(-1, 1, 1, 1)
    return fake_quantize_activation(x, divisor.cpu()).to(x.dtype)


@dataclass
class _Captured:
    attention_in: list[torch.Tensor] = field(default_factory=list)  # the attention norm's output
    o_in: list[torch.Tensor] = field(default_factory=list)  # o_proj's input
    mlp_in: list[torch.Tensor] = field(default_factory=list)  # the MLP norm's output

    def hook(self, target: list[torch.Tensor]) -> Callable:
        def record(module: nn.Module, args: tuple) -> None:
            target.append(args[0].reshape(-1, args[0].shape[-1]).float())

        return record


@dataclass
class AwqFolder:
    """``prepare_layer`` of calibrate_quantized: searches and folds each decoder layer's scales in place, and keeps
    the folded tensors that are not quantized (norm and router weights, by checkpoint name) in ``folded``, cast to
    ``stored_dtype(name)``, for the writer. ``act``: W4A4, the search quantizes the consumers' inputs too.
    ``quantized(name)``: whether a Linear (checkpoint module name) is quantized to NVFP4 by the run; a mapping whose
    consumers or producing Linear are not is left out."""

    act: bool
    quantized: Callable[[str], bool]
    stored_dtype: Callable[[str], torch.dtype]
    grid: int = AWQ_GRID
    tokens: int = AWQ_TOKENS
    folded: dict[str, torch.Tensor] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)  # mapping (producer's checkpoint name) -> chosen alpha

    @torch.no_grad()
    def __call__(self, index: int, layer: nn.Module, text: TextModel, hidden_batches: list[torch.Tensor],
                 layer_args: LayerArguments) -> None:
        prefix = text.layer_prefix(index)
        attention, mlp = _part(layer, "self_attn", index), _part(layer, "mlp", index)
        norms = (_part(layer, "input_layernorm", index), _part(layer, "post_attention_layernorm", index))
        captured = _Captured()
        handles = [attention.q_proj.register_forward_pre_hook(captured.hook(captured.attention_in)),
                   attention.o_proj.register_forward_pre_hook(captured.hook(captured.o_in)),
                   mlp.register_forward_pre_hook(captured.hook(captured.mlp_in))]
        try:
            seen = 0
            for hidden in hidden_batches:
                if seen >= self.tokens:
                    break
                args, kwargs = layer_args[tuple(hidden.shape)][index]
                layer(hidden, *args, **kwargs)
                seen += hidden.shape[:-1].numel()
        finally:
            for handle in handles:
                handle.remove()

        def name(module: str) -> str:  # the checkpoint's name of a module of the layer
            return prefix + text.moe.checkpoint_name(module)

        qkv = [getattr(attention, p) for p in ("q_proj", "k_proj", "v_proj")]
        if all(self.quantized(name(f"self_attn.{p}")) for p in ("q_proj", "k_proj", "v_proj")):
            x = torch.cat(captured.attention_in)[: self.tokens]
            s = self._search_linears(x, [[m.weight for m in qkv]], name("input_layernorm"))
            self._fold_norm(norms[0], s, name("input_layernorm"))
            for m in qkv:
                m.weight.mul_(s.to(m.weight.dtype))
        if self.quantized(name("self_attn.v_proj")) and self.quantized(name("self_attn.o_proj")):
            self._fold_values(attention, torch.cat(captured.o_in)[: self.tokens], name("self_attn.v_proj"))
        x = torch.cat(captured.mlp_in)[: self.tokens]
        experts = text.moe.experts(mlp)
        if experts is not None:
            self._fold_moe(mlp, experts, x, text, prefix, norms[1], name("post_attention_layernorm"))
        elif all(isinstance(getattr(mlp, p, None), nn.Linear) for p in _DENSE_MLP):
            self._fold_dense(mlp, x, norms[1], name)
        else:
            raise Fp4kitError(f"--method awq: decoder layer {index}'s MLP ({type(mlp).__name__}) is neither a MoE "
                              "block nor a gate/up/down MLP")

    # --- the search ---

    def _search(self, x_mean: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor], keys: list[str]
                ) -> torch.Tensor:
        """Per row b of ``x_mean`` [B, K] (independent consumers), the scales [B, K] of the alpha whose
        ``loss(s)`` [B] is smallest."""
        best = torch.ones_like(x_mean)
        best_loss = loss(best)
        best_alpha = torch.zeros(x_mean.shape[0])
        for step in range(1, self.grid):
            alpha = step / self.grid
            s = _scales(x_mean, alpha)
            error = loss(s)
            better = error < best_loss
            best = torch.where(better[:, None], s, best)
            best_loss = torch.where(better, error, best_loss)
            best_alpha = torch.where(better.cpu(), alpha, best_alpha)
        self.alphas.update(zip(keys, best_alpha.tolist(), strict=True))
        return best

    def _search_linears(self, x: torch.Tensor, groups: list[list[torch.Tensor]], key: str) -> torch.Tensor:
        """The scale of one input x [T, K] shared by ``groups`` (each a fused group's [N, K] weights, one global
        scale): the error of their concatenated outputs."""
        weights = [torch.cat([w.float() for w in group]) for group in groups]
        reference = [x @ w.t() for w in weights]

        def loss(s: torch.Tensor) -> torch.Tensor:
            inputs = _input((x / s)[None], self.act)[0]
            error = torch.zeros(1)
            for w, ref in zip(weights, reference, strict=True):
                q = _fake_quantize((w * s)[None])[0]
                error += (inputs @ q.t() - ref).square().sum().cpu()
            return error

        return self._search(x.abs().mean(dim=0)[None], loss, [key])[0]

    # --- the folds ---

    def _fold_norm(self, norm: nn.Module, s: torch.Tensor, name: str) -> None:
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.shape != s.shape or getattr(norm, "bias", None) is not None:
            raise Fp4kitError(f"--method awq: {name} is not an RMSNorm with a [{s.numel()}] weight")
        weight.div_(s.to(weight.dtype))
        self._keep(f"{name}.weight", weight)

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        self.folded[name] = tensor.detach().to("cpu", self.stored_dtype(name)).clone()

    def _fold_values(self, attention: nn.Module, x: torch.Tensor, key: str) -> None:
        v_proj, o_proj = attention.v_proj, attention.o_proj
        head_dim = int(getattr(attention, "head_dim", 0) or 0)
        kv_channels, o_channels = v_proj.weight.shape[0], o_proj.weight.shape[1]
        if not head_dim or kv_channels % head_dim or o_channels % kv_channels:
            return  # no defined head layout: leave the pair as it is
        kv_heads, group = kv_channels // head_dim, o_channels // kv_channels

        def repeat(s_kv: torch.Tensor) -> torch.Tensor:  # query head h reads key/value head h // group
            return s_kv.view(kv_heads, 1, head_dim).expand(kv_heads, group, head_dim).reshape(-1)

        x_mean = x.abs().mean(dim=0).view(kv_heads, group, head_dim).mean(dim=1).reshape(-1)
        w_o = o_proj.weight.float()
        reference = x @ w_o.t()

        def loss(s_kv: torch.Tensor) -> torch.Tensor:
            s = repeat(s_kv[0])
            q = _fake_quantize((w_o * s)[None])[0]
            return (_input((x / s)[None], self.act)[0] @ q.t() - reference).square().sum().reshape(1).cpu()

        s_kv = self._search(x_mean[None], loss, [key])[0]
        v_proj.weight.div_(s_kv.to(v_proj.weight.dtype)[:, None])
        if v_proj.bias is not None:
            v_proj.bias.div_(s_kv.to(v_proj.bias.dtype))
        o_proj.weight.mul_(repeat(s_kv).to(o_proj.weight.dtype))

    def _fold_moe(self, block: nn.Module, experts: nn.Module, x: torch.Tensor, text: TextModel, prefix: str,
                  norm: nn.Module, norm_name: str) -> None:
        moe, grammar = text.moe, text.grammar
        num_experts = moe.num_experts(experts)
        path = f"{prefix}{moe.checkpoint_name('mlp')}.{moe.experts_attribute}"
        names = [grammar.expert_linears(path, e) for e in range(num_experts)]
        if not all(self.quantized(n) for triple in names for n in triple):
            return
        router = moe.router(block)
        router_weight = getattr(router, "weight", None)
        if not isinstance(router_weight, torch.Tensor) or router_weight.shape[-1] != x.shape[-1]:
            raise Fp4kitError(f"--method awq: {norm_name}'s MoE router holds no [experts, hidden] weight")
        router_output = router(x.to(router_weight.dtype))
        if not isinstance(router_output, tuple) or len(router_output) != 3:
            raise Fp4kitError(f"--method awq: {type(router).__name__} does not return (logits, weights, ids)")
        _, top_weights, top_ids = router_output
        w13 = torch.stack([moe.w13(experts, e).float() for e in range(num_experts)])  # [E, 2I, H]
        w2 = torch.stack([moe.w2(experts, e).float() for e in range(num_experts)])  # [E, H, I]
        routes = []
        for e in range(num_experts):
            tokens, slot = torch.where(top_ids == e)
            routes.append((tokens, top_weights[tokens, slot, None].float()))

        token_of = torch.cat([tokens for tokens, _ in routes])

        def block_output(gate_up: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
            parts = []
            for e, (tokens, weights) in enumerate(routes):
                gate, up = (inputs[tokens] @ gate_up[e].t()).chunk(2, dim=-1)
                parts.append((moe.gated(experts, e, gate, up) @ w2[e].t()) * weights)
            return torch.zeros_like(x).index_add_(0, token_of, torch.cat(parts))

        reference = block_output(w13, x)

        def loss(s: torch.Tensor) -> torch.Tensor:
            q = _fake_quantize(w13 * s)
            inputs = _input((x / s)[None], self.act)[0]
            return (block_output(q, inputs) - reference).square().sum().reshape(1).cpu()

        s = self._search(x.abs().mean(dim=0)[None], loss, [norm_name])[0]
        self._fold_norm(norm, s, norm_name)
        router_weight.mul_(s.to(router_weight.dtype))
        self._keep(prefix + moe.checkpoint_name(_relative(block, router, "mlp")) + ".weight", router_weight)
        for e in range(num_experts):
            moe.w13(experts, e).mul_(s.to(w13.device))
        self._fold_experts_down(experts, x / s, moe, routes, path)

    def _fold_experts_down(self, experts: nn.Module, x: torch.Tensor, moe, routes: list, path: str) -> None:
        """Each expert's up rows -> its down projection, alpha chosen per expert on the tokens routed to it (``x``:
        the MoE block's input after the norm's fold); experts no token reached keep theirs."""
        reached = [e for e, (tokens, _) in enumerate(routes) if tokens.numel()]
        if not reached:
            return
        longest = max(routes[e][0].numel() for e in reached)
        hidden = x.new_zeros((len(reached), longest, moe.intermediate(experts)))  # zero rows add no error
        for b, e in enumerate(reached):
            tokens = routes[e][0]
            gate, up = (x[tokens] @ moe.w13(experts, e).float().t()).chunk(2, dim=-1)
            hidden[b, : tokens.numel()] = moe.gated(experts, e, gate, up)
        counts = torch.tensor([routes[e][0].numel() for e in reached], device=x.device)
        x_mean = hidden.abs().sum(dim=1) / counts[:, None]
        ups = [moe.w13(experts, e)[moe.intermediate(experts):] for e in reached]
        self._fold_down(hidden, x_mean, ups, [moe.w2(experts, e) for e in reached], [f"{path}.{e}" for e in reached])

    def _fold_down(self, hidden: torch.Tensor, x_mean: torch.Tensor, ups: list[torch.Tensor],
                   downs: list[torch.Tensor], keys: list[str]) -> None:
        """Up rows -> down projection of B independent MLPs: ``hidden`` [B, T, I] their down inputs, ``x_mean``
        [B, I] its mean magnitudes, ``ups`` their up rows [I, H] and ``downs`` their [H, I] weights (views)."""
        w_d = torch.stack([d.float() for d in downs])
        reference = torch.bmm(hidden, w_d.transpose(1, 2))

        def loss(s: torch.Tensor) -> torch.Tensor:
            q = _fake_quantize(w_d * s[:, None, :])
            inputs = _input(hidden / s[:, None, :], self.act)
            return (torch.bmm(inputs, q.transpose(1, 2)) - reference).square().sum(dim=(1, 2)).cpu()

        s = self._search(x_mean, loss, keys)
        for up, down, s_b in zip(ups, downs, s, strict=True):
            up.div_(s_b.to(up.dtype)[:, None])
            down.mul_(s_b.to(down.dtype))

    def _fold_dense(self, mlp: nn.Module, x: torch.Tensor, norm: nn.Module, name: Callable[[str], str]) -> None:
        gate, up, down = (getattr(mlp, p) for p in _DENSE_MLP)
        if not all(self.quantized(name(f"mlp.{p}")) for p in _DENSE_MLP):
            return
        norm_name = name("post_attention_layernorm")
        s = self._search_linears(x, [[gate.weight, up.weight]], norm_name)
        self._fold_norm(norm, s, norm_name)
        gate.weight.mul_(s.to(gate.weight.dtype))
        up.weight.mul_(s.to(up.weight.dtype))
        folded = x / s
        hidden = mlp.act_fn(folded @ gate.weight.float().t()) * (folded @ up.weight.float().t())
        self._fold_down(hidden[None], hidden.abs().mean(dim=0)[None], [up.weight], [down.weight],
                        [name(f"mlp.{_DENSE_MLP[1]}")])


# a dense MLP's gate, up and down Linears, named as the default grammar names a routed expert's
_DENSE_MLP = (DEFAULT.gate, DEFAULT.up, DEFAULT.down)


def _part(layer: nn.Module, attribute: str, index: int) -> nn.Module:
    part = getattr(layer, attribute, None)
    if not isinstance(part, nn.Module):
        raise Fp4kitError(f"--method awq: decoder layer {index} ({type(layer).__name__}) has no {attribute}")
    return part


def _relative(block: nn.Module, module: nn.Module, block_name: str) -> str:
    for name, child in block.named_modules():
        if child is module:
            return f"{block_name}.{name}"
    raise AssertionError("the router is not in its MoE block")
