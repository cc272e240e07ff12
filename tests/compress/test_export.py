"""Exports of the packed variants: transformers loads each (no workbench code) with the variant's
own weights; compressed-tensors keeps the codes 4/8-bit with the format per module; what a format
cannot express is refused, naming why, and leaves nothing behind.

transformers 5.24 with compressed-tensors 0.20.1 loads a symmetric export with a plain
`from_pretrained`, and an asymmetric one of a single scheme with
`CompressedTensorsConfig(dequantize=True)` (its plain route allocates the packed zero points
unpacked and drops them; its dequantizing route gives every dense module the first config
group's scheme, so a mixed plan's export loads in neither): the workbench's own reader
(`compress.compressed_tensors_io`) loads them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress import export as export_mod
from compress.export import ExportError, export, packed_weights
from compress.load_model import load_model
from compress.load_spec import read_load_spec
from workbench.cli import main

CT_EXPORTABLE = ("rtn", "rtn-sym", "rtn-emb4", "gptq", "gptq8", "gptq8-g32", "awq", "mixed")


def _logits(path: Path, rows: torch.Tensor, dequantize: bool = False) -> torch.Tensor:
    from transformers import CompressedTensorsConfig

    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    with torch.no_grad():
        return model(rows).logits


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))


def test_hf_export_holds_the_dequantized_codes(built: dict[str, Path], tmp_path: Path) -> None:
    for name in ("rtn", "gptq8", "rtn-emb4"):
        out = tmp_path / name
        export(built[name], "hf", out)
        assert read_load_spec(out).format == "hf"
        dense = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        _, codes = packed_weights(read_load_spec(built[name]))
        for module, qw in codes.items():
            assert torch.equal(dense[f"{module}.weight"], qw.dequantize()), (name, module)


def test_compressed_tensors_export_loads_in_transformers_as_the_variant(
    built: dict[str, Path], tmp_path: Path, rows: torch.Tensor
) -> None:
    for name in CT_EXPORTABLE:
        ct, hf = tmp_path / f"{name}-ct", tmp_path / f"{name}-hf"
        info = export(built[name], "compressed-tensors", ct)
        export(built[name], "hf", hf)
        quant = json.loads((ct / "config.json").read_text())["quantization_config"]
        assert quant["quant_method"] == "compressed-tensors"
        assert quant["format"] == "pack-quantized"
        formats = read_load_spec(built[name]).module_formats
        targets = [t for g in quant["config_groups"].values() for t in g["targets"]]
        assert sorted(targets) == sorted(formats), name  # every packed module, once
        for group in quant["config_groups"].values():  # each module keeps its own format
            w = group["weights"]
            fmt = f"int{w['num_bits']}" + (f"-g{w['group_size']}" if w["group_size"] else "")
            assert {formats[t] for t in group["targets"]} == {fmt}, name
        assert sum(len(v) for v in info["schemes"].values()) == len(formats)
        symmetric = all(g["weights"]["symmetric"] for g in quant["config_groups"].values())
        assert symmetric == (name in ("rtn-sym", "gptq8-g32")), name
        expected = _logits(hf, rows)
        assert read_load_spec(ct).format == "hf-quantized"
        with torch.no_grad():
            ours = load_model(ct)(rows).logits
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        if symmetric:  # a plain from_pretrained, codes kept packed until the first forward
            torch.testing.assert_close(_logits(ct, rows), expected, rtol=0, atol=1e-4)
        elif len(quant["config_groups"]) == 1:
            got = _logits(ct, rows, dequantize=True)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    mixed = json.loads((tmp_path / "mixed-ct" / "config.json").read_text())
    assert len(mixed["quantization_config"]["config_groups"]) >= 2


def test_compressed_tensors_export_stays_packed_on_disk(
    built: dict[str, Path], tmp_path: Path
) -> None:
    ct = export(built["gptq"], "compressed-tensors", tmp_path / "ct")
    hf = export(built["gptq"], "hf", tmp_path / "hf")
    assert ct["bytes"] < hf["bytes"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ct" / "model.safetensors"), framework="pt") as f:
        packed = [k for k in f.keys() if k.endswith(".weight_packed")]  # noqa: SIM118
        assert packed and all(f.get_tensor(k).dtype == torch.int32 for k in packed)


def test_hqq_to_compressed_tensors_is_refused_and_writes_nothing(
    built: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "hqq-ct"
    with pytest.raises(ExportError, match=r"float zero points.*export it as hf"):
        export(built["hqq"], "compressed-tensors", out)
    assert list(tmp_path.iterdir()) == []


def test_bitsandbytes_variant_names_what_it_exports_to(tmp_path: Path) -> None:
    src = tmp_path / "nf4"
    src.mkdir()
    quant = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(ExportError, match=r"hf-quantized \(bitsandbytes\) variant cannot be"):
        export(src, "hf", tmp_path / "out")


def test_a_failed_export_leaves_nothing(
    built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(export_mod, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        export(built["rtn"], "compressed-tensors", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_export_and_its_errors(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rtn-ct"
    assert (
        main(["export", str(built["rtn"]), "--format", "compressed-tensors", "--out", str(out)])
        == 0
    )
    assert "pack-quantized" in capsys.readouterr().out
    assert (
        main(["export", str(built["rtn"]), "--format", "compressed-tensors", "--out", str(out)])
        == 2
    )
    assert "exists; remove it or pass another --out" in capsys.readouterr().err
    assert main(["export", str(built["rtn"]), "--format", "xml", "--out", str(tmp_path / "g")]) == 2
    assert "--format: found 'xml'; allowed: hf, compressed-tensors, gguf" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), "--format", "hf"]) == 2
    assert "not a variant dir" in capsys.readouterr().err


def _full_after(limit: int) -> object:
    """A writer's file that takes `limit` bytes, then fails as a full disk does (ENOSPC)."""
    import errno
    import os

    class Full:
        def __init__(self, f: object) -> None:
            self.f, self.left = f, limit

        def __getattr__(self, name: str) -> object:  # tell, flush, close: the file's own
            return getattr(self.f, name)

        def write(self, data: bytes) -> int:
            if len(data) > self.left:
                self.f.write(bytes(data)[: self.left])  # type: ignore[attr-defined]
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.f.write(data)  # type: ignore[attr-defined, no-any-return]

    return Full


