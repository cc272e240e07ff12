"""GGUF exports: transformers' GGUF loader (the workbench's GGUF import) gives back exactly the
GGML type's dequantization of every weight, the tokenizer and chat template travel, and what
cannot be written is refused naming why."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.export import ExportError, export, packed_weights
from compress.gguf_export import GGUF_FILE
from compress.gguf_pretokenizer import SPLIT_REGEXES, UnknownPreTokenizer, pre_tokenizer_name
from compress.load_spec import read_load_spec
from workbench.cli import main

TEXTS = ["def fibonacci(n):\n    return n", "The capital of France is", "  x = [1, 2]\n"]


def _format_roundtrip(weight: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """What the GGML type keeps of `weight` (norms and 1-D tensors stay float32)."""
    if weight.dim() == 1 or gguf_type == "f32":
        return weight.float()
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    if gguf_type in ("f16", "bf16"):
        return weight.to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[gguf_type])).float()
    data = gguf.quants.quantize(weight.float().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype)))


def _load(out: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(out, gguf_file=GGUF_FILE).eval()


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_gguf_round_trip_gives_the_types_dequantization(
    tiny_model_dir: Path, tmp_path: Path, gguf_type: str
) -> None:
    info = export(tiny_model_dir, "gguf", tmp_path / "out", gguf_type)
    assert info["gguf_type"] == gguf_type and Path(info["path"]).name == GGUF_FILE
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    loaded = _load(tmp_path / "out").state_dict()
    for name, weight in reference.state_dict().items():
        assert torch.equal(loaded[name].float(), _format_roundtrip(weight, gguf_type)), name
    if gguf_type == "f32":
        ids = torch.tensor([[1, 50, 60, 70, 80, 90]])
        with torch.no_grad():
            assert torch.equal(_load(tmp_path / "out")(ids).logits, reference(ids).logits)


def test_gguf_carries_the_tokenizer_and_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    export(tiny_model_dir, "gguf", tmp_path / "out", "q8_0")
    ours = AutoTokenizer.from_pretrained(tiny_model_dir)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file=GGUF_FILE)
    for text in TEXTS:
        assert theirs(text).input_ids == ours(text).input_ids
    reader = gguf.GGUFReader(tmp_path / "out" / GGUF_FILE)
    template = reader.fields["tokenizer.chat_template"]
    assert bytes(template.parts[-1]).decode() == ours.chat_template
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    # demo-tiny's tokenizer splits by GPT-2's byte-level regex: llama.cpp's `gpt-2`
    assert bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"


@pytest.mark.parametrize("variant", ["rtn", "rtn-emb4", "gptq8-g32"])
def test_packed_variant_exports_its_dequantized_codes_or_is_refused_by_architecture(
    built: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """On the tiny Llama: the 4-bit linears (and a 4-bit embedding) as Q4_1, grouped int8 as
    Q8_0, and the float rest as F32, exactly the formats' dequantization of the variant's
    weights. On the tiny Gemma 3: refused, naming what is written, and nothing left behind."""
    source = built[variant]
    if json.loads((source / "config.json").read_text())["model_type"] != "llama":
        with pytest.raises(ExportError, match=r"gemma3_text model cannot be written as GGUF"):
            export(source, "gguf", tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    info = export(source, "gguf", tmp_path / "out")
    coded = "q8_0" if variant == "gptq8-g32" else "q4_1"
    assert info["gguf_type"] == f"f32/{coded}"  # its quantized linears; the float rest stays so
    state, codes = packed_weights(read_load_spec(source))
    quantized = {f"{n}.weight" for n in codes}
    dense = {**state, **{f"{n}.weight": q.dequantize() for n, q in codes.items()}}
    loaded = _load(tmp_path / "out").state_dict()
    assert quantized and ("model.embed_tokens.weight" in quantized) == (variant == "rtn-emb4")
    for name, weight in dense.items():
        if name in loaded:
            kind = coded if name in quantized else "f32"
            assert torch.equal(loaded[name].float(), _format_roundtrip(weight, kind)), name


def test_gguf_type_errors(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ExportError, match="--gguf-type is for --format gguf"):
        export(tiny_model_dir, "hf", tmp_path / "a", "q8_0")
    out = tmp_path / "g"
    assert main(["export", str(tiny_model_dir), "--format", "gguf", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model.gguf" in printed and "F32 (GGUF)" in printed  # a float32 model: its dtype
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'q4_z'"
        main(["export", str(tiny_model_dir), "--format", "gguf", "--gguf-type", "q4_z"])


def _backend(pre: object) -> dict:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    return json.loads(tok.to_str())


def _split_then_bytes(regex: str) -> object:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def test_gguf_names_the_pre_tokenizer_llama_cpp_splits_text_by() -> None:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits = pre_tokenizers.Digits(individual_digits=True)
    cases = {
        "gpt-2": byte_level,
        "smollm": pre_tokenizers.Sequence([digits, byte_level]),
        **{name: _split_then_bytes(regex) for regex, name in SPLIT_REGEXES.items()},
    }
    assert set(cases) == {"gpt-2", "smollm", "llama-bpe", "qwen2"}
    for name, pre in cases.items():
        assert pre_tokenizer_name(_backend(pre)) == name


@pytest.mark.parametrize(
    "pre",
    [
        "leading_space_byte_level",
        "metaspace",
        "split_by_an_unknown_regex",
        "digits_in_runs",
    ],
)
def test_a_pre_tokenizer_llama_cpp_has_no_name_for_is_refused(pre: str) -> None:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    built = {
        "leading_space_byte_level": pre_tokenizers.ByteLevel(add_prefix_space=True),
        "metaspace": pre_tokenizers.Metaspace(),
        "split_by_an_unknown_regex": _split_then_bytes(r"\p{L}+|\p{N}{1,2}"),
        "digits_in_runs": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=False), byte_level]
        ),
    }[pre]
    with pytest.raises(UnknownPreTokenizer, match=r"convert_hf_to_gguf\.py"):
        pre_tokenizer_name(_backend(built))


def _with_tokenizer(tiny_model_dir: Path, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the tiny model whose tokenizer.json `edit` (spec -> None) changed."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    edit(spec)
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return model


def test_an_export_whose_pre_tokenizer_has_no_name_writes_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def leading_space(spec: dict) -> None:
        spec["pre_tokenizer"]["add_prefix_space"] = True

    model = _with_tokenizer(tiny_model_dir, tmp_path, leading_space)
    with pytest.raises(ExportError, match=r"pre-tokenizer .* none of those llama\.cpp"):
        export(model, "gguf", tmp_path / "out", None)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_is_not_bpe_is_refused_as_such_before_its_pre_tokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    def word_level(spec: dict) -> None:
        vocab = spec["model"]["vocab"]
        spec["model"] = {"type": "WordLevel", "vocab": vocab, "unk_token": next(iter(vocab))}
        spec["pre_tokenizer"] = {"type": "Whitespace"}  # no llama.cpp name either: BPE first

    model = _with_tokenizer(tiny_model_dir, tmp_path, word_level)
    with pytest.raises(ExportError, match=r"the tokenizer is WordLevel, not byte-level BPE"):
        export(model, "gguf", tmp_path / "out", None)
    assert not (tmp_path / "out").exists()
