"""Load an artifact as a transformers model, by the `LoadSpec` its dir declares: one loader
per format (`compress.load_spec` reads the format; `compress.packed_io`, `compress.torchao_int4`
and `compress.compressed_tensors_io` are the loaders this dispatches to)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compress.load_spec import (
    BITSANDBYTES_MATMUL_LOGGER,
    NO_HUB_KERNELS,
    OWN_DTYPES,
    LoadSpec,
    log_once,
    read_load_spec,
)


def load_model(
    source: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> Any:
    """The transformers model an artifact dir (or hub id) holds, on `device`, in eval mode, its
    float weights and activations in `dtype` (None: the artifact's `own_dtype`, else float32)."""
    from transformers import AutoModelForCausalLM

    path = Path(source)
    spec = read_load_spec(path) if path.is_dir() else LoadSpec(path, "hf")
    dtype = dtype or OWN_DTYPES.get(spec.format, torch.float32)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if spec.format == "packed":
        from compress.packed_io import load_packed

        return load_packed(spec, dtype, torch.device(device), extra).eval()
    if (
        spec.format == "hf-quantized"
        and spec.scheme == "compressed-tensors"
        and spec.params.get("format") == "pack-quantized"
    ):
        from compress.compressed_tensors_io import load_dense

        return load_dense(path, dtype, extra).to(device).eval()
    kwargs: dict[str, Any] = {"dtype": dtype, **NO_HUB_KERNELS, **extra}
    if spec.format == "int4-at-load":
        from compress.torchao_int4 import int4_onto

        return int4_onto(_int4_model(path, spec, kwargs), torch.device(device))
    if spec.format == "hf-quantized":
        kwargs["device_map"] = str(device)
        log_once(BITSANDBYTES_MATMUL_LOGGER)
    source = str(path) if path.exists() else str(source)
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if spec.format == "hf":
        model.to(device)  # type: ignore[arg-type]  # transformers types its `to` wrapper oddly
    if spec.scheme == "compressed-tensors":  # W8A8 (pack-quantized went to load_dense above)
        _decompress_now(model, spec)
    return model.eval()


def _int4_at_load(spec: LoadSpec) -> dict[str, Any]:
    """`from_pretrained` keywords that quantize the bfloat16 weights as they load (torchao)."""
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from transformers import TorchAoConfig

    config = TorchAoConfig(
        PrototypeInt4WeightOnlyConfig(group_size=spec.params["group_size"]),
        modules_to_not_convert=spec.params["skip"],
    )
    return {"quantization_config": config, "dtype": torch.bfloat16, "device_map": "cpu"}


def _int4_model(path: Path, spec: LoadSpec, kwargs: dict[str, Any]) -> Any:
    """The model quantized as it loads in bfloat16; in another dtype the same model is loaded
    in it a second time and takes the int4 linears of the first."""
    from transformers import AutoModelForCausalLM

    from compress.torchao_int4 import adopt_torchao_int4, transplant_int4

    quantized = AutoModelForCausalLM.from_pretrained(str(path), **{**kwargs, **_int4_at_load(spec)})
    adopt_torchao_int4(quantized)
    if kwargs["dtype"] == torch.bfloat16:
        return quantized.eval()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    transplant_int4(quantized, model, kwargs["dtype"])
    return model.eval()


def _decompress_now(model: Any, spec: LoadSpec) -> None:
    """transformers leaves a compressed-tensors model compressed, with a hook that decompresses
    it at the first forward: that would run inside the engine's first step (with its attention
    and linears already swapped in). Decompress at load instead; the hooks that round W8A8's
    inputs stay."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(spec.params)
    ModelCompressor(quantization_config=config).decompress_model(model)
