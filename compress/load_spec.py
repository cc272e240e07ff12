"""How an artifact is stored and loaded: one typed `LoadSpec`, read in one place.

Model: a model dir is one of
- `hf`: plain weights; transformers loads it from config.json alone,
- `hf-quantized`: config.json carries a `quantization_config` (bitsandbytes, torchao int8);
  transformers quantizes or reads it itself; compressed-tensors `pack-quantized` (our exports,
  llm-compressor's checkpoints) is read densely by `compress.compressed_tensors_io`, its W8A8
  `int-quantized` (activations quantized per token) by transformers,
- `int4-at-load`: bfloat16 weights plus `workbench_quantization.json`, quantized by torchao's
  int4 CPU tensor when loaded (it cannot be saved as safetensors); its linears then run as
  `compress.packed.PackedLinear4`s over torchao's tensors (the same kernel for small calls).
  Its own dtype is bfloat16 (`own_dtype`: what a load without a dtype gets); asked for another,
  the model is loaded in it and takes those int4 linears
  (`compress.torchao_int4.transplant_int4`), so its embedding, head, norms and rotary frequencies
  are that dtype's, and the int4 products compute in bfloat16 as a packed int4 model's do;
  on a GPU its int4 linears run through tinygemm (`compress.torchao_int4.int4_onto`),
- `packed`: integer codes with scales and zero points (`compress.packed`) for the linears a
  calibrated method (RTN, GPTQ, AWQ, HQQ, a mixed plan) quantized, described by
  `workbench_packed.json`; loaded by building the transformers model from its config and
  swapping in the packed modules (gpt-fast's two phases: quantize offline, swap classes at load).
`compress.load_model.load_model` is what the engine, the evals and the tests call to load one;
nothing else reads these files.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

LOAD_QUANTIZATION = "workbench_quantization.json"
"""Next to bfloat16 weights that are quantized when loaded (torchao's int4 CPU tensor cannot be
saved as safetensors): {"method": "int4-wo", "group_size": G, "skip": [module names]}."""
PACKED = "workbench_packed.json"
"""Next to a packed checkpoint: {"format": "packed", "version": 1, "modules": {name: format},
"embeddings": "int8" | "int4-g32" .. "int4-g256" | null, "tied": bool, "method": ...}."""
PACKED_VERSION = 1
Format = Literal["hf", "hf-quantized", "int4-at-load", "packed"]


@dataclass(frozen=True)
class LoadSpec:
    path: Path
    format: Format
    scheme: str | None = None
    """The quantization method its weights carry (bnb-nf4, int4-wo, gptq, ...), if any."""
    params: dict[str, Any] = field(default_factory=dict)
    """The format's own description (the sidecar file's content, or the quantization_config)."""

    @property
    def module_formats(self) -> dict[str, str]:
        """For `packed`: module name -> `int4-g128` / `int8`."""
        return dict(self.params.get("modules", {}))


def read_load_spec(path: Path) -> LoadSpec:
    """The spec of a local model dir; ValueError naming the file when a sidecar is malformed."""
    for name, fmt in ((PACKED, "packed"), (LOAD_QUANTIZATION, "int4-at-load")):
        sidecar = path / name
        if sidecar.is_file():
            try:
                meta = json.loads(sidecar.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{sidecar}: not JSON ({e}); rebuild the variant") from None
            return _checked(LoadSpec(path, fmt, meta.get("method"), meta), sidecar)  # type: ignore[arg-type]
    config = path / "config.json"
    quant = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if quant:
        return LoadSpec(path, "hf-quantized", quant.get("quant_method"), quant)
    return LoadSpec(path, "hf")


def _checked(spec: LoadSpec, sidecar: Path) -> LoadSpec:
    if spec.format == "int4-at-load" and spec.params.get("method") != "int4-wo":
        raise ValueError(f"{sidecar}: unknown load-time quantization {spec.params.get('method')!r}")
    if spec.format == "packed" and spec.params.get("version") != PACKED_VERSION:
        raise ValueError(
            f"{sidecar}: packed format version {spec.params.get('version')!r}, this workbench "
            f"reads {PACKED_VERSION}; rebuild the variant"
        )
    return spec


BITSANDBYTES_MATMUL_LOGGER = "bitsandbytes.autograd._functions"
"""Logs its dtype cast on every int8 product: 145,000 lines (21 MB) in one demo server's log."""
NO_HUB_KERNELS: dict[str, Any] = {"use_kernels": False}
"""`from_pretrained` keywords for every load here. With the `kernels` package installed (a
dependency of transformers 5.25) transformers swaps kernels from the Hugging Face Hub into a model
loaded with a device map, fetched at load time: offline (HF_HUB_OFFLINE, no network) such a load
fails ("Version 2 of 'kernels-community/rotary' is not available in the local cache", seen on a
CUDA machine), and online it would run code downloaded at run time, with other numerics than the
model's own. A variant must load the same way everywhere, so no load here takes them."""


class _Once(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def log_once(logger_name: str) -> None:
    """From now on, each distinct message of this logger is logged once per process."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _Once) for f in logger.filters):
        logger.addFilter(_Once())


OWN_DTYPES: dict[Format, torch.dtype] = {"int4-at-load": torch.bfloat16}
"""Formats stored in one float dtype that they compute in unless asked for another."""


def own_dtype(source: str | Path) -> torch.dtype | None:
    """The float dtype an artifact is stored and computes in when nobody asks for another
    (int4-wo: bfloat16); None: any (float32 is the default)."""
    path = Path(source)
    return OWN_DTYPES.get(read_load_spec(path).format) if path.is_dir() else None
