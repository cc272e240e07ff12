"""bitsandbytes int8 without outlier columns (`threshold: 0`) exported as compressed-tensors W8A8:
the export holds the variant's own int8 codes and scales, those tensors under W8A8's rule (int8
inputs per token) compute what bitsandbytes computes, transformers reads the export as W8A8, and
an int8 variant with outlier columns is refused, naming the setting that makes it exportable."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compress.export import ExportError, export
from compress.load_model import load_model
from compress.quantize import LibraryParams
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe

RECIPE = """\
name: w8a8
base: demo-tiny
variants:
  - {name: w8a8, steps: [{quantize: {method: bnb-int8, threshold: 0}}]}
  - {name: int8, steps: [{quantize: {method: bnb-int8}}]}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w8a8")
    (root / "recipe.yaml").write_text(RECIPE)
    recipe, ref = load_recipe(root / "recipe.yaml")
    return {r.name: r.path for r in Pipeline(recipe, ref, root / "work").run()}


@pytest.fixture(scope="module")
def exported(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ct") / "w8a8-ct"
    export(built["w8a8"], "compressed-tensors", out)
    return out


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))


def test_w8a8_export_holds_the_variants_int8_codes_and_scales(
    built: dict[str, Path], exported: Path
) -> None:
    stored = load_file(str(built["w8a8"] / "model.safetensors"))
    tensors = load_file(str(exported / "model.safetensors"))
    modules = sorted(k.removesuffix(".SCB") for k in stored if k.endswith(".SCB"))
    assert modules and "lm_head" not in modules
    for name in modules:
        assert tensors[f"{name}.weight"].dtype == torch.int8
        assert torch.equal(tensors[f"{name}.weight"], stored[f"{name}.weight"]), name
        scale = tensors[f"{name}.weight_scale"]
        assert scale.shape == (len(stored[f"{name}.SCB"]), 1) and scale.dtype == torch.float32
        assert torch.equal(scale[:, 0], stored[f"{name}.SCB"] / 127.0), name
    assert not any(k.endswith((".SCB", ".weight_format")) for k in tensors)
    quant = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "int-quantized"
    (group,) = quant["config_groups"].values()
    assert sorted(group["targets"]) == modules
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["strategy"], w["symmetric"]) == (8, "channel", True)
    assert (a["num_bits"], a["strategy"], a["symmetric"], a["dynamic"]) == (8, "token", True, True)


def _each_linear(
    model: torch.nn.Module, names: set[str], rows: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (its input, its output)} for one forward pass of `rows`."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor):
            seen[name] = (
                inputs[0].reshape(-1, inputs[0].shape[-1]),
                output.reshape(-1, output.shape[-1]),
            )

        return hook

    for name, module in model.named_modules():
        if name in names:
            module.register_forward_hook(keep(name))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(rows)
    return seen


def test_w8a8_tensors_compute_what_bitsandbytes_computes(
    built: dict[str, Path], exported: Path, rows: torch.Tensor
) -> None:
    """Per linear, on the variant's own activations: W8A8 with the export's codes and scales
    (inputs rounded per token as bitsandbytes rounds them: float16, x * 127 / absmax) gives the
    variant's output; weight-only int8 (inputs unrounded) does not."""
    tensors = load_file(str(exported / "model.safetensors"))
    names = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    seen = _each_linear(load_model(built["w8a8"]), names, rows)
    assert set(seen) == names
    for name, (x, y) in seen.items():
        codes, scale = tensors[f"{name}.weight"].float(), tensors[f"{name}.weight_scale"]
        absmax = x.half().abs().amax(-1, keepdim=True).float()
        x_codes = torch.round(x.half() * (127.0 / absmax))
        w8a8 = (x_codes @ codes.t()) * (absmax / 127.0) * scale.t()
        torch.testing.assert_close(y, w8a8, rtol=1e-4, atol=1e-5)
        weight_only = x @ (codes * scale).t()
        assert (y - weight_only).abs().max() > 10 * (y - w8a8).abs().max(), name


def test_transformers_reads_the_export_as_w8a8(
    built: dict[str, Path], exported: Path, rows: torch.Tensor
) -> None:
    """transformers (compressed-tensors' reference) quantizes each input per token with its own
    rule (absmax / 127.5, codes in [-128, 127]) before the int8 weights; its logits are those of
    that computation, and the variant's next-token choices mostly survive the rounding rule."""
    tensors = load_file(str(exported / "model.safetensors"))
    names = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    model = load_model(exported)
    seen = _each_linear(model, names, rows)
    for name, (x, y) in seen.items():
        step = x.abs().amax(-1, keepdim=True) / 127.5
        x_q = torch.round(x / step).clamp(-128, 127) * step
        dense = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
        torch.testing.assert_close(y, x_q @ dense.t(), rtol=1e-4, atol=1e-5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(built["w8a8"])(rows).logits
        theirs = model(rows).logits
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_bnb_int8_with_outlier_columns_is_refused_naming_threshold_0(
    built: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match=r"activations above 6.0.*threshold: 0"):
        export(built["int8"], "compressed-tensors", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_threshold_0_is_a_setting_and_a_negative_one_is_not() -> None:
    assert LibraryParams(method="bnb-int8", threshold=0).threshold == 0
    with pytest.raises(ValueError, match="threshold"):
        LibraryParams(method="bnb-int8", threshold=-1)


def test_the_engine_serves_the_w8a8_export_as_transformers_runs_it(exported: Path) -> None:
    """Decompressed at load (not by a hook inside the engine's first step), its linears kept
    with their input rounding (not swapped for the engine's packed float kernels); greedy tokens
    equal transformers' `generate` on the same export."""
    from serve import LLM, SamplingParams

    prompts = [[1, 5, 9, 20], [1, 44, 3, 300, 12, 7], [1, 250, 251]]
    llm = LLM(str(exported), dtype="float32")
    linears = [
        m for n, m in llm.engine.runner.model.named_modules() if n.endswith("self_attn.q_proj")
    ]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert all(m.quantization_scheme.input_activations.strategy == "token" for m in linears)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = [c.token_ids for c in llm.generate(prompts, params)]
    model = load_model(exported)
    with torch.no_grad():
        expected = [
            model.generate(
                torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    assert ours == expected
