"""K-quant GGUF exports through llama.cpp's quantizer: found or refused with the fix, called as
llama.cpp's tool or through llama-cpp-python's bindings, and (where a real quantizer is at hand)
a file whose weights transformers' GGUF import reads back as the stored blocks dequantize."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compress.export import ExportError, export
from compress.gguf_export import GGUF_FILE, permuted
from compress.gguf_kquants import ENV, find_quantizer
from workbench.cli import main


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def no_quantizer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))


def test_a_k_quant_without_a_quantizer_is_refused_before_anything_is_written(
    tiny_model_dir: Path, tmp_path: Path, no_quantizer: None, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"llama\.cpp's quantizer and none was found") as e:
        export(tiny_model_dir, "gguf", out, "q4_k_m")
    assert "--llama-quantize" in str(e.value) and "q4_1" in str(e.value)
    assert not out.exists() and not any(tmp_path.glob("*.tmp*"))
    code = main(["export", str(tiny_model_dir), "--format", "gguf", "--gguf-type", "q6_k",
                 "--out", str(out), "--llama-quantize", str(tmp_path / "nope")])  # fmt: skip
    assert code == 2 and "'" + str(tmp_path / "nope") + "' is not an executable" in (
        capsys.readouterr().err
    )
    assert not out.exists()


def test_an_adapter_is_refused_a_k_quant(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ExportError, match="not LoRA files; a GGUF LoRA is f32, f16, bf16 or q8_0"):
        export(adapter, "gguf", tmp_path / "out", "q4_k_m")


def test_llama_quantize_is_called_as_llama_cpp_s_tool(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`llama-quantize IN OUT TYPE` on the float file, which is gone afterwards."""
    calls = tmp_path / "calls"
    tool = _script(tmp_path / "llama-quantize", f'echo "$@" > {calls}\ncp "$1" "$2"\n')
    info = export(tiny_model_dir, "gguf", tmp_path / "out", "q4_k_m", str(tool))
    source, target, kind = calls.read_text().split()
    assert Path(target).name == GGUF_FILE and kind == "Q4_K_M"
    assert Path(source).name == "float.gguf" and not Path(source).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [GGUF_FILE]
    assert info["gguf_type"] == "q4_k_m"  # the stand-in copied: the tensors it reports are F32
    count = len(gguf.GGUFReader(str(tmp_path / "out" / GGUF_FILE)).tensors)
    assert info["schemes"] == {"F32 (GGUF)": [f"{count} tensors"]}


def test_a_python_quantizer_calls_the_bindings_with_llama_cpp_s_ftype(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    python = _script(
        tmp_path / "python3",
        f'printf "%s\\n" "$1" "$3" "$4" "$5" > {calls}\nprintf "%s" "$2" > {calls}.py\ncp "$3" "$4"\n',
    )
    monkeypatch.setenv(ENV, str(python))
    assert find_quantizer() == python
    export(tiny_model_dir, "gguf", tmp_path / "out", "q5_k_m")
    flag, source, target, ftype = calls.read_text().splitlines()
    assert flag == "-c" and "llama_cpp.llama_model_quantize(" in (tmp_path / "calls.py").read_text()
    assert source.endswith("float.gguf") and target.endswith(GGUF_FILE)
    assert ftype == "17"  # LLAMA_FTYPE_MOSTLY_Q5_K_M


def test_a_failing_quantizer_leaves_no_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    tool = _script(tmp_path / "llama-quantize", 'echo "unsupported tensor layout" >&2\nexit 3\n')
    with pytest.raises(ExportError, match="exit code 3"):
        export(tiny_model_dir, "gguf", tmp_path / "out", "q4_k_m", str(tool))
    assert not (tmp_path / "out").exists()


def _real_quantizer() -> str | None:
    return os.environ.get(ENV) or shutil.which("llama-quantize")


@pytest.mark.skipif(
    _real_quantizer() is None,
    reason=f"no llama.cpp quantizer here (${ENV} or llama-quantize on PATH)",
)
def test_a_real_k_quant_reads_back_as_its_stored_blocks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    info = export(tiny_model_dir, "gguf", tmp_path / "out", "q4_k_m")
    path = tmp_path / "out" / GGUF_FILE
    reader = gguf.GGUFReader(str(path))
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds - {"F32"} and kinds <= {"F32", "F16", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1",
                                          "Q5_0", "Q5_1", "Q8_0"}  # fmt: skip
    assert set(info["schemes"]) == {f"{k} (GGUF)" for k in kinds}
    stored = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(d) for d in reversed(t.shape)]
        )
        for t in reader.tensors
    }
    config = AutoConfig.from_pretrained(tiny_model_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file=GGUF_FILE)
    for hf_name, weight in loaded.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if hf_name == "lm_head.weight" and name not in stored:
            continue  # tied to the embedding
        expected = torch.from_numpy(np.ascontiguousarray(stored[name]))
        assert torch.equal(permuted(hf_name, weight.float(), config), expected), hf_name
