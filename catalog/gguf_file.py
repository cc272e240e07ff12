"""A GGUF file's layout, checked against the file before any tensor is read.

Model: a GGUF file is a header (magic, version, tensor and key-value counts), the key-value
metadata, one info per tensor (name, dimensions, GGML type, offset into the data section), then
the data section at the next multiple of `general.alignment`. Readers (gguf's `GGUFReader`,
which transformers' loader uses) trust every count, size and offset, so a crafted or truncated
file ends in numpy's `cannot reshape array of size 0`, or worse. `check_gguf` walks the same
structure with every read bounded by the file's size: each count must fit in the bytes left,
each tensor's element count in int64, its bytes inside the data section, aligned and not
overlapping another's. Its refusal (`BadGGUF`) is one line naming the file and the field.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf

MAX_DIMS = 4
"""GGML's GGML_MAX_DIMS: llama.cpp refuses a tensor of more dimensions."""
MAX_NESTING = 8
"""Arrays of arrays a metadata value may nest (llama.cpp's files use one level)."""
INT64_MAX = (1 << 63) - 1
_SCALARS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


class BadGGUF(ValueError):
    """A GGUF file whose layout does not fit the file: one line, naming the file and field."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """GGML order: the first dimension is the contiguous one."""
    ggml_type: gguf.GGMLQuantizationType
    offset: int
    """Into the data section."""
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    alignment: int
    data_start: int
    """Where the data section begins in the file."""
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    """Reads of a mapped file that never pass its end: past it, `BadGGUF` naming the field."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.path, self.pos, self.order = data, path, 0, "<"

    def refuse(self, field: str, problem: str) -> BadGGUF:
        return BadGGUF(f"{self.path}: {field}: {problem}")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, size: int, field: str) -> bytes:
        if size > self.left:
            raise self.refuse(
                field,
                f"needs {size:,} bytes at offset {self.pos:,}, past the end of the file "
                f"({len(self.data):,} bytes): the file is truncated or not a GGUF file",
            )
        self.pos += size
        return self.data[self.pos - size : self.pos]

    def scalar(self, code: str, field: str) -> int | float | bool:
        fmt = self.order + code
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]
        return value

    def count(self, field: str, least_bytes_each: int) -> int:
        """A u64 count of items of at least `least_bytes_each` bytes, which the file can hold."""
        n = int(self.scalar("Q", field))
        if n * least_bytes_each > self.left:
            raise self.refuse(
                field,
                f"{n:,} items of at least {least_bytes_each} bytes do not fit in the "
                f"{self.left:,} bytes left in the file",
            )
        return n

    def string(self, field: str) -> str:
        raw = self.take(self.count(field, 1), field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.refuse(field, f"is not UTF-8 ({e})") from None


def check_gguf(path: Path) -> GGUFLayout:
    """The layout of the GGUF file at `path`; BadGGUF naming the first field that does not fit."""
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise BadGGUF(f"{path}: magic: the file is empty, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _layout(_Cursor(data, path))


def _layout(cur: _Cursor) -> GGUFLayout:
    version = _header(cur)
    tensor_count = cur.count("tensor_count", 8 + 4 + 8 + 4 + 8)
    kv_count = cur.count("kv_count", 8 + 4 + 1)
    alignment = _metadata(cur, kv_count)
    infos = [_tensor_info(cur, i) for i in range(tensor_count)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _placed(cur, infos, alignment, data_start)
    return GGUFLayout(version, alignment, data_start, tensors)


def _header(cur: _Cursor) -> int:
    """The version (byte order from it, as gguf's reader reads it)."""
    if cur.take(4, "magic") != struct.pack("<I", gguf.GGUF_MAGIC):
        raise cur.refuse("magic", "is not GGUF: not a GGUF file")
    version = int(cur.scalar("I", "version"))
    if version & 0xFFFF == 0:  # written for the other byte order
        cur.order, version = ">", int.from_bytes(struct.pack("<I", version), "big")
    if version not in (2, 3):
        raise cur.refuse("version", f"{version} is not a GGUF version this reader takes (2, 3)")
    return version


def _metadata(cur: _Cursor, kv_count: int) -> int:
    """Walks every key-value pair; the alignment, checked."""
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = cur.string(f"metadata key {i}")
        value_type = _value_type(cur, f"metadata {key!r} type")
        value = _value(cur, value_type, f"metadata {key!r}", 0)
        if key == gguf.Keys.General.ALIGNMENT:
            alignment = _alignment(cur, value_type, value)
    return alignment


def _alignment(cur: _Cursor, value_type: gguf.GGUFValueType, value: object) -> int:
    field = gguf.Keys.General.ALIGNMENT
    if value_type != gguf.GGUFValueType.UINT32:
        raise cur.refuse(field, f"is of type {value_type.name}, not UINT32")
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise cur.refuse(field, f"{value} is not a power of two")
    return value


def _value_type(cur: _Cursor, field: str) -> gguf.GGUFValueType:
    raw = int(cur.scalar("I", field))
    try:
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise cur.refuse(field, f"{raw} is no GGUF value type") from None


def _value(cur: _Cursor, value_type: gguf.GGUFValueType, field: str, depth: int) -> object:
    """A scalar's value; strings and arrays are walked (their contents are not kept)."""
    if value_type in _SCALARS:
        return cur.scalar(_SCALARS[value_type], field)
    if value_type == gguf.GGUFValueType.STRING:
        return cur.string(field)
    if depth >= MAX_NESTING:
        raise cur.refuse(field, f"nests arrays more than {MAX_NESTING} deep")
    item_type = _value_type(cur, f"{field} item type")
    if item_type in _SCALARS:
        size = struct.calcsize(_SCALARS[item_type])
        cur.take(cur.count(f"{field} length", size) * size, field)
        return None
    least = 8 if item_type == gguf.GGUFValueType.STRING else 4 + 8
    for i in range(cur.count(f"{field} length", least)):
        _value(cur, item_type, f"{field}[{i}]", depth + 1)
    return None


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor {index} name")
    field = f"tensor {name!r}"
    n_dims = int(cur.scalar("I", f"{field} n_dims"))
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.refuse(f"{field} n_dims", f"{n_dims}; allowed: 1 to {MAX_DIMS}")
    shape = tuple(int(cur.scalar("Q", f"{field} dimensions")) for _ in range(n_dims))
    ggml_type = int(cur.scalar("I", f"{field} type"))
    offset = int(cur.scalar("Q", f"{field} offset"))
    return name, shape, ggml_type, offset


def _placed(
    cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], alignment: int, start: int
) -> tuple[TensorInfo, ...]:
    """Each tensor sized and placed inside the data section: aligned, in bounds, disjoint."""
    data_size = len(cur.data) - start
    if data_size < 0:
        raise cur.refuse(
            "data section", f"starts at {start:,}, past the end of the file: it is truncated"
        )
    tensors = [_sized(cur, *info) for info in infos]
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise cur.refuse(f"tensor {t.name!r}", "is named twice")
        seen.add(t.name)
    end = 0
    for t in sorted(tensors, key=lambda t: t.offset):
        field = f"tensor {t.name!r} offset"
        if t.offset % alignment:
            raise cur.refuse(field, f"{t.offset:,} is not a multiple of the alignment {alignment}")
        if t.offset + t.nbytes > data_size:
            raise cur.refuse(
                field,
                f"{t.offset:,} + {t.nbytes:,} bytes ends past the data section's "
                f"{data_size:,} bytes: the file is truncated or the offset is wrong",
            )
        if t.offset < end:
            raise cur.refuse(field, f"{t.offset:,} overlaps the tensor before it (ends at {end:,})")
        end = t.offset + t.nbytes
    return tuple(tensors)


def _sized(
    cur: _Cursor, name: str, shape: tuple[int, ...], raw_type: int, offset: int
) -> TensorInfo:
    field = f"tensor {name!r}"
    try:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise cur.refuse(f"{field} type", f"{raw_type} is no GGML type") from None
    elements = 1
    for dim in shape:
        elements *= dim
    if elements > INT64_MAX or any(d > INT64_MAX for d in shape):
        raise cur.refuse(
            f"{field} dimensions", f"{list(shape)}: their product overflows int64 ({elements:,})"
        )
    if shape[0] % block:
        raise cur.refuse(
            f"{field} dimensions",
            f"the first, {shape[0]:,}, is not a multiple of {ggml_type.name}'s block of {block}",
        )
    return TensorInfo(name, shape, ggml_type, offset, elements // block * block_bytes)
