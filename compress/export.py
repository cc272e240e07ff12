"""Exporting a variant to the formats other engines load.

- `hf`: a plain transformers checkpoint of dense float weights (a packed variant's codes
  dequantized, `(q - z) * s`): loads anywhere, at float size.
- `compressed-tensors`: a bitsandbytes int8 variant without outlier columns (`threshold: 0`) as
  `int-quantized` W8A8 (`compress.w8a8`); otherwise `pack-quantized`, the format llm-compressor
  writes and transformers and vLLM load: every packed linear keeps its codes, scales and zero
  points, re-expressed in the format's signed convention (code - 2^(bits-1), zero point -
  2^(bits-1)) and packed by the `compressed-tensors` package's own compressor; one config group
  per (bits, group size, symmetric) with the module names as targets, so a mixed plan keeps each
  module's format. A quantized embedding's rows are written dequantized (the format quantizes
  linears only).
- `gguf`: one GGUF file for llama.cpp (`compress.gguf_export`): what the variant quantized in a
  GGML type of its bits (4-bit -> Q4_1, 8-bit -> Q8_0), the rest in its float dtype, or every
  2-D weight in `gguf_type` (a K-quant such as q4_k_m: the float file handed to llama.cpp's
  quantizer, `compress.gguf_kquants`); tokenizer and chat template in its metadata. Packed
  variants, float ones and int4-wo (whose bfloat16 weights torchao quantizes at load) export to
  it. An adapter exports to it as a GGUF LoRA file (`compress.gguf_lora`) for llama.cpp's
  `--lora`.
Contract: the export dir appears whole or not at all (written beside it and renamed last); a
variant whose storage the format cannot express is refused, naming why and what it can export to;
a write that fails (a full disk, a file size limit) is one `ExportError` naming the file and the
cause, and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from compress.artifact import atomic_dir
from compress.gguf_kquants import K_QUANTS, QuantizerError, find_quantizer, quantize, tensor_types
from compress.load_spec import PACKED, LoadSpec, read_load_spec
from compress.packed import PackedFormat, Quantized
from compress.packed_io import (
    SUFFIXES,
    WEIGHTS,
    read_tensors,
    stored_embedding_format,
    take_quantized,
)
from compress.w8a8 import compress_w8a8, is_w8a8, outlier_threshold

ExportFormat = Literal["hf", "compressed-tensors", "gguf"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("hf", "compressed-tensors", "gguf")
_NOT_COPIED = {WEIGHTS, PACKED, "workbench.json", "config.json"}


class ExportError(ValueError):
    """A variant that cannot be exported as asked; the message names why and the fix."""


class ExportWriteError(ExportError, OSError):
    """A write of the export failed (a full disk, a file size limit): an export refusal, and
    still the OSError it was."""


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Within the block `path` (where the file will be once the export is complete) is being
    written: a failed write becomes ExportWriteError naming it and the cause (numpy's short
    write carries no errno, safetensors' error is no OSError)."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        cause = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if " requested and " in cause:  # `tofile`: "57600 requested and 3808 written"
            cause = f"a short write ({cause}): the disk is full or a file size limit was reached"
        raise ExportWriteError(
            f"{path}: the write failed: {cause}; nothing was written{_free_space(path)}"
        ) from None


def _free_space(path: Path) -> str:
    try:
        return f" ({shutil.disk_usage(path.parent.parent).free / 1e6:,.0f} MB free there)"
    except OSError:
        return ""


def exports_of(spec: LoadSpec) -> tuple[ExportFormat, ...]:
    """The formats a stored variant can be exported to."""
    if is_w8a8(spec):
        return ("compressed-tensors",)
    if spec.format == "packed":
        return EXPORT_FORMATS
    if spec.format == "hf":
        return ("hf", "gguf")
    if spec.format == "int4-at-load":
        return ("gguf",)
    return ()


def export(
    source: Path,
    fmt: str,
    out: Path,
    gguf_type: str | None = None,
    llama_quantize: str | None = None,
) -> dict[str, Any]:
    """Write `source` (a variant dir) as `fmt` into `out` (which must not exist); returns what
    was written: format, layout (compressed-tensors: pack-quantized or int-quantized), files,
    bytes, and per scheme the modules it holds (for gguf: tensors per GGML type). `gguf_type`:
    the GGML type of a gguf export's weights (a K-quant runs llama.cpp's quantizer:
    `llama_quantize`, see `compress.gguf_kquants`)."""
    if (source / "adapter_config.json").is_file():
        if gguf_type in K_QUANTS:
            raise ExportError(
                f"--gguf-type {gguf_type}: llama.cpp quantizes models, not LoRA files; a GGUF "
                "LoRA is f32, f16, bf16 or q8_0"
            )
        return _export_adapter(source, fmt, out, gguf_type)
    spec = _checked(source, fmt, out)
    if gguf_type is not None and fmt != "gguf":
        raise ExportError(f"--gguf-type is for --format gguf, not {fmt}")
    if fmt == "gguf":
        return _export_gguf(spec, out, gguf_type, llama_quantize)
    with atomic_dir(out) as tmp:
        config = json.loads((source / "config.json").read_text())
        state, codes = (
            packed_weights(spec) if spec.format == "packed" else (read_tensors(source), {})
        )
        schemes: dict[str, list[str]] = {}
        if fmt == "compressed-tensors" and is_w8a8(spec):
            state, config["quantization_config"], names = compress_w8a8(state)
            schemes = {"w8a8-int8-channel-token": names}
        elif fmt == "compressed-tensors":
            config["quantization_config"], schemes = _compress(spec, state, codes)
        for name, qw in codes.items():  # all for hf; the quantized embedding for compressed-tensors
            state[f"{name}.weight"] = qw.dequantize().contiguous()
        with writing(out / WEIGHTS):
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        with writing(out / "config.json"):
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in _NOT_COPIED:
                with writing(out / f.name):
                    shutil.copy2(f, tmp / f.name)
    files = sorted(p.name for p in out.iterdir())
    size = sum((out / f).stat().st_size for f in files)
    layout = config["quantization_config"]["format"] if fmt == "compressed-tensors" else None
    return {
        "format": fmt,
        "layout": layout,
        "path": str(out),
        "files": files,
        "bytes": size,
        "schemes": schemes,
    }


def _export_gguf(
    spec: LoadSpec, out: Path, gguf_type: str | None, llama_quantize: str | None
) -> dict[str, Any]:
    from compress.gguf_export import (
        GGUF_FILE,
        GGUF_TYPES,
        GgufExportError,
        float_type,
        write_gguf,
    )

    quantizer = None
    if gguf_type in K_QUANTS:  # found before anything is written
        try:
            quantizer = find_quantizer(llama_quantize)
        except QuantizerError as e:
            raise ExportError(
                f"--gguf-type {gguf_type}: {e}; or pick a type the exporter writes itself: "
                f"{', '.join(GGUF_TYPES)}"
            ) from None
    types: dict[str, str] = {}  # the weights the variant quantized, in a type of its bits
    if spec.format == "packed":
        state, codes = packed_weights(spec)
        for name, qw in codes.items():
            state[f"{name}.weight"] = qw.dequantize()
            name_of = spec.module_formats.get(name)
            fmt = PackedFormat.parse(name_of) if name_of else stored_embedding_format(spec)
            types[f"{name}.weight"] = "q4_1" if fmt and fmt.bits == 4 else "q8_0"
    else:
        state = read_tensors(spec.path)
        if spec.format == "int4-at-load":
            skip = tuple(f"{m}.weight" for m in spec.params.get("skip", []))
            types = {
                k: "q4_1"
                for k, t in state.items()
                if t.dim() == 2 and k.endswith(".weight") and "embed" not in k and k not in skip
            }
    rest = float_type(state)
    if quantizer is not None:  # a K-quant's input: every weight in the variant's float dtype
        types = {}
    elif gguf_type is not None:  # one type for every 2-D weight
        types, rest = {}, gguf_type
    with atomic_dir(out) as tmp:
        written = tmp / (GGUF_FILE if quantizer is None else "float.gguf")
        try:
            with writing(out / written.name):
                counts = write_gguf(spec.path, state, types, rest, written)
            if quantizer is not None:
                assert gguf_type is not None
                quantize(quantizer, written, tmp / GGUF_FILE, gguf_type)
                written.unlink()
                counts = tensor_types(tmp / GGUF_FILE)
        except (GgufExportError, QuantizerError) as e:
            raise ExportError(str(e)) from None
    size = (out / GGUF_FILE).stat().st_size
    return {
        "format": "gguf",
        "path": str(out / GGUF_FILE),
        "files": [GGUF_FILE],
        "bytes": size,
        "schemes": {f"{t} (GGUF)": [f"{n} tensors"] for t, n in counts.items()},
        "gguf_type": gguf_type or "/".join(sorted({rest, *types.values()})),
    }


def _export_adapter(source: Path, fmt: str, out: Path, gguf_type: str | None) -> dict[str, Any]:
    """A PEFT LoRA adapter as a GGUF LoRA file (`compress.gguf_lora`), for llama.cpp's `--lora`
    on the GGUF export of its base."""
    from compress.gguf_export import GgufExportError
    from compress.gguf_lora import LORA_FILE, write_gguf_lora

    if fmt != "gguf":
        raise ExportError(
            f"{source}: an adapter is a PEFT dir already (vLLM --enable-lora, transformers and "
            f"PEFT load it as it is); it exports to gguf (GGUF LoRA for llama.cpp), not {fmt}"
        )
    if out.exists():
        raise ExportError(f"--out: {out} exists; remove it or pass another --out")
    base = _adapter_base(source)
    with atomic_dir(out) as tmp:
        try:
            with writing(out / LORA_FILE):
                counts = write_gguf_lora(source, base, gguf_type or "f32", tmp / LORA_FILE)
        except GgufExportError as e:
            raise ExportError(str(e)) from None
    return {
        "format": "gguf",
        "path": str(out / LORA_FILE),
        "files": [LORA_FILE],
        "bytes": (out / LORA_FILE).stat().st_size,
        "schemes": {f"{t} (GGUF LoRA)": [f"{n} tensors"] for t, n in counts.items()},
        "gguf_type": gguf_type or "f32",
        "base": str(base),
    }


def _adapter_base(source: Path) -> Path:
    """The model dir an adapter was trained on: its manifest's parent, else its PEFT config's
    `base_model_name_or_path` when that is a local dir."""
    from compress.artifact import artifact_from_manifest

    base = artifact_from_manifest(source).base
    if base is None:
        named = json.loads((source / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
        base = Path(named) if named and Path(named, "config.json").is_file() else None
    if base is None or not (base / "config.json").is_file():
        raise ExportError(
            f"{source}: its base model dir is not found (neither its workbench.json's parent "
            "nor adapter_config.json's base_model_name_or_path is a local model dir); the "
            "GGUF LoRA needs the base's architecture"
        )
    return base


def _checked(source: Path, fmt: str, out: Path) -> LoadSpec:
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"--format: found {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if not (source / "config.json").is_file():
        raise ExportError(
            f"{source}: not a variant dir (no config.json); pass a dir under "
            "runs/<recipe>/variants/"
        )
    if out.exists():
        raise ExportError(f"--out: {out} exists; remove it or pass another --out")
    try:
        spec = read_load_spec(source)
    except ValueError as e:
        raise ExportError(str(e)) from None
    allowed = exports_of(spec)
    if fmt not in allowed:
        kind = f"{spec.format} ({spec.scheme})" if spec.scheme else spec.format
        can = f"it exports to {', '.join(allowed)}" if allowed else "it exports to nothing yet"
        threshold = outlier_threshold(spec)
        why = (
            f"; its outlier columns (activations above {threshold}) run in float16, which "
            "compressed-tensors' W8A8 cannot express: quantize with "
            "{method: bnb-int8, threshold: 0} (W8A8, exports to compressed-tensors)"
            if threshold
            else ""
        )
        raise ExportError(
            f"{source}: a {kind} variant cannot be exported as {fmt}: {can}{why}; the packed "
            "variants (rtn, gptq, awq, hqq, mixed) export to hf, compressed-tensors and gguf, "
            "float and int4-wo variants to gguf, bnb-int8 with threshold 0 to compressed-tensors"
        )
    return spec


def packed_weights(spec: LoadSpec) -> tuple[dict[str, torch.Tensor], dict[str, Quantized]]:
    """A packed checkpoint's float tensors and, per coded module (a quantized embedding included),
    its codes; the coded modules' keys are removed from the float tensors."""
    state = read_tensors(spec.path)
    coded = {n: PackedFormat.parse(f).bits for n, f in spec.module_formats.items()}
    embed_fmt = stored_embedding_format(spec)
    if embed_fmt is not None:
        embedding = next(k[: -len(".qweight")] for k in state if _is_embedding_codes(k, coded))
        coded[embedding] = embed_fmt.bits
    codes = {n: take_quantized(state, n, bits, torch.device("cpu")) for n, bits in coded.items()}
    assert not any(k.endswith(SUFFIXES) for k in state), "left-over codes"
    return state, codes


