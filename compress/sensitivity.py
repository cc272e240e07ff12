"""Per-part sensitivity: the KL divergence from the float model when only one part of one layer
is quantized to a candidate format.

Model: a part is one decoder layer's linears of one kind: `attn_in` (q/k/v), `attn_out` (o),
`mlp_in` (gate/up), `mlp_out` (down). On the scan's windows the float model's next-token log
probabilities and every layer's inputs are computed once; then for each part and candidate the
part's weights are replaced by their quantized values, the model is run from that layer up
(the layers below are unchanged, so their outputs are reused), and the mean KL(float || quantized)
per token is recorded. The scan is what a mixed-precision plan minimises the sum of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compress.calibration import Batch, _layer_output, decoder_layers, layer_prefix, record_inputs
from compress.packed import PackedFormat, Quantized

PART_KINDS = {
    "attn_in": ("q_proj", "k_proj", "v_proj"),
    "attn_out": ("o_proj",),
    "mlp_in": ("gate_proj", "up_proj"),
    "mlp_out": ("down_proj",),
}
Quantizer = Callable[[torch.Tensor, PackedFormat], Quantized]


@dataclass(frozen=True)
class Part:
    layer: int
    kind: str
    linears: tuple[str, ...]
    """Full module names."""
    params: int
    """Weights in the part."""

    @property
    def name(self) -> str:
        return f"{self.layer}.{self.kind}"


def parts_of(model: nn.Module, chosen: set[str]) -> list[Part]:
    """The parts whose linears are all among `chosen`, in layer order."""
    found: list[Part] = []
    modules = dict(model.named_modules())
    for index, layer in enumerate(decoder_layers(model)):
        prefix = layer_prefix(model, layer)
        for kind, leaves in PART_KINDS.items():
            names = tuple(
                n for n in chosen if n.startswith(prefix + ".") and n.rsplit(".", 1)[-1] in leaves
            )
            if names:
                total = sum(modules[n].weight.numel() for n in names)
                found.append(Part(index, kind, tuple(sorted(names)), total))
    return found


def _final_logprobs(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(model.model.norm(hidden)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.log_softmax(logits, dim=-1)


@torch.no_grad()
def run_from(model: Any, start: int, inputs: list[list[Batch]]) -> list[torch.Tensor]:
    """Log probabilities when the model runs from layer `start` on its recorded inputs."""
    layers = decoder_layers(model)
    hidden = [x for x, _ in inputs[start]]
    for index in range(start, len(layers)):
        hidden = [
            _layer_output(layers[index], (x, kw)) for x, (_, kw) in zip(hidden, inputs[index])
        ]
    return [_final_logprobs(model, h) for h in hidden]


def kl(reference: list[torch.Tensor], logprobs: list[torch.Tensor]) -> float:
    total = sum(
        float(F.kl_div(q, p, log_target=True, reduction="sum")) for p, q in zip(reference, logprobs)
    )
    return total / sum(p.shape[0] * p.shape[1] for p in reference)


@torch.no_grad()
def layer_inputs(model: Any, rows: torch.Tensor, batch_size: int) -> list[list[Batch]]:
    """Every layer's real inputs (hidden states and kwargs) on the float model."""
    recorded = record_inputs(model, rows, batch_size)
    layers = decoder_layers(model)
    hidden = [x for x, _ in recorded[0]]
    filled: list[list[Batch]] = []
    for index, layer in enumerate(layers):
        filled.append([(x, kw) for x, (_, kw) in zip(hidden, recorded[index])])
        hidden = [_layer_output(layer, b) for b in filled[-1]]
    return filled


@torch.no_grad()
def scan(
    model: Any,
    rows: torch.Tensor,
    parts: list[Part],
    candidates: list[PackedFormat],
    quantize: Quantizer,
    progress: Callable[[str], None],
    batch_size: int = 4,
) -> tuple[dict[str, dict[str, float]], list[torch.Tensor], list[list[Batch]]]:
    """{part: {format: KL}}, plus the float log probabilities and layer inputs it used."""
    inputs = layer_inputs(model, rows, batch_size)
    reference = run_from(model, len(decoder_layers(model)) - 1, inputs)
    modules = dict(model.named_modules())
    result: dict[str, dict[str, float]] = {}
    for part in parts:
        originals = {n: modules[n].weight.detach().clone() for n in part.linears}
        result[part.name] = {}
        for fmt in candidates:
            for n in part.linears:
                modules[n].weight.copy_(quantize(originals[n], fmt).dequantize())
            result[part.name][fmt.name] = kl(reference, run_from(model, part.layer, inputs))
            progress(f"sensitivity {part.name} {fmt.name}")
        for n in part.linears:
            modules[n].weight.copy_(originals[n])
    return result, reference, inputs
