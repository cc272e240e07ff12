"""A variant gets its base's tokenizer and templates, never the base's weights, config, manifest
or the records of how the base dir itself was built."""

from __future__ import annotations

from pathlib import Path

from catalog.gguf_base import GGUF_INFO
from catalog.train import BUILD_INFO
from compress.artifact import MANIFEST, copy_side_files


def test_side_files_leave_weights_config_and_build_records_behind(tmp_path: Path) -> None:
    src, dst = tmp_path / "base", tmp_path / "variant"
    src.mkdir()
    dst.mkdir()
    names = [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        MANIFEST,
        BUILD_INFO,
        GGUF_INFO,
        ".lock",
    ]
    for name in names:
        (src / name).write_text("x")
    copy_side_files(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
