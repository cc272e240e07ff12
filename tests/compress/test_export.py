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
from compress.load_spec import load_model, read_load_spec
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
