"""AWQ (Lin et al., 2023): activation-aware weight scaling and clipping before quantization.

Model: a linear's input channels that carry large activations matter most. For each group of
linears that read the same input (q/k/v after the attention norm, gate/up after the MLP norm,
down after up, o after v where their shapes match) search s = mean|x|^a / mean|w|^(1-a) over a
grid of a in [0, 1): scale the weights' input columns by s, fake-quantize, divide by s, and keep
the s whose output of the inspected module (the attention block, the MLP, or the linear itself)
is closest to the float one. The inverse scale is folded into the op before (a norm's weight, or
up_proj / v_proj's output rows), so the float model computes the same function with weights that
quantize better. Then each linear but q/k searches, per output row and group, a clipping of its
largest weights (shrinking |w|max by up to `max_shrink`) that minimises its output error. This
follows AutoAWQ's `_search_best_scale` / `_search_best_clip`; the weights are then quantized by
round-to-nearest or GPTQ (the step's `then`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compress.calibration import Batch, run_with_input_hooks
from compress.grids import rtn
from compress.packed import PackedFormat


@dataclass(frozen=True)
class AWQSettings:
    grid: int = 20
    """Points of a in [0, 1) tried for the scales."""
    max_shrink: float = 0.5
    """Clipping tries |w|max x (1 - i / grid) for i below max_shrink x grid."""
    clip: bool = True
    search_tokens: int = 4096
    """Calibration tokens the scale search runs the inspected modules on."""
    clip_tokens: int = 512
    """Tokens the clip search compares outputs on."""


@dataclass(frozen=True)
class ScaleGroup:
    prev: str
    """The op whose output feeds the linears (a norm, or a linear whose output rows scale)."""
    linears: tuple[str, ...]
    inspect: str
    """The module whose output is compared (it takes the linears' common input)."""


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    mlp_norm = (
        "pre_feedforward_layernorm"
        if hasattr(layer, "pre_feedforward_layernorm")
        else "post_attention_layernorm"
    )
    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    groups = [
        ScaleGroup("input_layernorm", attn, "self_attn"),
        ScaleGroup(mlp_norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    v, o = layer.get_submodule("self_attn.v_proj"), layer.get_submodule("self_attn.o_proj")
    if v.weight.shape == o.weight.shape:  # no grouped-query sharing: v's rows are o's inputs
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    return groups


def fold_inverse_scale(prev: nn.Module, scales: torch.Tensor) -> None:
    """Make `prev`'s output x / scales. Gemma's RMSNorm multiplies by (1 + weight)."""
    weight = _weight(prev)
    if isinstance(prev, nn.Linear):
        weight.div_(scales[:, None])
        if prev.bias is not None:
            prev.bias.div_(scales)
    elif "Gemma" in type(prev).__name__:
        weight.add_(1).div_(scales).sub_(1)
    else:
        weight.div_(scales)


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__} has no weight tensor"
    return weight


def _inspect(module: nn.Module, batches: list[Batch], kwargs_needed: bool) -> list[torch.Tensor]:
    outs = []
    for x, kw in batches:
        out = module(hidden_states=x, **kw) if kwargs_needed else module(x)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _limit(batches: list[Batch], tokens: int) -> list[Batch]:
    kept, count = [], 0
    for b in batches:
        if count >= tokens:
            break
        kept.append(b)
        count += b[0].shape[0] * b[0].shape[1]
    return kept


@torch.no_grad()
def search_scales(
    layer: nn.Module, group: ScaleGroup, inputs: list[Batch], fmt: PackedFormat, cfg: AWQSettings
) -> torch.Tensor:
    linears = [_weight(layer.get_submodule(n)) for n in group.linears]
    inspect = layer.get_submodule(group.inspect)
    needs_kwargs = group.inspect == "self_attn"
    batches = _limit(inputs, cfg.search_tokens)
    x_mean = torch.cat([x.reshape(-1, x.shape[-1]).abs() for x, _ in batches]).float().mean(0)
    weight = torch.cat(linears)
    size = fmt.group_size or weight.shape[1]
    w = weight.abs().reshape(-1, size)
    w_mean = (w / (w.amax(dim=1, keepdim=True) + 1e-6)).reshape(weight.shape).mean(0)
    reference = _inspect(inspect, batches, needs_kwargs)
    originals = [m.detach().clone() for m in linears]
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for i in range(cfg.grid):
        ratio = i / cfg.grid
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        for m, w0 in zip(linears, originals):
            m.copy_(rtn(w0 * scales, fmt).dequantize() / scales)
        outs = _inspect(inspect, batches, needs_kwargs)
        loss = sum(float((o - r).float().pow(2).sum()) for o, r in zip(outs, reference))
        if loss < best_loss:
            best, best_loss = scales.clone(), loss
    for m, w0 in zip(linears, originals):
        m.copy_(w0)
    return best


@torch.no_grad()
def search_clip(
    weight: torch.Tensor, x: torch.Tensor, fmt: PackedFormat, cfg: AWQSettings
) -> torch.Tensor:
    """Per output row and group, the |w| bound that minimises the group's output error on `x`
    ([rows, 1, groups, 1], as AutoAWQ's `_search_best_clip`)."""
    size = fmt.group_size or weight.shape[1]
    x = x.reshape(x.shape[0], -1, size)  # [tokens, groups, size]
    w = weight.float().reshape(weight.shape[0], 1, x.shape[1], size)
    original = w.abs().amax(dim=-1, keepdim=True)

    def group_outputs(v: torch.Tensor) -> torch.Tensor:  # [rows, tokens, groups]
        return torch.einsum("tgs,ogs->otg", x, v[:, 0])

    reference = group_outputs(w)
    errors = torch.full_like(original, float("inf"))
    chosen = original.clone()
    for i in range(int(cfg.max_shrink * cfg.grid)):
        bound = original * (1 - i / cfg.grid)
        clipped = torch.clamp(w, -bound, bound).reshape(weight.shape)
        q = rtn(clipped, fmt).dequantize().reshape(w.shape)
        err = (group_outputs(q) - reference).pow(2).mean(dim=1).reshape(errors.shape)
        better = err < errors
        errors, chosen = torch.where(better, err, errors), torch.where(better, bound, chosen)
    return chosen


def _capture(
    layer: nn.Module, batches: list[Batch], names: list[str]
) -> dict[str, list[torch.Tensor]]:
    """What each named linear receives on each batch, in one pass over the layer."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    run_with_input_hooks(layer, batches, {n: seen[n].append for n in names})
    return seen


def _sample_tokens(inputs: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """`tokens` rows (evenly spaced) of a linear's inputs."""
    flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])
    step = max(1, len(flat) // tokens)
    return flat[::step][:tokens].float()


@torch.no_grad()
def apply_awq(
    layer: nn.Module, batches: list[Batch], fmt: PackedFormat, cfg: AWQSettings
) -> dict[str, Any]:
    """Scale and clip one decoder layer in place (its float function unchanged by the scales);
    returns what was chosen, for the manifest."""
    record: dict[str, Any] = {}
    batches = _limit(batches, cfg.search_tokens)
    groups = scale_groups(layer)
    # NOTE: one pass serves every group: a group's scales change only its own linears' inputs
    captured = _capture(layer, batches, [g.linears[0] for g in groups])
    for group in groups:
        inputs = [(x, kw) for x, (_, kw) in zip(captured[group.linears[0]], batches)]
        scales = search_scales(layer, group, inputs, fmt, cfg)
        fold_inverse_scale(layer.get_submodule(group.prev), scales)
        for name in group.linears:
            _weight(layer.get_submodule(name)).mul_(scales)
        record[group.inspect] = float(scales.max() / scales.min())
    if cfg.clip:
        clipped = [
            n
            for n, m in layer.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith(("q_proj", "k_proj"))
        ]
        scaled_inputs = _capture(layer, batches, clipped)  # after scaling: what they now see
        for name in clipped:
            module = layer.get_submodule(name)
            x = _sample_tokens(scaled_inputs[name], cfg.clip_tokens)
            bound = search_clip(_weight(module), x, fmt, cfg)
            weight = _weight(module)
            w = weight.reshape(weight.shape[0], 1, -1, fmt.group_size or weight.shape[1])
            weight.copy_(torch.clamp(w, -bound, bound).reshape(weight.shape))
    return record
