"""bitsandbytes int8 without outlier columns, as compressed-tensors W8A8 for vLLM.

Model: LLM.int8() with `threshold: 0` takes no column out to a float path: every linear's
input is quantized per token to int8 (absmax / 127, rounded), multiplied with the int8 weight
(per output channel, absmax / 127) in integer arithmetic, and rescaled. That is compressed-tensors'
`int-quantized` W8A8 scheme (up to rounding, below): weights int8, symmetric, one scale per output channel;
input activations int8, symmetric, dynamic, one scale per token (vLLM's CPU and GPU int8
kernels). The export keeps the variant's int8 codes (`weight`) and writes `SCB / 127` as the
channel scales; the compressed-tensors package's own compressor checks the codes round-trip.
With a positive threshold, bitsandbytes runs the columns of large activations in float16, which
W8A8 cannot express: such a variant is refused.

Rounding: the engines turn an activation into its code differently. bitsandbytes casts it to
float16 and rounds x * (127 / absmax); vLLM's kernels quantize in the model's dtype at
absmax / 127; compressed-tensors' reference (what transformers runs on the export) divides by
absmax / 127.5 and clamps to [-128, 127]. So codes at a rounding boundary can differ by one, and
the same export's logits differ slightly between engines (the tests bound it).
"""

from __future__ import annotations

from typing import Any

import torch

from compress.load_spec import LoadSpec


def outlier_threshold(spec: LoadSpec) -> float | None:
    """A bitsandbytes int8 variant's outlier threshold (None for any other variant)."""
    p = spec.params
    if spec.format == "hf-quantized" and spec.scheme == "bitsandbytes" and p.get("load_in_8bit"):
        return float(p.get("llm_int8_threshold", 6.0))
    return None


def is_w8a8(spec: LoadSpec) -> bool:
    """A bitsandbytes int8 variant without outlier columns."""
    return outlier_threshold(spec) == 0.0


def _scheme(names: list[str]) -> Any:
    """W8A8: int8 weights per output channel, int8 inputs per token (dynamic), symmetric."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=names,
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        input_activations=QuantizationArgs(
            num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
        ),
        format="int-quantized",
    )


def compress_w8a8(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """A bitsandbytes int8 checkpoint's tensors as W8A8 `int-quantized` ones: (tensors,
    quantization_config, the quantized modules)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    names = sorted(k.removesuffix(".SCB") for k in state if k.endswith(".SCB"))
    scheme = _scheme(names)
    out = dict(state)
    for name in names:
        codes, scb = out.pop(f"{name}.weight"), out.pop(f"{name}.SCB").float()
        out.pop(f"{name}.weight_format", None)
        scale = (scb / 127.0).unsqueeze(1)
        module = {"weight": codes.float() * scale, "weight_scale": scale}
        compressed = IntQuantizationCompressor.compress(module, scheme)
        if not torch.equal(compressed["weight"], codes):
            raise ValueError(f"{name}: its int8 codes do not round-trip through W8A8's scales")
        out.update({f"{name}.{k}": v.contiguous() for k, v in compressed.items()})
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="int-quantized",
        quantization_status="compressed",
    )
    return out, config.to_dict(), names
