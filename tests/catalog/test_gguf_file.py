"""A GGUF base's layout is checked against the file before any tensor is read: crafted and
truncated files are refused with one line naming the file and the field (issue 67, item 8),
where gguf's reader (transformers' GGUF loader) ended in `ValueError: cannot reshape array`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from catalog import gguf_base
from catalog.gguf_file import BadGGUF, check_gguf

ROOT = Path(__file__).resolve().parents[2]


def _written(path: Path, extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A small llama GGUF from gguf's own writer: a token list, a 1-D and a 2-D tensor, q8_0."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(40)])
    if extra is not None:
        extra(writer)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    embd = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    q8 = gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def written(tmp_path: Path) -> Path:
    return _written(tmp_path / "model.gguf")


def _edit(path: Path, tensor: str, part: int, value: list[int]) -> None:
    """Overwrite one part of a tensor's info in place (gguf's reader, memory-mapped r+):
    parts are [name length, name, n_dims, dimensions, type, offset]."""
    reader = gguf.GGUFReader(path, "r+")
    info = next(t for t in reader.tensors if t.name == tensor)
    info.field.parts[part][:] = value
    reader.data.flush()


def _refusal(path: Path) -> str:
    with pytest.raises(BadGGUF) as caught:
        check_gguf(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_a_written_gguf_has_the_layout_gguf_reads(written: Path) -> None:
    layout = check_gguf(written)
    reader = gguf.GGUFReader(written)
    assert layout.data_start == reader.data_offset and layout.alignment == reader.alignment
    assert [(t.name, t.offset, t.nbytes) for t in layout.tensors] == [
        (t.name, int(t.data_offset) - reader.data_offset, int(t.n_bytes)) for t in reader.tensors
    ]
    assert [t.shape for t in layout.tensors] == [(64,), (64, 8)]


def test_tensor_offset_past_the_end_of_the_file(written: Path) -> None:
    _edit(written, "output_norm.weight", 5, [1 << 40])
    with pytest.raises(ValueError, match="cannot reshape array of size 0"):
        gguf.GGUFReader(written)  # what transformers' loader ended in
    message = _refusal(written)
    assert "tensor 'output_norm.weight' offset: 1,099,511,627,776 + 256 bytes" in message
    assert "ends past the data section" in message


def test_dimensions_whose_product_overflows(written: Path) -> None:
    _edit(written, "token_embd.weight", 3, [1 << 32, 1 << 32])
    with pytest.raises(ValueError, match="cannot reshape array"):
        gguf.GGUFReader(written)
    message = _refusal(written)
    assert "tensor 'token_embd.weight' dimensions: [4294967296, 4294967296]" in message
    assert "overflows int64" in message


def test_dimensions_whose_bytes_pass_the_end_without_overflowing(written: Path) -> None:
    _edit(written, "token_embd.weight", 3, [1 << 31, 1 << 31])
    assert "tensor 'token_embd.weight' offset" in _refusal(written)


@pytest.mark.parametrize("kept", ["header", "metadata", "tensor infos", "tensor data"])
def test_truncated_file(written: Path, kept: str) -> None:
    """Cut inside each part of the file: every cut is refused naming what it cut."""
    layout = check_gguf(written)
    last_info = gguf.GGUFReader(written).tensors[-1].field.offset
    data = written.read_bytes()
    cut = {
        "header": 12,
        "metadata": 200,
        "tensor infos": last_info + 30,
        "tensor data": layout.data_start + layout.tensors[-1].offset + 10,
    }[kept]
    written.write_bytes(data[:cut])
    message = _refusal(written)
    field = {
        "header": "tensor_count",
        "metadata": "metadata",
        "tensor infos": "tensor 'token_embd.weight'",
        "tensor data": "tensor 'token_embd.weight' offset",
    }[kept]
    assert f": {field}" in message, message
    assert "truncated" in message or "do not fit" in message or "past the end" in message


def test_an_empty_file_or_another_format_is_no_gguf(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "magic: the file is empty" in _refusal(tmp_path / "empty.gguf")
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    assert "magic: is not GGUF" in _refusal(tmp_path / "zip.gguf")


def test_a_count_larger_than_the_file_is_refused_before_walking(written: Path) -> None:
    data = bytearray(written.read_bytes())
    data[8:16] = (1 << 60).to_bytes(8, "little")  # tensor_count
    written.write_bytes(bytes(data))
    assert "tensor_count: 1,152,921,504,606,846,976 items" in _refusal(written)


def test_an_unknown_type_or_too_many_dimensions_is_named(tmp_path: Path) -> None:
    typed = _written(tmp_path / "typed.gguf")
    _edit(typed, "token_embd.weight", 4, [99])
    assert "tensor 'token_embd.weight' type: 99 is no GGML type" in _refusal(typed)
    dims = _written(tmp_path / "dims.gguf")
    _edit(dims, "output_norm.weight", 2, [9])
    assert "tensor 'output_norm.weight' n_dims: 9; allowed: 1 to 4" in _refusal(dims)


def test_misaligned_and_overlapping_offsets_are_named(tmp_path: Path) -> None:
    misaligned = _written(tmp_path / "misaligned.gguf")
    _edit(misaligned, "token_embd.weight", 5, [8])
    assert "not a multiple of the alignment 32" in _refusal(misaligned)
    overlapping = _written(tmp_path / "overlapping.gguf")
    _edit(overlapping, "token_embd.weight", 5, [0])
    assert "tensor 'token_embd.weight' offset: 0 overlaps" in _refusal(overlapping)


def test_a_bad_alignment_is_named(tmp_path: Path) -> None:
    path = _written(tmp_path / "aligned.gguf", lambda w: w.add_uint32("general.alignment", 48))
    assert "general.alignment: 48 is not a power of two" in _refusal(path)


def test_ensure_gguf_model_refuses_before_reading_and_leaves_nothing(
    written: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    _edit(written, "output_norm.weight", 5, [1 << 40])
    with pytest.raises(BadGGUF, match=r"tensor 'output_norm\.weight' offset"):
        gguf_base.ensure_gguf_model(written)
    converted = gguf_base.gguf_model_dir(written)
    assert not converted.exists()
    assert [p.name for p in converted.parent.iterdir()] == [f"{converted.name}.lock"]


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["serve", "run"])
def test_crafted_gguf_base_is_one_line_from_the_cli(
    written: Path, tmp_path: Path, command: str
) -> None:
    """`workbench serve crafted.gguf` and `workbench run` of a recipe on it ended in a
    traceback; now exit 2 and one `error:` line naming the file and the field."""
    data_bytes = written.stat().st_size - check_gguf(written).data_start
    _edit(written, "output_norm.weight", 5, [1 << 40])
    (tmp_path / "recipe.yaml").write_text(
        f"name: crafted\nbase: {written}\nvariants:\n  - {{name: base, steps: []}}\n"
    )
    args = (
        [command, str(written), "--port", "1"] if command == "serve" else [command, "recipe.yaml"]
    )
    env = {**os.environ, "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {written}: tensor 'output_norm.weight' offset: 1,099,511,627,776 + 256 bytes "
        f"ends past the data section's {data_bytes:,} bytes: the file is truncated or the "
        "offset is wrong"
    ]
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        p.suffix != ".lock" for p in (tmp_path / "cache" / "gguf").iterdir()
    )
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
