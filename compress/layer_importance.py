"""How much each decoder layer changes the hidden state: ShortGPT's block influence.

Model: for layer i with input h_i and output h_{i+1} (the residual stream before and after the
block), BI_i = 1 - mean over tokens of cos(h_i, h_{i+1}). A layer whose output points where its
input did (BI near 0) does little; dropping it costs little (Men et al., 2024, "ShortGPT").
Measured in float32 on calibration windows of the recipe's data (train split); the layers kept
are those with the largest scores, in the teacher's order.
"""

from __future__ import annotations

from typing import Any

import torch

from compress.calibration import decoder_layers


@torch.no_grad()
def block_influence(model: Any, rows: torch.Tensor, batch_size: int = 8) -> list[float]:
    """BI of every decoder layer of `model` over the token windows `rows` [n, seq]."""
    layers = decoder_layers(model)
    totals = torch.zeros(len(layers), dtype=torch.float64)
    tokens = 0
    current: dict[int, torch.Tensor] = {}

    def before(index: int) -> Any:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            current[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def after(index: int) -> Any:
        def hook(_: Any, __: Any, ___: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(
                current.pop(index).float(), out.float(), dim=-1
            )
            totals[index] += float((1 - cos).double().sum())

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(i), with_kwargs=True))
    try:
        for batch in rows.split(batch_size):
            model(input_ids=batch.to(model.device))
            tokens += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    return [float(t / tokens) for t in totals]


def most_influential(scores: list[float], keep: int) -> list[int]:
    """The `keep` layers with the largest scores (ties: the earlier layer), in order."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(ranked[:keep])