def _nothing_left(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == [], "a temporary dir was left behind"


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_full_disk_mid_export_is_one_error_naming_the_file(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """A write that failed mid-export (a full disk) ended in a traceback (`OSError: 57600
    requested and 3808 written`); now one ExportError naming the file and the cause, and
    nothing left behind. The disk fills after 4 kB of the weights file (the writer's file
    injected at the boundary: safetensors' for hf, gguf's tensor writer for gguf)."""
    import gguf
    import numpy as np

    full = _full_after(4096)
    if fmt == "hf":

        def save_file(state: dict, filename: str, metadata: dict) -> None:
            from safetensors.torch import save

            with open(filename, "wb") as f:
                full(f).write(save(state, metadata))  # type: ignore[operator]

        monkeypatch.setattr(export_mod, "save_file", save_file)
    else:
        real = gguf.GGUFWriter.write_tensors_to_file

        class Through:
            """A tensor whose `tofile` goes through the file's `write` (numpy's needs a real
            file descriptor, which would bypass the full disk)."""

            def __init__(self, array: np.ndarray) -> None:
                self.array, self.nbytes = array, array.nbytes

            def tofile(self, f: object) -> None:
                f.write(self.array.tobytes())  # type: ignore[attr-defined]

        def write_tensors(self: gguf.GGUFWriter, **kwargs: object) -> None:
            self.fout = [full(f) for f in self.fout]  # type: ignore[operator, union-attr]
            for tensors in self.tensors:
                for info in tensors.values():
                    info.tensor = Through(info.tensor)  # type: ignore[assignment, arg-type]
            real(self, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", write_tensors)
    out = tmp_path / "exports" / "out"
    with pytest.raises(ExportError) as caught:
        export(tiny_model_dir, fmt, out)
    name = "model.safetensors" if fmt == "hf" else "model.gguf"
    assert str(caught.value).startswith(
        f"{out / name}: the write failed: No space left on device; nothing was written"
    )
    _nothing_left(out)


@pytest.mark.e2e  # `workbench export` in a subprocess under a file size limit
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_file_size_limit_mid_export_is_one_line_from_the_cli(
    tiny_model_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """A real failed write: RLIMIT_FSIZE of 100 kB (SIGXFSZ ignored, so the write fails with
    EFBIG instead of killing the process) below the 440 kB weights file."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    out = tmp_path / "exports" / "out"
    out.parent.mkdir()
    root = Path(__file__).resolve().parents[2]
    argv = ["export", str(tiny_model_dir), "--format", fmt, "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-B", "-m", "workbench.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        preexec_fn=limited,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    name = "model.safetensors" if fmt == "hf" else "model.gguf"
    assert len(errors) == 1 and errors[0].startswith(f"error: {out / name}: the write failed: ")
    cause = "File too large" if fmt == "hf" else "a short write"
    assert cause in errors[0] and "nothing was written" in errors[0]
    _nothing_left(out)
