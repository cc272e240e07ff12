"""A PEFT adapter exported as a GGUF LoRA file: llama.cpp's arithmetic on it (each adapted
weight plus `alpha / r * B A`, under the base export's tensor names and layout) gives the GGUF
export of the adapter merged into its base, whatever PEFT's per-module scaling (rank and alpha
patterns, rsLoRA); what GGUF LoRA cannot hold is refused, naming why."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from compress.export import ExportError, export
from compress.gguf_export import GGUF_FILE
from compress.gguf_lora import LORA_FILE
from workbench.cli import main

TARGETS = ["q_proj", "k_proj", "v_proj", "down_proj"]


def make_adapter(base: Path, out: Path, **lora: object) -> Path:
    """A PEFT adapter on `base` with random A and B (B is zero when PEFT initialises it)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **lora)  # type: ignore[arg-type]
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    peft.save_pretrained(out)
    return out


def tensors(path: Path) -> dict[str, np.ndarray]:
    """A GGUF file's tensors (float32 files: no dequantization needed), by GGUF name."""
    return {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}


def field(path: Path, key: str) -> object:
    return gguf.GGUFReader(path).get_field(key).contents()


def merged_export(base: Path, adapter: Path, out: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    shutil.copytree(base, out / "src", ignore=shutil.ignore_patterns("*.safetensors"))
    merged.save_pretrained(out / "src")
    export(out / "src", "gguf", out / "gguf", "f32")
    return out / "gguf" / GGUF_FILE


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"rank_pattern": {"k_proj": 2}, "alpha_pattern": {"down_proj": 3}},
        {"use_rslora": True, "rank_pattern": {"v_proj": 8}},
    ],
    ids=["plain", "patterns", "rslora"],
)
def test_llama_cpp_arithmetic_on_the_gguf_lora_gives_the_merged_models_export(
    tiny_model_dir: Path, tmp_path: Path, lora: dict
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", **lora)
    info = export(adapter, "gguf", tmp_path / "out")
    lora_file = Path(info["path"])
    assert lora_file.name == LORA_FILE and info["base"] == str(tiny_model_dir)
    assert field(lora_file, "general.type") == "adapter"
    assert field(lora_file, "adapter.type") == "lora"
    assert field(lora_file, "general.architecture") == "llama"
    alpha = field(lora_file, "adapter.lora.alpha")
    assert alpha == 8.0
    export(tiny_model_dir, "gguf", tmp_path / "base", "f32")
    base = tensors(tmp_path / "base" / GGUF_FILE)
    want = tensors(merged_export(tiny_model_dir, adapter, tmp_path / "merged"))
    pairs = tensors(lora_file)
    adapted = {n.removesuffix(".lora_a") for n in pairs if n.endswith(".lora_a")}
    assert len(adapted) == 2 * len(TARGETS) and len(pairs) == 2 * len(adapted)  # 2 layers
    for name, weight in base.items():
        if name in adapted:
            a, b = pairs[f"{name}.lora_a"], pairs[f"{name}.lora_b"]
            rank = b.shape[1]  # llama.cpp: ne[0] of B, its inner dimension
            weight = weight + alpha / rank * (b @ a)
        np.testing.assert_allclose(weight, want[name], atol=2e-6, err_msg=name)


def test_an_f16_gguf_lora_rounds_a_and_b_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    info = export(adapter, "gguf", tmp_path / "out", "f16")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(info["path"]).tensors}
    assert kinds == {"F16"} and info["schemes"] == {"F16 (GGUF LoRA)": ["16 tensors"]}


BAD = {
    "dora": ({"use_dora": True}, "a DoRA adapter cannot be written as GGUF LoRA"),
    "biases": ({"bias": "lora_only"}, "trains biases (bias='lora_only')"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_gguf_lora_cannot_hold_is_refused_and_nothing_is_written(
    tiny_model_dir: Path, tmp_path: Path, case: str
) -> None:
    lora, words = BAD[case]
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", **lora)
    with pytest.raises(ExportError) as info:
        export(adapter, "gguf", tmp_path / "out")
    assert words in str(info.value)
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out*")) == []


def test_an_adapter_exports_to_gguf_only_and_in_the_types_llama_cpp_reads(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    with pytest.raises(ExportError, match=r"an adapter is a PEFT dir already .* not hf"):
        export(adapter, "hf", tmp_path / "out")
    with pytest.raises(ExportError, match="found 'q4_0'; an adapter is written in f32, f16"):
        export(adapter, "gguf", tmp_path / "out", "q4_0")
    (adapter / "adapter_config.json").write_text(
        (adapter / "adapter_config.json").read_text().replace(str(tiny_model_dir), "/nowhere")
    )
    assert main(["export", str(adapter), "--format", "gguf", "--out", str(tmp_path / "o")]) == 2
    assert "its base model dir is not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