def _is_embedding_codes(key: str, linears: dict[str, int]) -> bool:
    return key.endswith(".qweight") and key[: -len(".qweight")] not in linears


def _compress(
    spec: LoadSpec, state: dict[str, torch.Tensor], codes: dict[str, Quantized]
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Each packed linear's codes as pack-quantized tensors added to `state` (and popped from
    `codes`); returns the quantization_config and, per scheme, its modules."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    by_scheme: dict[tuple[int, int | None, bool], list[str]] = defaultdict(list)
    for name, fmt_name in sorted(spec.module_formats.items()):
        fmt, qw = PackedFormat.parse(fmt_name), codes[name]
        _check_integer_zeros(spec, name, qw)
        symmetric = bool((qw.zeros == 2 ** (fmt.bits - 1)).all())
        by_scheme[(fmt.bits, fmt.group_size, symmetric)].append(name)
    groups: dict[str, QuantizationScheme] = {}
    described: dict[str, list[str]] = {}
    for i, ((bits, group_size, sym), names) in enumerate(sorted(by_scheme.items(), key=str)):
        args = QuantizationArgs(
            num_bits=bits,
            type="int",
            symmetric=sym,
            strategy="group" if group_size else "channel",
            group_size=group_size,
        )
        scheme = QuantizationScheme(targets=names, weights=args, format="pack-quantized")
        groups[f"group_{i}"] = scheme
        described[
            f"int{bits}" + (f"-g{group_size}" if group_size else "") + ("-sym" if sym else "-asym")
        ] = names
        for name in names:
            qw = codes.pop(name)
            module = {  # the compressor re-derives the signed codes from the weight
                "weight": qw.dequantize(),
                "weight_scale": qw.scales.clone(),
                "weight_zero_point": (qw.zeros - 2 ** (bits - 1)).to(torch.int8),
            }
            compressed = PackedQuantizationCompressor.compress(module, scheme)
            state.update({f"{name}.{k}": v.contiguous() for k, v in compressed.items()})
    config = QuantizationConfig(
        config_groups=groups, format="pack-quantized", quantization_status="compressed"
    )
    return config.to_dict(), described


def _check_integer_zeros(spec: LoadSpec, name: str, qw: Quantized) -> None:
    if not torch.equal(qw.zeros, qw.zeros.round()):
        raise ExportError(
            f"{spec.path}: {name} has float zero points (the {spec.scheme} method fits them); "
            "compressed-tensors' pack-quantized stores integer zero points only: export it "
            "as hf (dense float weights), or quantize with rtn, gptq or awq"
        )
