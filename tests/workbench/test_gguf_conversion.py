"""GGUF conversion parses each file once: the shared reader and name maps change nothing but the
time (the same files written), and they are gguf's own again after the conversion."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from catalog import gguf_base


def _tiny_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"t{i}" for i in range(100)])
    writer.add_tensor("token_embd.weight", __import__("numpy").ones((4, 8), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_within_the_block_a_file_is_parsed_once_and_gguf_is_restored_after(tmp_path: Path) -> None:
    import gguf

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_base.gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file, named either way
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2
        )
        tokens = first.fields["tokenizer.ggml.tokens"]
        assert [bytes(tokens.parts[i]).decode() for i in tokens.data][-1] == "t99"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


@pytest.mark.slow  # two conversions of SmolLM2-135M: ~22 s
def test_smollm2_converts_to_the_same_files_with_its_gguf_parsed_once(tmp_path: Path) -> None:
    path = gguf_base.named_gguf_path("smollm2-135m")
    gguf_base.convert_gguf(path, tmp_path / "once")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_base, "gguf_parsed_once", contextlib.nullcontext)
        gguf_base.convert_gguf(path, tmp_path / "each-time")
    files = sorted(p.name for p in (tmp_path / "once").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "each-time").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    for name in files:
        assert (tmp_path / "once" / name).read_bytes() == (
            tmp_path / "each-time" / name
        ).read_bytes()
